"""The canonical shared-prefix trace on which the KV-cache managers and schedulers are compared side by side.

Writes JSON lines, one request a line: {"prompt": [token ids], "decode": [token ids]}. Default: 2,000 requests, each
one shared 512-token system prefix plus a random 32..256-token suffix, then 64 decode tokens; token ids in
[0, 32000), seed 0. The same arguments give the same file, byte for byte. Read by bench/kv_trace.py and
bench/sched_trace.py (ours) and by vllm_kv.py and vllm_sched.py beside this file (vLLM's).

usage: python3 bench/peers/trace.py OUT.jsonl [--requests N] [--prefix P] [--suffix-min A] [--suffix-max B]
                                              [--decode D] [--seed S] [--vocab V]
"""
# NOTE: the name is the stdlib's `trace`: the peers import it as `from trace import read_trace` with this folder
# first on sys.path, and bench/before_after.sh hands this folder (PEERS) to older trees that call it by this name.
import argparse
import json
import random


def make_trace(requests=2000, prefix=512, suffix_min=32, suffix_max=256, decode=64, seed=0, vocab=32000):
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(prefix)]
    out = []
    for _ in range(requests):
        suffix = [rng.randrange(vocab) for _ in range(rng.randint(suffix_min, suffix_max))]
        out.append({"prompt": shared + suffix, "decode": [rng.randrange(vocab) for _ in range(decode)]})
    return out


def read_trace(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main():
    p = argparse.ArgumentParser(description="Write the canonical shared-prefix trace (JSON lines).")
    p.add_argument("out")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--prefix", type=int, default=512)
    p.add_argument("--suffix-min", type=int, default=32)
    p.add_argument("--suffix-max", type=int, default=256)
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=32000)
    a = p.parse_args()
    with open(a.out, "w") as f:
        for r in make_trace(a.requests, a.prefix, a.suffix_min, a.suffix_max, a.decode, a.seed, a.vocab):
            f.write(json.dumps(r, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
