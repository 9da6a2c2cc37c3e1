"""One text frame of `pagedserve kv-map`: the figures, then a grid of one cell per block (or group of blocks)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from pagedserve_cli.kv_state import CACHED, FREE, UNLISTED, KVSnapshot, figures, owner_colour

MAX_ROWS = 40  # past width x MAX_ROWS blocks, one cell stands for a group of blocks
FREE_GLYPH, CACHED_GLYPH = "·", "░"
FULL_GLYPH, PARTIAL_GLYPH, EMPTY_GLYPH = "█", "▄", "▁"
GLYPHS = frozenset(FREE_GLYPH + CACHED_GLYPH + FULL_GLYPH + PARTIAL_GLYPH + EMPTY_GLYPH + "23456789+")
MAX_LISTED = 8  # sequences listed under the grid
_RESET = "\x1b[0m"


@dataclass(slots=True, frozen=True)
class Cell:
    glyph: str
    colour: int | None = None  # xterm-256 index of the owning request
    dim: bool = False


def blocks_per_cell(num_blocks: int, width: int, max_rows: int = MAX_ROWS) -> int:
    """1 while the pool fits in width x max_rows cells, else the smallest group size that does."""
    return max(1, -(-num_blocks // (width * max_rows)))


def _used_glyph(filled: int, capacity: int, max_ref: int) -> str:
    if max_ref > 1:  # shared: the ref count says more than the fill
        return str(max_ref) if max_ref < 10 else "+"
    if filled >= capacity:
        return FULL_GLYPH
    return PARTIAL_GLYPH if filled else EMPTY_GLYPH


def cells(s: KVSnapshot, group: int = 1) -> list[Cell]:
    """One cell per `group` consecutive blocks. A cell with a used block is drawn as used: the colour of the
    request owning most of its used blocks, the largest ref count when > 1, else its fill (full, part, reserved
    but empty); a free cell is cached free when one of its blocks is in the prefix cache."""
    colours = [owner_colour(r) for r in s.request_ids]
    out = []
    for start in range(0, s.num_blocks, group):
        stop = min(start + group, s.num_blocks)
        owners = [o for o in s.owner[start:stop] if o not in (FREE, CACHED)]
        if not owners:
            cached = CACHED in s.owner[start:stop]
            out.append(Cell(CACHED_GLYPH, dim=True) if cached else Cell(FREE_GLYPH))
            continue
        used = [b for b in range(start, stop) if s.ref_counts[b]]
        top = Counter(owners).most_common(1)[0][0]
        glyph = _used_glyph(sum(s.filled[b] for b in used), len(used) * s.block_size,
                            max(s.ref_counts[b] for b in used))
        out.append(Cell(glyph, None if top == UNLISTED else colours[top]))
    return out


def _paint(cell: Cell, colour: bool) -> str:
    if not colour:
        return cell.glyph
    if cell.dim:
        return f"\x1b[2m{cell.glyph}{_RESET}"
    if cell.colour is None:
        return cell.glyph
    if cell.glyph.isdigit() or cell.glyph == "+":  # black on the request's colour: still a solid cell
        return f"\x1b[48;5;{cell.colour};38;5;16m{cell.glyph}{_RESET}"
    return f"\x1b[38;5;{cell.colour}m{cell.glyph}{_RESET}"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _cache(f: dict) -> str:
    """'int8 cache, 12,240 B/token · ' (nothing from a server that does not say)."""
    if not f.get("kv_cache_dtype"):
        return ""
    per_token = f" ({f['bytes_per_token']:,} B/token)" if f.get("bytes_per_token") else ""
    return f"{f['kv_cache_dtype']} cache{per_token} · "


def figure_lines(f: dict, s: KVSnapshot, source: str, group: int) -> list[str]:
    cell = "1 cell = 1 block" if group == 1 else f"1 cell = {group} blocks (the pool is larger than the map)"
    paged = " (paged: any free block serves, so it costs nothing)" if f["kv_allocation"] == "paged" else ""
    clock = time.strftime("%H:%M:%S", time.localtime(s.time)) if s.time else "-"
    return [
        f"pagedserve kv-map  {source}  {s.worker_id}  kv allocation {f['kv_allocation']}  step {f['num_steps']}  "
        f"{clock}",
        f"block size {f['block_size']} tokens · {f['num_blocks']} blocks · {_cache(f)}{cell}",
        f"blocks: used {f['num_used_blocks']} ({f['num_shared_blocks']} shared) · free {f['num_free_blocks']} "
        f"({f['num_cached_free_blocks']} cached)    sequences: running {f['num_running']} · waiting "
        f"{f['num_waiting']}{' (the first for free blocks)' if f['waiting_for_blocks'] else ''}",
        f"slots: {f['num_slots_filled']}/{f['num_slots_allocated']} filled ({_pct(f['slot_utilization'])}) · "
        f"internal fragmentation {_pct(f['internal_fragmentation'])}",
        f"external fragmentation {_pct(f['external_fragmentation'])}: largest free run {f['largest_free_run']} of "
        f"{f['num_free_blocks']} free blocks{paged}",
        f"prefix cache: hit {_pct(f['prefix_hit_rate'])} ({f['prefix_hit_tokens']}/{f['prefix_query_tokens']} "
        f"tokens) · evictions {f['num_evictions']} · preemptions {f['num_preemptions']} · prefill tokens "
        f"{f['num_prefill_tokens']}",
    ]


def grid_lines(s: KVSnapshot, width: int, colour: bool, group: int) -> list[str]:
    """Rows of `width` cells, each after the id of its first block."""
    painted = [_paint(c, colour) for c in cells(s, group)]
    label = len(str(max(s.num_blocks - 1, 0)))
    return [f"{r * width * group:>{label}} " + "".join(painted[r * width:(r + 1) * width])
            for r in range(-(-len(painted) // width))]


def legend_lines(s: KVSnapshot, colour: bool) -> list[str]:
    lines = [f"{FULL_GLYPH} full  {PARTIAL_GLYPH} partly filled  {EMPTY_GLYPH} reserved, empty  2-9 shared "
             f"(ref count; + for 10 or more)  {_paint(Cell(CACHED_GLYPH, dim=True), colour)} cached free  "
             f"{FREE_GLYPH} free"]
    for seq in s.sequences[:MAX_LISTED]:
        swatch = _paint(Cell(FULL_GLYPH * 2, owner_colour(seq.request_id)), colour)
        # NOTE: the tenant quoted (repr): it is the client's header, and may hold spaces or look like other fields
        tenant = f" · tenant {seq.tenant!r}" if seq.tenant else ""
        lines.append(f"{swatch} {seq.request_id}  seq {seq.seq_id} · {seq.num_tokens} tokens · "
                     f"{len(seq.block_ids)} blocks{tenant}")
    if len(s.sequences) > MAX_LISTED:
        lines.append(f"   ... and {len(s.sequences) - MAX_LISTED} more sequences")
    return lines


def render(s: KVSnapshot, width: int, colour: bool = False, source: str = "", max_rows: int = MAX_ROWS) -> str:
    """The whole frame as text (ANSI colours only with `colour`); `width` is the grid's cells per row."""
    width = max(1, width)
    group = blocks_per_cell(s.num_blocks, width, max_rows)
    lines = [*figure_lines(figures(s), s, source, group), "", *grid_lines(s, width, colour, group), "",
             *legend_lines(s, colour)]
    return "\n".join(lines) + "\n"
