"""The first request's TTFT after `pagedserve up` against the later ones': starts `up` (the default model unless
--model), sends --requests chat completions one after another (streamed, the official openai client), prints each
TTFT and first/tenth, then stops `up`. Run a few times: the machine's load moves every number. NOTE: the later
requests reuse the chat template's system prompt from the prefix cache (the first computes it): `-- --no-prefix-caching`
compares like with like.

    python bench/first_ttft.py [--runs 3] [--requests 10] [--model DIR] [--device cpu] [--log FILE] [-- UP FLAGS]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time

import openai

from pagedserve_common.ports import free_port


def one_run(args: argparse.Namespace, extra: list[str]) -> list[float]:
    listen, http = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "pagedserve_cli.main", "up", "--listen", listen, "--worker-listen",
           f"127.0.0.1:{free_port()}", "--metrics", "", "--http", http, "--device", args.device, *extra]
    if args.model:
        cmd += ["--model", args.model]
    with open(args.log or os.devnull, "a") as log:
        up = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    try:
        line = up.stdout.readline()
        assert line.startswith("pagedserve is up"), f"up did not start: {line!r}"
        client = openai.OpenAI(base_url=f"http://{http}/v1", api_key="unused", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        client.chat.completions  # NOTE: the client imports its chat modules on first use: not the server's time
        ttfts = []
        for i in range(args.requests):
            t0 = time.perf_counter()
            stream = client.chat.completions.create(model=model, max_tokens=8, temperature=0.7, stream=True,
                                                    messages=[{"role": "user", "content": f"Say hello, {i}."}])
            first = None
            for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - t0
            ttfts.append(first if first is not None else float("nan"))
        return ttfts
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--log", default=None, help="append up's stderr to this file")
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    ratios = []
    for run in range(args.runs):
        ttfts = one_run(args, extra)
        later = statistics.median(ttfts[1:])
        ratios.append(ttfts[0] / ttfts[-1])
        print(f"run {run + 1}: TTFT first {ttfts[0]:.3f} s, tenth {ttfts[-1]:.3f} s (median of the later "
              f"{later:.3f} s), first/tenth {ratios[-1]:.2f}; all: {' '.join(f'{t:.3f}' for t in ttfts)}",
              flush=True)
    print(f"first/tenth: median {statistics.median(ratios):.2f} over {len(ratios)} run(s)")


if __name__ == "__main__":
    main()
