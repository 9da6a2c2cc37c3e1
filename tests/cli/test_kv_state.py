"""kv-map's pure parts on hand-built snapshots: per-block owner/fill, exact figures, the grid's cells."""

import re

import pytest

from pagedserve_cli.kv_render import GLYPHS, blocks_per_cell, cells, render
from pagedserve_cli.kv_state import (CACHED, FREE, PALETTE, KVSequence, KVSnapshot, figures, largest_free_run,
                                     owner_colour, xterm_rgb)


def snap(block_size: int, num_blocks: int, sequences: list[KVSequence], cached=(), **counters) -> KVSnapshot:
    rc = [0] * num_blocks
    for s in sequences:
        for b in s.block_ids:
            rc[b] += 1
    return KVSnapshot.build("worker-0", block_size, rc, [int(b in cached) for b in range(num_blocks)], sequences,
                            **counters)


def static_layout() -> KVSnapshot:
    """Whole reservations (a static allocator's), with holes between them: blocks 3-4, 7-8 and 11 are free."""
    return snap(4, 12, [KVSequence("a", 1, [0, 1, 2], 5), KVSequence("b", 2, [5, 6], 8, "team b"),
                        KVSequence("c", 3, [9, 10], 3)], cached={4}, kv_allocation="static-request", num_steps=7,
                num_waiting=2)


def test_owner_and_fill_per_block():
    s = static_layout()
    assert s.request_ids == ["a", "b", "c"]
    assert s.owner == [0, 0, 0, FREE, CACHED, 1, 1, FREE, FREE, 2, 2, FREE]
    assert s.filled == [4, 1, 0, 0, 0, 4, 4, 0, 0, 3, 0, 0]


def test_figures_of_a_static_layout_with_holes():
    f = figures(static_layout())
    assert (f["num_used_blocks"], f["num_free_blocks"], f["num_cached_free_blocks"], f["num_shared_blocks"]) == \
        (7, 5, 1, 0)
    assert (f["num_running"], f["num_waiting"], f["num_steps"], f["kv_allocation"]) == (3, 2, 7, "static-request")
    assert (f["num_slots_allocated"], f["num_slots_filled"]) == (28, 16)  # 7 blocks of 4; 5 + 8 + 3 tokens
    assert f["slot_utilization"] == pytest.approx(16 / 28)
    assert f["internal_fragmentation"] == pytest.approx(12 / 28)
    # free: 3 4 | 7 8 | 11: the largest run is 2 of 5 free blocks, so 3 of them lie outside it
    assert f["largest_free_run"] == 2 and f["external_fragmentation"] == pytest.approx(3 / 5)


def test_shared_blocks_count_once_and_a_shared_partial_block_counts_its_longest_holder():
    # b hit a's two full prompt blocks; c and d are two samples forked onto a partial block (d is 2 tokens behind)
    s = snap(16, 8, [KVSequence("a", 0, [0, 1, 2], 40), KVSequence("b", 1, [0, 1, 3], 36),
                     KVSequence("c", 2, [4, 5], 20), KVSequence("c", 3, [4, 5], 18)],
             prefix_query_tokens=80, prefix_hit_tokens=32)
    assert s.owner[:6] == [0, 0, 0, 1, 2, 2] and s.request_ids == ["a", "b", "c"]
    assert s.filled[:6] == [16, 16, 8, 4, 16, 4]
    f = figures(s)
    assert (f["num_used_blocks"], f["num_shared_blocks"], f["num_slots_allocated"], f["num_slots_filled"]) == \
        (6, 4, 96, 64)
    assert f["internal_fragmentation"] == pytest.approx(32 / 96) and f["prefix_hit_rate"] == pytest.approx(0.4)
    assert f["largest_free_run"] == 2 and f["external_fragmentation"] == 0.0


def test_an_empty_pool():
    f = figures(snap(16, 4, []))
    assert (f["num_used_blocks"], f["num_free_blocks"], f["slot_utilization"], f["internal_fragmentation"],
            f["external_fragmentation"], f["prefix_hit_rate"]) == (0, 4, 0.0, 0.0, 0.0, 0.0)
    full = figures(snap(16, 2, [KVSequence("a", 0, [0, 1], 32)]))
    assert (full["num_free_blocks"], full["external_fragmentation"], full["internal_fragmentation"]) == (0, 0.0, 0.0)


def test_largest_free_run():
    assert largest_free_run([]) == 0
    assert largest_free_run([1, 0, 0, 1, 0, 0, 0]) == 3


def test_a_block_outside_the_pool_is_refused():
    with pytest.raises(ValueError, match="block 9"):
        KVSnapshot.build("w", 16, [1, 0, 0, 0], [0] * 4, [KVSequence("a", 0, [9], 3)])


def test_colours_are_stable_and_from_the_palette():
    assert owner_colour("req-1") == owner_colour("req-1") and owner_colour("req-1") in PALETTE
    assert len({owner_colour(f"r{i}") for i in range(50)}) > 30
    assert xterm_rgb(16) == (0, 0, 0) and xterm_rgb(231) == (255, 255, 255) and xterm_rgb(196) == (255, 0, 0)


def test_cells_show_fill_sharing_and_cache():
    s = snap(16, 8, [KVSequence("a", 0, [0, 1, 2], 40), KVSequence("b", 1, [0, 1, 3], 36),
                     KVSequence("s", 2, [4], 0)], cached={6})
    assert "".join(c.glyph for c in cells(s)) == "22▄▄▁·░·"
    assert cells(s)[0].colour == owner_colour("a") and cells(s)[3].colour == owner_colour("b")


def test_blocks_group_into_cells_past_40_rows():
    assert blocks_per_cell(400, 10) == 1 and blocks_per_cell(401, 10) == 2 and blocks_per_cell(10**6, 100) == 250
    s = snap(16, 1000, [KVSequence("a", 0, list(range(0, 5)), 80)])
    grouped = cells(s, 3)  # blocks 0-2 full, 3-5: two full of three
    assert len(grouped) == 334 and grouped[0].glyph == "█" and grouped[1].glyph == "█" and grouped[2].glyph == "·"


def grid(text: str) -> list[str]:
    return [m.group(1) for line in text.splitlines() if (m := re.fullmatch(r"\s*\d+ (\S+)", line))
            and set(m.group(1)) <= GLYPHS]


def test_render_without_colour_is_plain_text_with_one_cell_per_block():
    text = render(static_layout(), width=5, source="127.0.0.1:1")
    assert "\x1b" not in text
    assert grid(text) == ["█▄▁·░", "██··▄", "▁·"]
    for words in ("kv allocation static-request", "step 7", "block size 4 tokens · 12 blocks · 1 cell = 1 block",
                  "used 7 (0 shared) · free 5 (1 cached)", "running 3 · waiting 2", "16/28 filled (57.1%)",
                  "internal fragmentation 42.9%", "external fragmentation 60.0%: largest free run 2 of 5",
                  "a  seq 1 · 5 tokens · 3 blocks\n", "b  seq 2 · 8 tokens · 2 blocks · tenant 'team b'\n"):
        assert words in text, words
    big = render(snap(16, 1000, []), width=10)
    assert "1 cell = 3 blocks" in big and sum(map(len, grid(big))) == 334 and len(grid(big)) == 34


def test_render_with_colour_paints_owners():
    text = render(static_layout(), width=5, colour=True)
    assert f"\x1b[38;5;{owner_colour('a')}m█" in text and "\x1b[2m░" in text


def test_the_pure_modules_import_neither_grpc_nor_protobuf():
    import subprocess
    import sys

    code = ("import sys, pagedserve_cli.kv_state, pagedserve_cli.kv_render, scheduler_svc.core.kv_snapshot; "
            "print(sorted(m for m in ('grpc', 'google.protobuf', 'pagedserve.v1', 'torch') if m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"
