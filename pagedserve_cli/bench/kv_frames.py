"""Pictures of KV pools over a run: block maps side by side (kv_map.gif, kv_map.png) and slot usage (kv_usage.png)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pagedserve_cli.bench.kv_sampler import usage_of
from pagedserve_cli.kv_state import CACHED, FREE, KVSnapshot, owner_colour, xterm_rgb

COLUMNS = 32  # blocks per row of a map
CELL = 10  # pixels per block, its 1-pixel gap included
TITLE_H = 46
MAX_FRAMES = 120
FRAME_MS = 100
FREE_RGB = (236, 236, 236)
CACHED_FREE_RGB = (190, 190, 190)
BACKGROUND = (255, 255, 255)


def request_colour(request_id: str) -> tuple[int, int, int]:
    """The request's colour in `pagedserve kv-map`, as RGB."""
    return xterm_rgb(owner_colour(request_id))


def block_map(state) -> np.ndarray:
    """An RGB image of one KVState: a cell per block, left to right and top to bottom by block id.

    Free blocks are light grey, cached free ones (a prefix hit can still revive them) mid grey. A held block
    takes its first holder's colour: solid for the slots holding tokens (from the bottom up), pale for the
    reserved slots still empty. A block held by several sequences (a prefix hit) gets a black frame.
    """
    s = KVSnapshot.from_pb(state)
    n, bs = s.num_blocks, s.block_size
    rows = -(-n // COLUMNS)
    img = np.full((rows * CELL, COLUMNS * CELL, 3), BACKGROUND, dtype=np.uint8)
    colours = [np.array(request_colour(r), dtype=np.uint16) for r in s.request_ids]
    full = np.array((60, 60, 60), dtype=np.uint16)  # a used block no listed sequence holds (never expected)
    inner = CELL - 1
    for bid, (owner, fill, rc) in enumerate(zip(s.owner, s.filled, s.ref_counts)):
        y, x = bid // COLUMNS * CELL, bid % COLUMNS * CELL
        cell = img[y:y + inner, x:x + inner]
        if owner == FREE or owner == CACHED:
            cell[:] = CACHED_FREE_RGB if owner == CACHED else FREE_RGB
            continue
        colour = colours[owner] if owner >= 0 else full
        cell[:] = ((colour + 3 * 255) // 4).astype(np.uint8)  # pale: reserved, no token yet
        solid = round(inner * fill / bs)
        if solid:
            cell[inner - solid:] = colour.astype(np.uint8)
        if rc > 1:
            cell[0, :] = cell[-1, :] = cell[:, 0] = cell[:, -1] = 0
    return img


def _caption(name: str, state, t: float) -> list[str]:
    u = usage_of(state, t)
    return [f"{name}  t={t:.1f}s",
            f"{u.num_running} running, {u.num_waiting} waiting; {u.filled:,} of {u.reserved:,} held slots "
            f"hold tokens; waste {u.waste:.0%}"]


def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: one bitmap size
        return ImageFont.load_default()


def frame(panels: list[tuple[str, object, float]]):
    """One PIL image: a block map per (side name, KVState, t), side by side, each captioned with its figures."""
    from PIL import Image, ImageDraw

    maps = [block_map(state) for _, state, _ in panels]
    width = sum(m.shape[1] for m in maps) + 24 * (len(maps) + 1)
    width = max(width, 420 * len(maps))
    height = max(m.shape[0] for m in maps) + TITLE_H + 16
    img = Image.new("RGB", (width, height), BACKGROUND)
    draw, font = ImageDraw.Draw(img), _font(12)
    x, slot = 24, width // len(maps)
    for (name, state, t), m in zip(panels, maps):
        for k, line in enumerate(_caption(name, state, t)):
            draw.text((x, 6 + 16 * k), line, fill=(0, 0, 0), font=font)
        img.paste(Image.fromarray(m), (x, TITLE_H))
        x += slot
    return img


def _at(states: list[tuple[float, object]], t: float):
    """The last sample taken at or before t (the first one before any)."""
    best = states[0]
    for s in states:
        if s[0] > t:
            break
        best = s
    return best


def frame_times(sides: list[tuple[str, list]]) -> list[float]:
    end = max(states[-1][0] for _, states in sides)
    dt = max(0.25, end / MAX_FRAMES)
    return [k * dt for k in range(int(end / dt) + 1)]


def write_gif(path: Path, sides: list[tuple[str, list]]) -> Path:
    """An animated GIF of the block maps side by side, every side at the same time into its run."""
    frames = [frame([(name, _at(states, t)[1], t) for name, states in sides]) for t in frame_times(sides)]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=FRAME_MS, loop=0, optimize=True)
    return path


def busiest_time(states: list[tuple[float, object]]) -> float:
    """When the first side held the most slots (docs/kv-cache.md's still picture)."""
    return max(states, key=lambda s: usage_of(s[1], s[0]).reserved)[0]


def write_usage_plot(path: Path, title: str, sides: list[tuple[str, list]]) -> Path:
    """Slots held vs slots holding tokens over time, and sequences running, one colour per side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for k, (name, states) in enumerate(sides):
        us = [usage_of(s, t) for t, s in states]
        ts = [u.t for u in us]
        colour = f"C{k}"
        top.plot(ts, [u.reserved + u.stranded for u in us], color=colour, ls="--", label=f"{name}: held + stranded")
        top.plot(ts, [u.filled for u in us], color=colour, label=f"{name}: holding tokens")
        bottom.plot(ts, [u.num_running for u in us], color=colour, label=name)
    top.set_ylabel("KV slots (tokens)")
    top.set_title(title)
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    bottom.set_ylabel("sequences running")
    bottom.set_xlabel("time since the run started (s)")
    bottom.legend(fontsize=8)
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_pictures(out: Path, title: str, sides: list[tuple[str, list]]) -> list[str]:
    """kv_map.gif, kv_map.png (the first side's busiest moment, every side at that time) and kv_usage.png."""
    sides = [(name, states) for name, states in sides if states]
    if not sides:
        return []
    write_gif(out / "kv_map.gif", sides)
    t = busiest_time(sides[0][1])
    frame([(name, _at(states, t)[1], t) for name, states in sides]).save(out / "kv_map.png")
    write_usage_plot(out / "kv_usage.png", title, sides)
    return ["kv_map.gif", "kv_map.png", "kv_usage.png"]
