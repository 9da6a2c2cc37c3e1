"""What structured output costs: output tok/s with a JSON schema on every request vs without, the event loop's
longest stall while 16 new schemas compile, the per-step mask cost at batch 64; and the twenty test schemas'
validity and tok/s against us and, with --peer, another OpenAI-compatible server (vLLM) side by side.

    python bench/structured.py [--model DIR] [--num-requests 64] [--rounds 3]
                               [--peer http://127.0.0.1:8100/v1 --peer-model M]

Starts `pagedserve up` itself (gRPC and the HTTP front). The throughput workload is bench/vs_vllm.sh's: N requests
at once, prompts of 32-256 random tokens, 16-128 output tokens, EOS ignored; "structured" gives each an unbounded
JSON array of at least 200 integers as its schema, so that both runs write the same number of tokens. The stall
is GetModelInfo's longest latency (the event loop's responsiveness) and a running stream's longest inter-token gap
while 16 one-token completions, each with a schema never seen before, compile and run (and, as the control, while
the same 16 run without schemas). Prints
`throughput ...`, `stall ...`, `mask ...`, one `schemas ...` line per server, and last `ratio_structured=X`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time

import grpc
import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from pagedserve.v1 import generate_pb2 as pb  # noqa: E402
from pagedserve.v1 import generate_pb2_grpc  # noqa: E402
from pagedserve_common.defaults import DEFAULT_MODEL  # noqa: E402
from pagedserve_cli.bench.spawn import SpawnConfig, spawn  # noqa: E402
from pagedserve_common.sampling import StructuredOutput  # noqa: E402
from pagedserve_cli.bench.structured_schemas import SCHEMAS  # noqa: E402

# NOTE: at least 200 numbers (~400 tokens): no output can close the array before its max_tokens (<= 128), so both runs
# write the same tokens
ARRAY = json.dumps({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9999}, "minItems": 200})
MAX_TOKENS = 300


async def throughput(stub, num_requests: int, structured: bool, salt: str) -> tuple[float, int]:
    """(output tok/s, output tokens) of the workload, all requests at once."""
    rng = random.Random(0)
    work = [([rng.randrange(3, 49152) for _ in range(rng.randint(32, 256))], rng.randint(16, 128))
            for _ in range(num_requests)]

    async def one(prompt: list[int], max_tokens: int) -> int:
        so = pb.StructuredOutput(json_schema=ARRAY) if structured else None
        n = 0
        async for msg in stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, cache_salt=salt, sampling=(
                pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, structured_output=so))),
                timeout=3600):
            n += len(msg.token_ids)
        return n

    t = time.perf_counter()
    counts = await asyncio.gather(*(one(p, m) for p, m in work))
    return sum(counts) / (time.perf_counter() - t), sum(counts)


async def stall(stub, http_url: str, nonce: str) -> dict:
    """An unconstrained stream's inter-token gaps and GetModelInfo's latency, idle and while 16 new schemas compile
    (each request brings a schema never seen: a compile each)."""
    async def gaps(tokens: int) -> list[float]:
        out, last = [], None
        async for _ in stub.Generate(pb.GenerateRequest(prompt="Tell me a long story about the sea.", sampling=(
                pb.SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))), timeout=600):
            now = time.perf_counter()
            if last is not None:
                out.append(now - last)
            last = now
        return out

    async def info_latency(stop: asyncio.Event, out: list[float]) -> None:
        while not stop.is_set():
            t = time.perf_counter()
            await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=60)
            out.append(time.perf_counter() - t)
            await asyncio.sleep(0.005)

    async def compile_one(h: httpx.AsyncClient, i: int, structured: bool) -> int:
        schema = {**SCHEMAS[i][2], "title": f"{nonce}-{i}"}  # NOTE: a new spec text: no cache hit
        # NOTE: a one-token prompt and output: the compile is the work, not a prefill in the stream's steps
        r = await h.post(f"{http_url}/completions", json={"prompt": "{", "max_tokens": 1, "temperature": 0,
                                                          **({"guided_json": schema} if structured else {})})
        return r.status_code

    async def burst(structured: bool) -> tuple[list[float], list[float], list[int]]:
        """(the stream's gaps, GetModelInfo's latencies, the 16 requests' statuses)"""
        info: list[float] = []
        stop = asyncio.Event()
        poller = asyncio.create_task(info_latency(stop, info))
        stream = asyncio.create_task(gaps(60))
        await asyncio.sleep(0.5)
        async with httpx.AsyncClient(timeout=600) as h:
            codes = await asyncio.gather(*(compile_one(h, i, structured) for i in range(16)))
        itl = await stream
        stop.set()
        await poller
        return itl, info, codes

    idle_info: list[float] = []
    stop = asyncio.Event()
    poller = asyncio.create_task(info_latency(stop, idle_info))
    idle = await gaps(60)
    stop.set()
    await poller
    plain_itl, plain_info, _ = await burst(False)  # the same 16 requests without schemas: the control
    loaded, loaded_info, codes = await burst(True)
    return {"itl_idle_max_ms": 1e3 * max(idle), "itl_16_plain_max_ms": 1e3 * max(plain_itl),
            "itl_16_compiling_max_ms": 1e3 * max(loaded), "info_idle_max_ms": 1e3 * max(idle_info),
            "info_16_plain_max_ms": 1e3 * max(plain_info), "info_16_compiling_max_ms": 1e3 * max(loaded_info),
            "compiled_ok": sum(c == 200 for c in codes)}


def mask_cost(model_dir: str, batch: int = 64) -> dict:
    """fill_bitmasks over `batch` matchers of the nested order schema at different points of their outputs."""
    from scheduler_svc.frontend import Tokenizer
    from scheduler_svc.structured import GrammarCompiler, fill_bitmasks

    tok = Tokenizer.from_model_dir(model_dir)
    compiler = GrammarCompiler(tok.to_json(), 49152, tok.eos_token_ids)
    name, _, schema = SCHEMAS[5]
    grammar = asyncio.run(compiler.compile(StructuredOutput("json_schema", json.dumps(schema))))
    instance = '{"customer":{"name":"Ada","email":"ada@shop.com"},"items":[{"sku":"AB-123","qty":2}]}'
    ids = tok.encode(instance, add_special_tokens=False)
    constraints = []
    for i in range(batch):
        c = grammar.constraint()
        for t in ids[:i % len(ids)]:
            c.accept(t)
        constraints.append(c)
    times = []
    for _ in range(50):
        t = time.perf_counter()
        fill_bitmasks(constraints, 49152)
        times.append(1e3 * (time.perf_counter() - t))
    compiler.close()
    return {"schema": name, "batch": batch, "fill_ms_median": statistics.median(times), "fill_ms_max": max(times)}


async def schemas(url: str, model: str | None, temperature: float) -> dict:
    """The twenty schemas at once: how many outputs validate, and output tok/s."""
    import jsonschema

    async with httpx.AsyncClient(timeout=3600) as h:
        async def one(i: int, prompt: str, schema: dict) -> tuple[bool, int]:
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
                    "temperature": temperature, "seed": 1000 + i,
                    "response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                               "strict": True}}}
            if model:
                body["model"] = model
            r = (await h.post(f"{url}/chat/completions", json=body)).json()
            try:
                jsonschema.validate(json.loads(r["choices"][0]["message"]["content"]), schema)
                ok = True
            except (ValueError, KeyError, jsonschema.ValidationError):
                ok = False
            return ok, r.get("usage", {}).get("completion_tokens", 0)

        t = time.perf_counter()
        results = await asyncio.gather(*(one(i, p, s) for i, (_, p, s) in enumerate(SCHEMAS)))
        wall = time.perf_counter() - t
    return {"valid": sum(ok for ok, _ in results), "tokens": sum(n for _, n in results), "tok_s": sum(
        n for _, n in results) / wall}


async def grpc_part(listen: str, http_url: str, num_requests: int, rounds: int) -> tuple[dict, dict]:
    """NOTE: plain and structured runs alternate, `rounds` of each, and their medians count: a busy machine slows
    whole minutes, not one kind of run."""
    async with grpc.aio.insecure_channel(listen) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        await throughput(stub, 4, True, "warm-up")  # first compile and first steps out of the way
        runs: dict[bool, list[tuple[float, int]]] = {False: [], True: []}
        for r in range(rounds):
            for structured in (False, True):
                # NOTE: a salt per run: no run reads another's prompts from the prefix cache
                runs[structured].append(await throughput(stub, num_requests, structured, f"{structured}-{r}"))
        st = await stall(stub, http_url, f"n{time.time_ns()}")
    plain, structured = (statistics.median(t for t, _ in runs[k]) for k in (False, True))
    return {"plain_tok_s": plain, "structured_tok_s": structured, "tokens_per_run": runs[False][0][1],
            "structured_tokens_per_run": runs[True][0][1], "rounds": rounds}, st


def line(kind: str, d: dict) -> str:
    return kind + " " + " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in d.items())


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.expanduser(f"~/.cache/pagedserve/models/{DEFAULT_MODEL}"))
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="plain and structured runs, alternated; medians count")
    ap.add_argument("--peer", default="", help="another OpenAI-compatible server's base URL (e.g. vLLM's .../v1)")
    ap.add_argument("--peer-model", default="", help="the model name the peer serves")
    ap.add_argument("--peer-only", action="store_true", help="only the twenty schemas against --peer (a script that "
                    "starts the peer after our runs, so that the two never share the CPU: bench/structured_vs_vllm.sh)")
    ap.add_argument("--up-args", default="", help="more `pagedserve up` arguments")
    args = ap.parse_args()
    if args.peer_only:
        if not args.peer:
            raise SystemExit("--peer-only needs --peer URL")
        print_schemas("peer", {t: asyncio.run(schemas(args.peer, args.peer_model or None, t)) for t in (0.0, 1.0)})
        return
    print(line("mask", mask_cost(args.model)), flush=True)
    # NOTE: float32 as bench/server_lib.sh's vLLM (--dtype float32), whatever `auto` picks on this CPU
    up = spawn(SpawnConfig(args.model, dtype="float32", http=True), args.up_args.split(), "structured")
    print(f"(pagedserve up's log: {up.log_path})", file=sys.stderr, flush=True)
    http_url = up.openai_url
    try:
        tp, st = asyncio.run(grpc_part(up.address, http_url, args.num_requests, args.rounds))
        print(line("throughput", tp), flush=True)
        print(line("stall", st), flush=True)
        ours = {t: asyncio.run(schemas(http_url, None, t)) for t in (0.0, 1.0)}
    finally:
        up.stop()
    servers = [("pagedserve", ours)]
    if args.peer:
        servers.append(("peer", {t: asyncio.run(schemas(args.peer, args.peer_model or None, t)) for t in (0.0, 1.0)}))
    for name, res in servers:
        print_schemas(name, res)
    print(f"ratio_structured={tp['structured_tok_s'] / tp['plain_tok_s']:.3f}")


def print_schemas(name: str, res: dict) -> None:
    print(f"schemas server={name} valid_greedy={res[0.0]['valid']}/{len(SCHEMAS)} "
          f"valid_t1={res[1.0]['valid']}/{len(SCHEMAS)} tok_s_greedy={res[0.0]['tok_s']:.1f} "
          f"tok_s_t1={res[1.0]['tok_s']:.1f}", flush=True)


if __name__ == "__main__":
    main()
