"""Worker benchmark on the CPU: decode step time over batch x context, and end-to-end tokens/s vs transformers.

1. torch threads: decode step time at batch 1 and 16 (context 256) with 1 and with 2 threads.
2. Decode step time vs batch size x context length: every sequence decodes one token per step; the plans are
   built here directly (new sequences, then running deltas with a new block when one is crossed).
3. End to end: 32 mixed-length real-text prompts, 64 greedy tokens each (EOS ignored), through LocalDriver
   over a ModelRunner and through transformers' generate (static left-padded batch, sdpa); tokens/s, ratio and
   how many outputs are token-identical.
4. A markdown summary.

Model loading is never timed. float32, CPU, torch.inference_mode, time.perf_counter. The worker's default path:
the lean forward over the C++ attention kernel (make_backend("auto", ...)).
usage: python bench/worker_step.py [--model smollm2-135m-instruct] [--threads N] [--quick]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing

from pagedserve_cli.bench.local_driver import LocalDriver  # noqa: E402
from worker_svc.kv_pool import KVPool  # noqa: E402
from worker_svc.model_store import DEFAULT_MODEL, resolve_model  # noqa: E402
from worker_svc.models import LoadedModel, load_model  # noqa: E402
from pagedserve_common.step import NewSequence, SequenceDelta, StepPlan  # noqa: E402
from worker_svc.runner import ModelRunner  # noqa: E402
from worker_svc.worker import make_backend  # noqa: E402
from pagedserve_common.sampling import SamplingParams  # noqa: E402

BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0.0)
PREFILL_CHUNK = 512
E2E_NUM_PROMPTS = 32
E2E_NEW_TOKENS = 64
THREAD_ROUNDS = 2

SENTENCES = [
    "The old lighthouse keeper climbed the spiral stairs every evening to light the lamp before the fog rolled in.",
    "Photosynthesis converts sunlight, water and carbon dioxide into glucose and oxygen inside the chloroplasts.",
    "In 1969, two astronauts walked on the surface of the Moon while a third orbited overhead in the command module.",
    "A good recipe for bread needs only flour, water, salt and yeast, but patience matters more than any ingredient.",
    "The stock market fell sharply on Monday after the central bank unexpectedly raised interest rates again.",
    "Migratory birds navigate thousands of kilometres using the Earth's magnetic field and the position of the stars.",
    "She opened the letter slowly, afraid of what the hospital might have written after all those tests.",
    "To install the package, run the setup script and then restart the server so the new settings take effect.",
    "Mount Everest grows a few millimetres every year as the Indian plate keeps pushing into the Eurasian plate.",
    "The committee will review all applications in March and announce the winners at the spring conference.",
    "Jazz musicians often improvise over a chord progression, trading solos while the rhythm section keeps time.",
    "When the river flooded the valley, farmers moved their cattle to the hills and waited for the water to recede.",
    "Quantum computers use qubits, which can represent zero and one at the same time thanks to superposition.",
    "He trained for months, running along the canal at dawn, and finished the marathon in just under three hours.",
    "The museum's new exhibition shows ancient pottery, coins and jewellery found during excavations near the coast.",
    "Regular exercise, a balanced diet and enough sleep are the simplest ways to improve long-term health.",
    "Our train was delayed by two hours because a storm had knocked a tree onto the tracks outside the city.",
    "The novel follows three generations of a family who run a small bookshop in a quiet seaside town.",
    "Volcanic eruptions can cool the global climate for several years by blocking sunlight with ash and sulfur.",
    "Please remember to water the tomatoes twice a week and to close the greenhouse door when it gets cold.",
    "The chess champion sacrificed her queen in a bold move that stunned the audience and won the game.",
    "Electric cars are becoming cheaper as battery prices fall and charging stations spread along the highways.",
    "In the tropical rainforest, a single tree can host hundreds of species of insects, fungi and epiphytes.",
    "The teacher asked the students to write a short essay about a person who had changed their lives.",
]


def log(msg: str = "") -> None:
    print(msg, flush=True)


# -- decode step time ---------------------------------------------------------------------------------------
@dataclass(slots=True)
class Template:
    """One real prefill of `ctx` random tokens; its KV is replicated into every benchmark sequence's blocks."""

    tokens: list[int]
    kv: torch.Tensor  # [layers, 2, num_prompt_blocks, block_size, kv_heads, head_dim]


def prefill_template(loaded: LoadedModel, ctx: int, seed: int) -> Template:
    rng = random.Random(seed)
    tokens = [rng.randrange(3, loaded.vocab_size) for _ in range(ctx)]
    nb = math.ceil(ctx / BLOCK_SIZE)
    pool = KVPool(loaded.kv_geometry(BLOCK_SIZE), nb)
    runner = ModelRunner(loaded, pool, make_backend("auto", "cpu", pool.geometry))
    # The last prompt token is left for the decode steps (as a sequence whose prefix is cached).
    done, step = 0, 0
    while done < ctx - 1:
        n = min(PREFILL_CHUNK, ctx - 1 - done)
        if step == 0:
            plan = StepPlan(0, new_seqs=[NewSequence(0, tokens, list(range(nb)), 0, n, GREEDY)])
        else:
            plan = StepPlan(step, running=[SequenceDelta(0, [], n)])
        runner.step(plan)
        done, step = done + n, step + 1
    return Template(tokens, pool.kv.clone())


def decode_point(loaded: LoadedModel, tpl: Template, batch: int, warm: int, timed: int,
                 max_point_s: float = math.inf) -> list[float] | float:
    """Seconds of each timed decode step of `batch` sequences with len(tpl.tokens) tokens of context.

    If the first step shows that all steps would take over 1.5 x max_point_s, stops and returns that step's time.
    """
    ctx = len(tpl.tokens)
    steps = warm + timed
    npb = math.ceil(ctx / BLOCK_SIZE)
    num_blocks = batch * math.ceil((ctx + steps) / BLOCK_SIZE)
    pool = KVPool(loaded.kv_geometry(BLOCK_SIZE), num_blocks)
    runner = ModelRunner(loaded, pool, make_backend("auto", "cpu", pool.geometry))
    next_block = 0

    def alloc(n: int) -> list[int]:
        nonlocal next_block
        ids = list(range(next_block, next_block + n))
        next_block += n
        return ids

    tables = [alloc(npb) for _ in range(batch)]
    for t in tables:  # each sequence gets its own copy of the prompt KV (its blocks are consecutive here)
        pool.kv[:, :, t[0]:t[-1] + 1].copy_(tpl.kv)
    times = []
    for step in range(steps):
        seq_len = ctx + step  # context after this step's token is written
        if step == 0:
            plan = StepPlan(0, new_seqs=[NewSequence(i, list(tpl.tokens), list(tables[i]), ctx - 1, 1, GREEDY)
                                         for i in range(batch)])
        else:
            need = math.ceil(seq_len / BLOCK_SIZE) - len(tables[0])
            deltas = []
            for i in range(batch):
                new = alloc(need) if need > 0 else []
                tables[i].extend(new)
                deltas.append(SequenceDelta(i, new, 1))
            plan = StepPlan(step, running=deltas)
        t0 = time.perf_counter()
        out = runner.step(plan)
        dt = time.perf_counter() - t0
        assert len(out.sampled) == batch
        if step == 0 and dt * steps > 1.5 * max_point_s:
            return dt
        if step >= warm:
            times.append(dt)
    del pool, runner
    return times


def mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def thread_check(loaded: LoadedModel, warm: int, timed: int) -> dict[tuple[int, int], float]:
    ctx = 256
    tpl = prefill_template(loaded, ctx, seed=ctx)
    configs = [(threads, batch) for batch in (1, 16) for threads in (1, 2)]
    rounds: dict[tuple[int, int], list[float]] = {c: [] for c in configs}
    # Two interleaved rounds: a burst of load from another process hits one round, not one configuration.
    for _ in range(THREAD_ROUNDS):
        for threads, batch in configs:
            torch.set_num_threads(threads)
            rounds[(threads, batch)].append(statistics.median(decode_point(loaded, tpl, batch, warm, timed)) * 1e3)
    log(f"## torch threads: decode ms/step at context {ctx} ({warm} warm + {timed} timed steps, median; "
        f"{THREAD_ROUNDS} interleaved rounds, best kept)")
    log(f"{'threads':>7} {'batch':>5} {'ms/step':>9} {'tokens/s':>9}   rounds (ms/step)")
    res = {}
    for threads in (1, 2):
        for batch in (1, 16):
            ms = min(rounds[(threads, batch)])
            res[(threads, batch)] = ms
            log(f"{threads:>7} {batch:>5} {ms:>9.1f} {batch / ms * 1e3:>9.1f}   "
                + " ".join(f"{r:.1f}" for r in rounds[(threads, batch)]))
    return res


def decode_grid(loaded: LoadedModel, batches: list[int], ctxs: list[int], warm: int, timed: int,
                max_point_s: float) -> dict[tuple[int, int], float | str]:
    layout = loaded.kv_geometry(BLOCK_SIZE)
    log(f"## decode step time: every sequence decodes 1 token/step; {warm} warm + {timed} timed steps, median")
    log(f"   (prefill untimed: one real chunked prefill of random tokens per context length, its KV copied into "
        f"each sequence's own blocks; block_size {BLOCK_SIZE}; KV {layout.bytes_per_token} B/token)")
    log(f"{'batch':>5} {'ctx':>5} {'ms/step':>9} {'tokens/s':>9}")
    res: dict[tuple[int, int], float | str] = {}
    steps = warm + timed
    for ctx in ctxs:
        tpl = prefill_template(loaded, ctx, seed=ctx)
        prev: tuple[int, float] | None = None  # (batch, ms) of the last measured point at this context
        for batch in batches:
            pool_bytes = batch * math.ceil((ctx + steps) / BLOCK_SIZE) * layout.bytes_per_block
            # Decode gathers each layer's KV into a fresh tensor: about 2 layers' worth on top of the pool.
            need = pool_bytes * (1 + 2 / layout.num_layers) + 512 * 2**20
            skip = None
            if need > 0.8 * mem_available():
                skip = f"skipped: needs ~{need / 2**30:.1f} GiB, {mem_available() / 2**30:.1f} GiB available"
            elif prev is not None:
                # A lower bound: here step time grows at least ~linearly in batch.
                est = prev[1] * batch / prev[0] / 1e3 * steps
                if est > max_point_s:
                    skip = f"skipped: est. {est:.0f} s for {steps} steps (> {max_point_s:.0f} s limit)"
            if skip:
                res[(batch, ctx)] = skip
                log(f"{batch:>5} {ctx:>5}   {skip}")
                continue
            times = decode_point(loaded, tpl, batch, warm, timed, max_point_s)
            if isinstance(times, float):
                skip = f"skipped after its first step: {times:.1f} s/step (> {max_point_s:.0f} s for {steps} steps)"
                res[(batch, ctx)] = skip
                log(f"{batch:>5} {ctx:>5}   {skip}")
                continue
            ms = statistics.median(times) * 1e3
            res[(batch, ctx)] = ms
            prev = (batch, ms)
            log(f"{batch:>5} {ctx:>5} {ms:>9.1f} {batch / ms * 1e3:>9.1f}")
    return res


# -- end to end ---------------------------------------------------------------------------------------------
def build_prompts(tokenizer, n: int) -> list[list[int]]:
    """n deterministic prompts of 16..200 tokens, each a window of the sentence corpus at its own offset."""
    corpus = tokenizer(" ".join(SENTENCES))["input_ids"]
    lengths = [16 + round(i * (200 - 16) / (n - 1)) for i in range(n)]
    random.Random(0).shuffle(lengths)
    prompts = []
    for i, length in enumerate(lengths):
        start = (i * 53) % len(corpus)  # distinct starts: no two prompts share a first block (no prefix hits)
        prompts.append([corpus[(start + j) % len(corpus)] for j in range(length)])
    return prompts


def run_pagedserve(loaded: LoadedModel, prompts: list[list[int]],
                   new_tokens: int) -> tuple[list[list[int]], float, int]:
    num_blocks = sum(math.ceil((len(p) + new_tokens) / BLOCK_SIZE) for p in prompts) + 8
    pool = KVPool(loaded.kv_geometry(BLOCK_SIZE), num_blocks)

    def driver() -> LocalDriver:
        runner = ModelRunner(loaded, pool, make_backend("auto", "cpu", pool.geometry))
        return LocalDriver(runner, max_num_batched_tokens=512, max_num_seqs=32, eos_token_ids=())

    warm = driver()  # warm-up, untimed
    for p in prompts[:2]:
        warm.add(p, 4)
    warm.run()
    d = driver()
    ids = [d.add(p, new_tokens) for p in prompts]
    t0 = time.perf_counter()
    out = d.run()
    wall = time.perf_counter() - t0
    return [out[i][0] for i in ids], wall, d.step_id


def run_transformers(model_dir: Path, tokenizer, prompts: list[list[int]], new_tokens: int,
                     pad_id: int) -> tuple[list[list[int]], float]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    # NOTE: transformers 5 fills a GenerationConfig's None fields from the model's own generation_config, so
    # eos_token_id=None alone still stops a row at EOS (and pads it with pad_id); clear the model's default too.
    model.generation_config.eos_token_id = None
    tokenizer.padding_side = "left"
    tokenizer.pad_token_id = pad_id

    def generate(batch: list[list[int]], n: int) -> torch.Tensor:
        enc = tokenizer.pad({"input_ids": batch}, padding=True, return_tensors="pt")
        # No EOS at all: exactly n new tokens per row, and no logits processor touches the argmax.
        gen = GenerationConfig(do_sample=False, max_new_tokens=n, pad_token_id=pad_id, eos_token_id=None,
                               bos_token_id=None)
        with torch.inference_mode():
            out = model.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                                 generation_config=gen)
        return out[:, enc["input_ids"].shape[1]:]

    generate(prompts[:2], 4)  # warm-up, untimed
    t0 = time.perf_counter()
    out = generate(prompts, new_tokens)
    wall = time.perf_counter() - t0
    del model
    return out.tolist(), wall


def end_to_end(loaded: LoadedModel, model_dir: Path, num_prompts: int, new_tokens: int) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = build_prompts(tokenizer, num_prompts)
    lens = [len(p) for p in prompts]
    log(f"## end to end: {len(prompts)} real-text prompts of {min(lens)}..{max(lens)} tokens "
        f"(total {sum(lens)}), {new_tokens} new tokens each, greedy, EOS ignored")
    ps_out, ps_wall, ps_steps = run_pagedserve(loaded, prompts, new_tokens)
    assert all(len(o) == new_tokens for o in ps_out), "pagedserve did not generate exactly new_tokens per prompt"
    total = len(prompts) * new_tokens
    ps_tps = total / ps_wall
    log(f"pagedserve   LocalDriver (max_num_batched_tokens 512, max_num_seqs 32, {ps_steps} steps): "
        f"{ps_wall:.2f} s, {ps_tps:.1f} generated tokens/s")
    hf_out, hf_wall = run_transformers(model_dir, tokenizer, prompts, new_tokens, pad_id=2)
    assert all(len(o) == new_tokens for o in hf_out), "transformers did not generate exactly new_tokens per prompt"
    hf_tps = total / hf_wall
    log(f"transformers generate (static left-padded batch of {len(prompts)}, sdpa): "
        f"{hf_wall:.2f} s, {hf_tps:.1f} generated tokens/s")
    same = sum(a == b for a, b in zip(ps_out, hf_out))
    first_diff = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(ps_out, hf_out)]
    diverged = sorted(j for j in first_diff if j is not None)
    log(f"ratio pagedserve / transformers: {ps_tps / hf_tps:.2f}x")
    log(f"token-identical outputs: {same}/{len(prompts)}"
        + (f" (the others first differ at generated token {diverged})" if diverged else ""))
    log(f"sample (prompt 0, pagedserve): {tokenizer.decode(ps_out[0])[:120]!r}")
    return dict(ps_tps=ps_tps, hf_tps=hf_tps, ps_wall=ps_wall, hf_wall=hf_wall, same=same, n=len(prompts),
                prompt_lens=(min(lens), max(lens)))


# -- main ---------------------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for sections 2 and 3")
    p.add_argument("--quick", action="store_true", help="a smaller grid and fewer steps (~1 minute)")
    a = p.parse_args()

    if a.quick:
        batches, ctxs, warm, timed, max_point_s = [1, 16, 64], [128, 512], 2, 3, 8.0
        thread_warm, thread_timed = 2, 3
        n_prompts, new_tokens = 16, 32
    else:
        batches, ctxs, warm, timed, max_point_s = [1, 4, 16, 32, 64], [128, 512, 2048], 3, 5, 30.0
        thread_warm, thread_timed = 3, 5
        n_prompts, new_tokens = E2E_NUM_PROMPTS, E2E_NEW_TOKENS

    t_start = time.perf_counter()
    model_dir = resolve_model(a.model)
    loaded = load_model(model_dir, dtype="float32", model_id=a.model)
    n_params = sum(t.numel() for t in loaded.model.parameters())
    log(f"# pagedserve worker step benchmark: {a.model} ({n_params / 1e6:.0f}M params, {loaded.dtype}, CPU)")
    log(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, {torch.get_num_threads()} default torch threads, "
        f"load average {os.getloadavg()[0]:.2f} at start; mode {'quick' if a.quick else 'full'}")
    log()

    with torch.inference_mode():
        threads_res = thread_check(loaded, thread_warm, thread_timed)
        torch.set_num_threads(a.threads)
        log(f"-> using {a.threads} thread(s) (--threads) for everything below")
        log()
        grid = decode_grid(loaded, batches, ctxs, warm, timed, max_point_s)
        log()
        e2e = end_to_end(loaded, model_dir, n_prompts, new_tokens)
    log()

    # -- summary, ready to paste -------------------------------------------------------------------------
    log(f"## summary ({a.model}, float32, CPU, {a.threads} thread(s); total bench time "
        f"{time.perf_counter() - t_start:.0f} s)")
    log()
    log("| threads | batch 1 ms/step (ctx 256) | batch 16 ms/step (ctx 256) |")
    log("|---|---|---|")
    for threads in (1, 2):
        log(f"| {threads} | {threads_res[(threads, 1)]:.1f} | {threads_res[(threads, 16)]:.1f} |")
    log()
    log("| decode ms/step (tokens/s) | " + " | ".join(f"ctx {c}" for c in ctxs) + " |")
    log("|---|" + "---|" * len(ctxs))
    for b in batches:
        cells = []
        for c in ctxs:
            v = grid[(b, c)]
            cells.append(f"{v:.1f} ({b / v * 1e3:.0f})" if isinstance(v, float) else "skipped")
        log(f"| batch {b} | " + " | ".join(cells) + " |")
    log()
    log(f"| end to end ({e2e['n']} prompts, {e2e['prompt_lens'][0]}..{e2e['prompt_lens'][1]} tokens, "
        f"{new_tokens} new, greedy) | wall s | generated tokens/s |")
    log("|---|---|---|")
    log(f"| pagedserve LocalDriver | {e2e['ps_wall']:.2f} | {e2e['ps_tps']:.1f} |")
    log(f"| transformers generate (sdpa, left-padded) | {e2e['hf_wall']:.2f} | {e2e['hf_tps']:.1f} |")
    log(f"| ratio | | {e2e['ps_tps'] / e2e['hf_tps']:.2f}x |")
    log(f"| token-identical outputs | | {e2e['same']}/{e2e['n']} |")


if __name__ == "__main__":
    main()
