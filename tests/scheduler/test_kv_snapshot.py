"""The scheduler's KV snapshot (GetKVState's content): exact block ids, ref counts and cached flags, step by step."""

import pytest

from pagedserve.v1 import generate_pb2
from pagedserve_cli.kv_state import CACHED, FREE, KVSnapshot, figures
from scheduler_svc.grpc.convert import kv_state_to_pb
from scheduler_svc.core.kv_snapshot import SequenceBlocks, cached_bytes, ref_count_bytes, snapshot
from scheduler_svc.core.request import Request
from pagedserve_common.sampling import SamplingParams
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.scheduler import Scheduler

BS = 8
PROMPT = list(range(100, 120))  # 20 tokens: 2 full blocks and 4 tokens


def make(**kw) -> Scheduler:
    return Scheduler(SchedulerConfig(num_blocks=8, max_model_len=64, block_size=BS, **kw))


def run_step(s: Scheduler, token: int = 7) -> None:
    step = s.schedule()
    plan = step.plan
    s.update(step, {p.seq_id: token for p in (*plan.new_seqs, *plan.running)})


def test_an_idle_pool_is_all_free():
    snap = snapshot("worker-0", make())
    assert (snap.worker_id, snap.block_size, snap.num_blocks, snap.kv_allocation) == ("worker-0", BS, 8, "paged")
    assert snap.ref_counts == bytes(8) and snap.cached == bytes(8) and snap.sequences == []
    assert (snap.num_steps, snap.num_waiting, snap.prefix_query_tokens, snap.num_prefill_tokens) == (0, 0, 0, 0)


def test_a_prefix_hit_shares_the_full_prompt_blocks_and_freed_ones_stay_cached():
    s = make(max_num_seqs=4)
    s.add_request(Request("a", PROMPT, SamplingParams(max_tokens=8)))
    step = s.schedule()  # NOTE: the step in flight: its tokens count
    snap = snapshot("w", s)
    assert snap.sequences == [SequenceBlocks("a", 0, [0, 1, 2], 20)]
    assert snap.ref_counts == bytes([1, 1, 1, 0, 0, 0, 0, 0])
    assert snap.cached == bytes([1, 1, 0, 0, 0, 0, 0, 0])  # the full prompt blocks entered the prefix cache
    s.update(step, {0: 7})
    s.add_request(Request("b", PROMPT, SamplingParams(max_tokens=8)))
    run_step(s)  # a decodes its 21st token; b hits blocks 0 and 1 (16 tokens) and gets block 3
    snap = snapshot("w", s)
    assert snap.sequences == [SequenceBlocks("a", 0, [0, 1, 2], 21), SequenceBlocks("b", 1, [0, 1, 3], 20)]
    assert snap.ref_counts == bytes([2, 2, 1, 1, 0, 0, 0, 0])
    assert (snap.prefix_query_tokens, snap.prefix_hit_tokens, snap.num_steps) == (40, 16, 2)
    s.abort("a")
    s.abort("b")
    snap = snapshot("w", s)
    assert snap.sequences == [] and snap.ref_counts == bytes(8)
    assert snap.cached == bytes([1, 1, 0, 0, 0, 0, 0, 0])


def test_waiting_sequences_hold_no_table_and_are_counted():
    s = make(max_num_seqs=1)
    s.add_request(Request("a", PROMPT, SamplingParams(max_tokens=8)))
    s.add_request(Request("b", [5, 6, 7], SamplingParams(max_tokens=8)))
    run_step(s)
    snap = snapshot("w", s)
    assert [q.request_id for q in snap.sequences] == ["a"] and snap.num_waiting == 1


def test_a_static_pool_shows_whole_reservations_prefill_tokens_and_a_head_waiting_for_blocks():
    # static-request: 20 prompt + 12 max_tokens = 32 tokens = 4 blocks each: the 8-block pool holds 2 runs.
    s = make(kv_allocation="static-request")
    for rid in "abc":
        s.add_request(Request(rid, PROMPT, SamplingParams(max_tokens=12)))
    run_step(s)
    snap = snapshot("w", s)
    assert snap.kv_allocation == "static-request" and snap.num_waiting == 1 and snap.waiting_for_blocks
    assert [(q.request_id, q.block_ids, q.num_tokens) for q in snap.sequences] == [
        ("a", [0, 1, 2, 3], 20), ("b", [4, 5, 6, 7], 20)]
    assert snap.ref_counts == bytes([1] * 8) and snap.cached == bytes(8)
    assert snap.num_prefill_tokens == 2 * len(PROMPT)


def test_bytes_encodings():
    assert ref_count_bytes([0, 3, 255, 256, 10_000]) == bytes([0, 3, 255, 255, 255])
    assert cached_bytes([None, ("k", (1,)), None]) == bytes([0, 1, 0])


def test_the_protobuf_round_trip_gives_the_clis_snapshot():
    s = make(max_num_seqs=4)
    for rid in ("a", "b"):
        s.add_request(Request(rid, PROMPT, SamplingParams(max_tokens=8)))
        run_step(s)
    pb = generate_pb2.KVState.FromString(kv_state_to_pb(snapshot("worker-3", s)).SerializeToString())
    snap = KVSnapshot.from_pb(pb)
    # a: 21 tokens computed in [0, 1, 2]; b: 20 in [0, 1, 3] (blocks 0 and 1 hit a's prompt)
    assert snap.request_ids == ["a", "b"] and snap.worker_id == "worker-3"
    assert snap.owner == [0, 0, 0, 1, FREE, FREE, FREE, FREE]
    assert snap.filled == [8, 8, 5, 4, 0, 0, 0, 0]
    assert snap.ref_counts == [2, 2, 1, 1, 0, 0, 0, 0] and snap.cached == [1, 1, 0, 0, 0, 0, 0, 0]
    s.abort("a")
    s.abort("b")
    snap = KVSnapshot.from_pb(kv_state_to_pb(snapshot("worker-3", s)))
    assert snap.owner == [CACHED, CACHED, FREE, FREE, FREE, FREE, FREE, FREE] and snap.sequences == []


def test_static_reservations_show_whole_runs_and_the_holes_between_them():
    if "kv_allocation" not in SchedulerConfig.__dataclass_fields__:
        pytest.skip("this scheduler has no static kv_allocation modes")
    s = make(kv_allocation="static-request", max_num_seqs=4)
    for rid, max_tokens in (("a", 12), ("b", 20), ("c", 4)):  # 4-token prompts: 16, 24 and 8 tokens reserved
        s.add_request(Request(rid, [5, 6, 7, 8], SamplingParams(max_tokens=max_tokens)))
    run_step(s)
    s.abort("b")
    snap = KVSnapshot.from_pb(kv_state_to_pb(snapshot("w", s)))
    assert [(q.request_id, q.block_ids, q.num_tokens) for q in snap.sequences] == [("a", [0, 1], 4), ("c", [5], 4)]
    assert snap.owner == [0, 0, FREE, FREE, FREE, 1, FREE, FREE] and snap.filled == [4, 0, 0, 0, 0, 4, 0, 0]
    f = figures(snap)
    assert f["kv_allocation"] == "static-request"
    assert (f["num_slots_allocated"], f["num_slots_filled"]) == (24, 8)
    assert f["internal_fragmentation"] == pytest.approx(16 / 24)
    assert (f["num_free_blocks"], f["largest_free_run"]) == (5, 3)
    assert f["external_fragmentation"] == pytest.approx(2 / 5)


def test_a_huge_pool_is_described_without_walking_the_blocks_never_used():
    s = Scheduler(SchedulerConfig(num_blocks=1 << 20, max_model_len=64, block_size=BS))
    s.add_request(Request("a", PROMPT, SamplingParams(max_tokens=8)))
    run_step(s)
    snap = snapshot("w", s)
    assert len(snap.ref_counts) == len(snap.cached) == 1 << 20 and s.kv.pool.num_touched_blocks == 3
    assert snap.ref_counts[:4] == bytes([1, 1, 1, 0]) and snap.ref_counts.count(0) == (1 << 20) - 3
    assert snap.cached[:3] == bytes([1, 1, 0]) and snap.cached.count(0) == (1 << 20) - 2
