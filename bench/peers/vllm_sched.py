"""vLLM's V1 Scheduler (0.33) driven over a trace with a fake model, on the CPU (no GPU, no weights): the peer of
bench/sched_trace.py, which drives our Scheduler the same way.

All requests are submitted at once (ignore_eos); each step every request whose prefill is complete is handed its
next decode token from the trace. Prints each run's wall time and steps and, last, `median_wall_s=X` (the median
wall). Needs the venv of bench/peers/setup_vllm_core.sh.
usage: VLLM_TARGET_DEVICE=cpu VENV/bin/python bench/peers/vllm_sched.py TRACE.jsonl [--max-num-seqs 64]
       [--max-batched-tokens 8192] [--block-size 16] [--num-blocks 8192] [--runs 3]
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trace import read_trace  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("trace")
p.add_argument("--max-num-seqs", type=int, default=64)
p.add_argument("--max-batched-tokens", type=int, default=8192)
p.add_argument("--block-size", type=int, default=16)
p.add_argument("--num-blocks", type=int, default=8192)
p.add_argument("--runs", type=int, default=3)
a = p.parse_args()

from transformers import LlamaConfig  # noqa: E402
import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import ModelConfig, SchedulerConfig, CacheConfig, VllmConfig  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, FullAttentionSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402

trace = read_trace(a.trace)
max_len = max(len(r["prompt"]) + len(r["decode"]) for r in trace) + a.block_size
model_dir = tempfile.mkdtemp(prefix="vllm-sched-")
LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=max_len,
            architectures=["LlamaForCausalLM"]).save_pretrained(model_dir)
init_none_hash(sha256)
hasher = get_request_block_hasher(a.block_size, sha256)
mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float16", max_model_len=max_len)
sc = SchedulerConfig(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_batched_tokens, max_model_len=max_len,
                     enable_chunked_prefill=True, is_encoder_decoder=False)
cc = CacheConfig(block_size=a.block_size, enable_prefix_caching=True)
vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc)
kvc = KVCacheConfig(num_blocks=a.num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
    ["layer.0"], FullAttentionSpec(block_size=a.block_size, num_kv_heads=2, head_size=64, dtype=torch.float16))])
cc.num_gpu_blocks = a.num_blocks


def run():
    s = Scheduler(vllm_config=vc, kv_cache_config=kvc, block_size=a.block_size, hash_block_size=a.block_size,
                  structured_output_manager=StructuredOutputManager(vc), log_stats=False)
    t0 = time.perf_counter()
    reqs = [Request(str(i), r["prompt"], SamplingParams(max_tokens=len(r["decode"]), ignore_eos=True), None,
                    block_hasher=hasher) for i, r in enumerate(trace)]
    for r in reqs:
        s.add_request(r)
    steps = 0
    while s.has_unfinished_requests():
        so = s.schedule()
        steps += 1
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            r = s.requests[rid]
            done_prefill = r.num_computed_tokens >= r.num_tokens
            sampled.append([trace[int(rid)]["decode"][r.num_output_tokens]] if done_prefill else [])
        s.update_from_output(so, ModelRunnerOutput(req_ids=ids, req_id_to_index={k: j for j, k in enumerate(ids)},
                                                   sampled_token_ids=sampled))
    wall = time.perf_counter() - t0
    assert all(r.num_output_tokens == len(trace[int(r.request_id)]["decode"]) for r in reqs)
    return wall, steps


walls = []
for _ in range(a.runs):
    wall, steps = run()
    walls.append(wall)
print(f"vllm-0.33 Scheduler(max_num_seqs={a.max_num_seqs}) runs={['%.2f' % w for w in walls]} steps={steps}")
print(f"median_wall_s={statistics.median(walls):.4f}")
