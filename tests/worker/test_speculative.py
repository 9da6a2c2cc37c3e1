"""Speculative decoding on the worker: drafts verified in the packed forward give the tokens of plain decoding
(greedy and seeded, on a tiny model and on the default one), sampled outputs follow the same distribution (a
chi-square test that a wrong acceptance rule fails), the persistent batch keeps only the emitted tokens, and plans
with drafts it cannot verify are refused."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from pagedserve_common.sampling import SamplingParams
from pagedserve_common.step import NewSequence, SequenceDelta, StepPlan
from scheduler_svc.core.scheduler import Scheduler
from pagedserve_cli.bench.local_driver import LocalDriver
from pagedserve_cli.bench.tiny_model import TINY
from tests.support.worker import swap_runner
from worker_svc.kv_pool import KVPool
from worker_svc.models import load_model
from worker_svc.runner import ModelRunner
from worker_svc.worker import make_backend
from worker_svc.batch import BadPlan, SeqState
from worker_svc.sampling import Sampler
from worker_svc.speculative import Verification
from worker_svc.uniforms import seeded_uniforms

GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=42)
TOP_K = SamplingParams(temperature=0.7, top_k=3, min_p=0.05, seed=7)


VOCAB = 12  # NOTE: a tiny vocabulary, so that a random model's outputs repeat n-grams (and drafts get accepted)


def loop_prompts() -> list[list[int]]:
    """Repeated phrases, then the phrase's start."""
    rng = random.Random(5)
    out = []
    for i in range(4):
        phrase = [rng.randrange(0, VOCAB) for _ in range(rng.randint(3, 6))]
        out.append(phrase * 4 + phrase[:2])
    return out


def run(runner, sp: SamplingParams, speculative: str, prompts, new: int = 40, **kw):
    runner.reset()
    driver = LocalDriver(runner, speculative=speculative, **kw)
    for p in prompts:
        driver.add(p, new, sp)
    return driver.run(), driver.scheduler


@pytest.fixture(scope="module")
def tiny_vocab_runner(tmp_path_factory):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**{**TINY, "vocab_size": VOCAB}), dtype=torch.float32)
    path = tmp_path_factory.mktemp("tiny-vocab")
    model.save_pretrained(path)
    return swap_runner(str(path))  # the production path, with swap space


@pytest.mark.parametrize("sp", [GREEDY, SEEDED, TOP_K], ids=["greedy", "top-p", "top-k+min-p"])
def test_drafts_change_no_token_of_a_tiny_model(tiny_vocab_runner, sp):
    plain, _ = run(tiny_vocab_runner, sp, "none", loop_prompts())
    fast, sched = run(tiny_vocab_runner, sp, "ngram", loop_prompts())
    assert fast == plain
    c = sched.spec.counters
    assert c.num_accepted_tokens > 0 and c.num_draft_tokens > c.num_accepted_tokens  # both ways were taken


def test_drafts_change_no_token_under_preemption_and_swaps(tiny_vocab_runner):
    plain, _ = run(tiny_vocab_runner, SEEDED, "none", loop_prompts())
    for num_cpu_blocks in (0, 32):
        tiny_vocab_runner.reset()
        driver = LocalDriver(tiny_vocab_runner, speculative="ngram", num_cpu_blocks=num_cpu_blocks)
        driver.scheduler = Scheduler(dataclasses.replace(driver.scheduler.config, num_blocks=10))
        for p in loop_prompts():
            driver.add(p, 40, SEEDED)
        assert driver.run() == plain
        assert driver.scheduler.num_preemptions > 0 and driver.scheduler.spec.counters.num_accepted_tokens > 0


def test_the_batch_keeps_only_the_emitted_tokens_and_the_kv_up_to_the_last_accepted_draft(tiny_vocab_runner):
    tiny_vocab_runner.reset()
    prompt = loop_prompts()[0]
    plan = StepPlan(0, new_seqs=[NewSequence(1, prompt, [0, 1], 0, len(prompt), GREEDY)])
    first = tiny_vocab_runner.step(plan).sampled[1]
    s = tiny_vocab_runner.batch.seqs[1]
    known = list(s.token_ids)
    assert known == [*prompt, first]
    wrong = (first + 1) % VOCAB
    res = tiny_vocab_runner.step(StepPlan(1, running=[SequenceDelta(1, [], 3, [wrong, wrong])]))
    assert res.num_accepted_drafts == {}  # the first draft was refused
    assert s.token_ids == [*known, res.sampled[1]] and s.num_computed_tokens == len(known)
    assert s.num_draft_tokens == 0


def verify_many(sp: SamplingParams, logits: torch.Tensor, drafts: list[int], seeds) -> list[list[int]]:
    """Each seed's emitted tokens: a sequence of one known token and len(drafts) drafts, its rows' logits
    `logits` [1 + K, vocab], verified by the real sampler (Verification)."""
    k = len(drafts)
    seqs = [SeqState(i, [0, *drafts], [0], 0, SamplingParams(**{**_fields(sp), "seed": seed}), 1 + k,
                     num_draft_tokens=k) for i, seed in enumerate(seeds)]
    verdicts = Verification(seqs, list(range(len(seqs)))).verify(Sampler(), logits.repeat(len(seqs), 1))
    return [[*drafts[:n], tok] for n, tok in verdicts]


def _fields(sp: SamplingParams) -> dict:
    return {name: getattr(sp, name) for name in sp.__dataclass_fields__}


def plain_many(sp: SamplingParams, logits: torch.Tensor, seeds) -> list[int]:
    """Each seed's token drawn from `logits` [vocab] by plain sampling at position 1."""
    seeded = [SamplingParams(**{**_fields(sp), "seed": seed}) for seed in seeds]
    return Sampler().sample(logits[None].repeat(len(seeds), 1), seeded, [1] * len(seeds)).token_ids


def chi_square_same(a: list, b: list) -> tuple[float, float]:
    """(statistic, critical value at p = 0.001) of the two-sample chi-square test that `a` and `b` (equally many
    draws) come from one distribution, over the values either holds."""
    ca, cb = Counter(a), Counter(b)
    values = sorted(set(ca) | set(cb), key=repr)
    stat = sum((ca[v] - cb[v]) ** 2 / (ca[v] + cb[v]) for v in values)
    df = len(values) - 1
    z = 3.0902  # the standard normal's 0.999 quantile; Wilson-Hilferty for the chi-square's
    return stat, df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


VOCAB_LOGITS = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0],
                             [0.0, 2.5, 0.3, 1.0, -1.0, 0.8, 0.1, -2.0],
                             [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
N = 8_000


@pytest.mark.parametrize("sp", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=5),
                                SamplingParams(temperature=1.3, top_p=0.8, min_p=0.02)],
                         ids=["plain", "top-k", "top-p+min-p"])
@pytest.mark.parametrize("drafts", [[1, 1], [0, 3], [7, 2]], ids=["likely", "mixed", "unlikely"])
def test_sampled_outputs_are_distributed_as_without_drafts(sp, drafts):
    got = verify_many(sp, VOCAB_LOGITS, drafts, range(N))
    # position by position: the first token as plain sampling draws from row 0; after an accepted first draft, the
    # second as plain sampling draws from row 1 (other seeds: independent draws)
    plain_first = plain_many(sp, VOCAB_LOGITS[0], range(N, 2 * N))
    stat, critical = chi_square_same([t[0] for t in got], plain_first)
    assert stat < critical, (stat, critical)
    seconds = [t[1] for t in got if len(t) > 1]
    if len(seconds) >= 500:
        plain_second = plain_many(sp, VOCAB_LOGITS[1], range(3 * N, 3 * N + len(seconds)))
        stat, critical = chi_square_same(seconds, plain_second)
        assert stat < critical, (stat, critical)


def wrong_rule(sp: SamplingParams, logits: torch.Tensor, draft: int, seeds) -> list[int]:
    """A classic mistake: accept the draft with probability p(d), but on a refusal sample from p again, d
    included (instead of p with d removed): d comes out with p + (1 - p) p."""
    probs = torch.softmax(logits / sp.temperature, dim=-1).double()
    out = []
    for seed in seeds:
        u, v = seeded_uniforms([seed, seed + 10**9], [1, 1])
        if u < probs[draft]:
            out.append(draft)
        else:
            out.append(int(np.searchsorted(probs.cumsum(0).numpy(), v * float(probs.sum()), side="right")))
    return out


def test_the_chi_square_test_detects_a_wrong_acceptance_rule():
    sp = SamplingParams(temperature=1.0)
    stat, critical = chi_square_same(wrong_rule(sp, VOCAB_LOGITS[0], 1, range(N)),
                                     plain_many(sp, VOCAB_LOGITS[0], range(N, 2 * N)))
    assert stat > critical, (stat, critical)


def test_seeded_verification_draws_exactly_what_plain_sampling_draws():
    sp = SamplingParams(temperature=0.9)
    seeds = range(2000)
    got = verify_many(sp, VOCAB_LOGITS[[0, 0]], [2], seeds)  # one draft, the same distribution at both rows
    assert [t[0] for t in got] == plain_many(sp, VOCAB_LOGITS[0], seeds)  # the same uniform at the same position


def test_greedy_verification_accepts_drafts_while_they_are_the_argmax():
    rows = VOCAB_LOGITS  # argmaxes 0, 1, then a tie over all (lowest id: 0)
    assert verify_many(GREEDY, rows, [0, 1], [0]) == [[0, 1, 0]]
    assert verify_many(GREEDY, rows, [0, 5], [0]) == [[0, 1]]
    assert verify_many(GREEDY, rows, [3, 1], [0]) == [[0]]


def test_plans_with_drafts_the_worker_cannot_verify_are_refused(tiny_vocab_runner):
    tiny_vocab_runner.reset()
    prompt = loop_prompts()[0]
    tiny_vocab_runner.step(StepPlan(0, new_seqs=[NewSequence(1, prompt, [0, 1], 0, len(prompt), GREEDY),
                                      NewSequence(2, prompt, [2, 3], 0, len(prompt) - 3, GREEDY),
                                      NewSequence(3, prompt, [4, 5], 0, len(prompt),
                                                  SamplingParams(temperature=0.0, logprobs=1))]))
    for delta, match in [(SequenceDelta(1, [], 2, [5, 6]), "2 drafts must follow its last known token"),
                         (SequenceDelta(2, [], 2, [5]), "1 drafts must follow its last known token"),
                         (SequenceDelta(1, [], 3, [5, VOCAB]), "draft token id is outside the vocabulary"),
                         (SequenceDelta(3, [], 2, [5]), "drafts for a sequence with logprobs"),
                         (SequenceDelta(1, [], 33, [1] * 32), "tokens need 4 blocks, its table has 2")]:
        before = (list(tiny_vocab_runner.batch.seqs[1].token_ids), tiny_vocab_runner.batch.seqs[1].num_computed_tokens)
        with pytest.raises(BadPlan, match=match):
            tiny_vocab_runner.step(StepPlan(1, running=[delta]))
        assert (tiny_vocab_runner.batch.seqs[1].token_ids, tiny_vocab_runner.batch.seqs[1].num_computed_tokens) == before


@pytest.mark.slow
def test_the_default_models_greedy_tokens_are_the_same_with_drafts(default_model):
    """SmolLM2 in float32 on the production path, asked to repeat a passage (drafts mostly accepted) and to write
    freely (mostly refused): the same tokens as plain decoding, and drafts accepted."""
    from transformers import AutoTokenizer
    model_dir = str(default_model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    passage = ("It was a bright cold day in April, and the clocks were striking thirteen. Winston Smith, his chin "
               "nuzzled into his breast in an effort to escape the vile wind, slipped quickly through the glass doors.")
    chats = [f"Repeat this text exactly:\n\n{passage}", "Write a short poem about the sea.",
             f"Correct the spelling: {passage.replace('bright', 'brigth').replace('quickly', 'quikcly')}"]
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                           tokenize=False))["input_ids"] for c in chats]
    loaded = load_model(model_dir, dtype="float32")
    pool = KVPool(loaded.kv_geometry(16), 128)
    big = ModelRunner(loaded, pool, make_backend("cpu", "cpu", pool.geometry))
    plain, _ = run(big, GREEDY, "none", prompts, new=48)
    fast, sched = run(big, GREEDY, "ngram", prompts, new=48)
    assert fast == plain
    assert sched.spec.counters.num_accepted_tokens >= 20
