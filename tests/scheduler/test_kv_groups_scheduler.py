"""The scheduler over KV groups (SchedulerConfig.kv_group_windows): random workloads keep every group's KV readable
inside its window (the FakeWorker writes every group's slot and reads a sliding group's back only from the window of
each step's first query), ref counts equal the blocks the tables hold, every block comes back; the capacity checks
count a sliding group's blocks up to its window; and what KV groups do not support is refused by name."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pagedserve_common.sampling import InvalidField, SamplingParams
from scheduler_svc.core.request import Request
from tests.support.scheduler import FakeWorker, make, random_steps, req, step, toks


@pytest.mark.parametrize("seed", range(24))
def test_random_workloads_over_kv_groups_read_every_window_back_and_free_every_block(seed):
    rng = random.Random(seed)
    windows = rng.choice([(0, 16, 16), (0, 24), (16,), (0, 0, 16)])
    s = make(num_blocks=rng.randint(12, 60), max_model_len=60, max_num_seqs=rng.randint(3, 8),
             max_num_batched_tokens=rng.randint(4, 40), eos_token_ids=(3,), kv_group_windows=windows,
             speculative=rng.choice(["none", "ngram"]))

    def new_request(i: int) -> Request:
        shared = rng.choice([[], toks(0, 9), toks(0, 33)])
        return Request(str(i), shared + [rng.randrange(100, 200) for _ in range(rng.randint(1, 12))],
                       SamplingParams(max_tokens=rng.randint(1, 30), n=rng.choice([1, 1, 2, 3])),
                       cache_salt=rng.choice([None, None, "x"]), priority=rng.choice([0, 0, 1, -1]))

    def check(w: FakeWorker) -> None:
        held = Counter()
        for q in s.running:
            if q.on_worker:
                assert w.seqs[q.seq_id]["blocks"] == s.kv.block_table(q.seq_id)
        for seq_id in list(s.kv._seqs):
            held.update(s.kv.held_block_ids(seq_id))
        assert all(s.kv.pool.ref_cnt[b] == n for b, n in held.items())
        assert s.kv.pool.num_used_blocks == len(held)

    w, reqs = random_steps(s, rng, new_request, 1500, check)
    assert not s.has_unfinished_requests() and s.kv.pool.num_free_blocks == s.config.num_blocks
    assert w.seqs == {}


def test_a_sliding_group_counts_its_window_in_the_capacity_checks():
    # 2 groups (full, window 16), blocks of 8, steps of at most 8 tokens of a sequence: the sliding group holds at most
    # ceil((16 - 1 + 8) / 8) + 1 = 4 blocks. 100 tokens: 13 + 4 = 17 blocks, where two full groups would need 26.
    s = make(num_blocks=17, max_model_len=200, max_num_batched_tokens=8, kv_group_windows=(0, 16))
    s.add_request(req("a", toks(0, 10), max_tokens=90))
    with pytest.raises(InvalidField) as e:
        s.add_request(req("b", toks(0, 10), max_tokens=91))  # 101 tokens: 13 + 4 = 17 still ...
        s.add_request(req("c", toks(0, 10), max_tokens=97))  # ... 107: 14 + 4 = 18
    assert e.value.field == "max_tokens"
    assert s.max_output_tokens(10) == 94  # 104 tokens: 13 blocks of the full group, 4 of the sliding one


def test_kv_groups_refuse_swap_space_and_static_reservations_by_name():
    with pytest.raises(ValueError, match="swap space"):
        make(num_blocks=8, kv_group_windows=(0, 16), num_cpu_blocks=4)
    with pytest.raises(ValueError, match="kv_allocation static-request"):
        make(num_blocks=8, kv_group_windows=(0, 16), kv_allocation="static-request")


def test_kv_map_lists_the_blocks_a_sequence_holds_and_fills_only_its_last_logical_blocks():
    from pagedserve_cli.kv_state import CACHED, KVSnapshot, figures
    from scheduler_svc.core.kv_snapshot import snapshot

    s, w = make(num_blocks=32, max_num_batched_tokens=64, kv_group_windows=(0, 16)), FakeWorker(group_windows=(0, 16))
    s.add_request(req("a", toks(0, 40), max_tokens=10))
    step(s, w)  # the prompt whole: 5 logical blocks x 2 groups, blocks 0..9
    step(s, w)  # the query at 40 sees 25..40: group 1's blocks of tokens 0..23 (1, 3, 5) are freed; 10, 11 appended
    seq_id = s.running[0].seq_id
    assert s.kv.block_table(seq_id) == list(range(12))
    snap = KVSnapshot.from_pb(snapshot("worker-0", s))
    assert (snap.num_kv_groups, snap.sequences[0].block_ids) == (2, [0, 2, 4, 6, 7, 8, 9, 10, 11])
    assert snap.filled[:12] == [8, 0, 8, 0, 8, 0, 8, 8, 8, 8, 1, 1]  # 41 tokens: 1 in logical block 5, both groups
    assert [snap.owner[b] for b in (1, 3, 5)] == [CACHED] * 3
    assert figures(snap)["num_used_blocks"] == 9
