"""The logits stage before sampling, row by row against a plain float64 reference: penalties, logit_bias,
allowed_token_ids, min_tokens, bad words, the structured-output bitmask (applied last, winning), and the untouched
common case."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from pagedserve_common.sampling import SamplingParams
from pagedserve_common.step import NewSequence, StepPlan
from tests.support.worker import apply_rules, pack_bitmask
from worker_svc.batch import PersistentBatch
from worker_svc.logits import LogitsProcessor, bitmask_num_bytes, refused_on_device, unpack_bitmasks

V = 100
EOS = (2, 3)


def pack(allowed: list[int], vocab: int = V) -> bytes:
    return pack_bitmask(allowed, vocab)


def reference(raw: np.ndarray, sp: SamplingParams, token_ids: list[int], num_prompt: int,
              bitmask: list[int] | None) -> np.ndarray:
    """One row, the rules written out in float64, one token at a time; then the bitmask, winning."""
    x = torch.from_numpy(raw).double()
    apply_rules(x, sp, token_ids, num_prompt, EOS)
    x = x.numpy()
    if bitmask is not None:
        mask = np.full(V, -math.inf)
        mask[bitmask] = 0.0
        y = x + mask
        x = y if np.isfinite(y).any() else raw.astype(np.float64) + mask
    elif not np.isfinite(x).any():
        x = raw.astype(np.float64)
    return x


def run(raw: torch.Tensor, seqs, bitmasks: dict[int, bytes] | None = None) -> torch.Tensor:
    """The processed logits (the processor works in place: on a copy here, so that `raw` stays raw)."""
    out = raw.clone()
    LogitsProcessor(V, EOS)(out, list(seqs), bitmasks or {})
    return out


def admit(cases: list[tuple[SamplingParams, list[int], int]]) -> PersistentBatch:
    batch = PersistentBatch()
    batch.apply(StepPlan(0, new_seqs=[NewSequence(i, ids, [], len(ids), 0, sp, 0, num_prompt)
                                      for i, (sp, ids, num_prompt) in enumerate(cases)]))
    return batch


def check_rows(out: torch.Tensor, raw: torch.Tensor, batch: PersistentBatch, bitmasks: dict[int, list[int]]) -> None:
    for i, s in enumerate(batch.seqs.values()):
        want = reference(raw[i].numpy(), s.sampling, s.token_ids, s.num_prompt_tokens, bitmasks.get(s.seq_id))
        got = out[i].double().numpy()
        assert np.array_equal(np.isinf(got), np.isinf(want)), f"row {i}: masked tokens differ"
        fin = np.isfinite(want)
        np.testing.assert_allclose(got[fin], want[fin], rtol=1e-5, atol=1e-5, err_msg=f"row {i}")


def random_case(rng: random.Random) -> tuple[SamplingParams, list[int], int]:
    num_prompt, num_out = rng.randint(1, 30), rng.randint(0, 30)
    ids = [rng.randrange(V) for _ in range(num_prompt + num_out)]
    pick = rng.random
    sp = SamplingParams(
        max_tokens=100,
        presence_penalty=rng.uniform(-2, 2) if pick() < 0.5 else 0.0,
        frequency_penalty=rng.uniform(-2, 2) if pick() < 0.5 else 0.0,
        repetition_penalty=rng.uniform(0.5, 2) if pick() < 0.5 else 1.0,
        logit_bias=tuple(sorted((t, rng.uniform(-100, 100)) for t in rng.sample(range(V), rng.randint(1, 5))))
        if pick() < 0.4 else (),
        min_tokens=rng.randint(0, 40) if pick() < 0.4 else 0, ignore_eos=pick() < 0.2,
        stop_token_ids=tuple(rng.sample(range(V), 2)) if pick() < 0.3 else (),
        bad_words_token_ids=tuple(tuple(ids[-rng.randint(1, 3):]) if pick() < 0.5 else
                                  tuple(rng.randrange(V) for _ in range(rng.randint(1, 3)))
                                  for _ in range(rng.randint(1, 3))) if pick() < 0.4 else (),
        # NOTE: sometimes EOS alone, which min_tokens masks whole
        allowed_token_ids=(tuple(sorted(rng.sample(range(V), rng.randint(1, 30)))) if pick() < 0.5 else EOS)
        if pick() < 0.4 else ())
    return sp, ids, num_prompt


@pytest.mark.parametrize("seed", range(8))
def test_random_rows_match_the_float64_reference_step_after_step(seed):
    rng = random.Random(seed)
    cases = [random_case(rng) for _ in range(12)]
    batch = admit(cases)
    proc = LogitsProcessor(V, EOS)
    seqs = list(batch.seqs.values())
    for _ in range(3):  # the counts are kept incrementally: they follow the tokens appended after each step
        raw = torch.randn(len(seqs), V, generator=torch.Generator().manual_seed(rng.randrange(2**31))) * 5
        allowed = {s.seq_id: rng.sample(range(V), rng.randint(1, 20)) for s in seqs if rng.random() < 0.3}
        out = raw.clone()
        proc(out, seqs, {k: pack(v) for k, v in allowed.items()})
        check_rows(out, raw, batch, allowed)
        for s in seqs:
            s.token_ids.append(rng.randrange(V))


def test_rows_without_rules_are_returned_untouched_without_a_copy():
    batch = admit([(SamplingParams(temperature=0.7, top_p=0.9), [5, 6, 7], 2), (SamplingParams(), [1], 1)])
    raw = torch.randn(2, V)
    assert torch.equal(run(raw, batch.seqs.values()), raw)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output_tokens():
    batch = admit([(SamplingParams(repetition_penalty=2.0), [10, 11, 12], 2)])
    raw = torch.zeros(1, V)
    raw[0, 10], raw[0, 12], raw[0, 13] = 4.0, -4.0, 4.0
    out = run(raw, batch.seqs.values())
    assert (out[0, 10].item(), out[0, 12].item(), out[0, 13].item()) == (2.0, -8.0, 4.0)


def test_presence_and_frequency_penalties_count_outputs_only():
    sp = SamplingParams(presence_penalty=0.5, frequency_penalty=1.0)
    batch = admit([(sp, [7, 7, 7, 8, 8, 9], 3)])  # prompt 7 7 7, outputs 8 8 9
    out = run(torch.zeros(1, V), batch.seqs.values())
    assert (out[0, 7].item(), out[0, 8].item(), out[0, 9].item()) == (0.0, -2.5, -1.5)


def test_min_tokens_masks_eos_and_stop_ids_until_enough_outputs():
    sp = SamplingParams(min_tokens=2, stop_token_ids=(50,), max_tokens=10)
    batch = admit([(sp, [1, 40], 1)])  # one output so far
    s = batch.seqs[0]
    out = run(torch.zeros(1, V), [s])
    assert torch.isinf(out[0, [2, 3, 50]]).all() and torch.isfinite(out[0, [0, 1, 4, 49]]).all()
    s.token_ids.append(41)  # two outputs: the stop ids are back
    assert torch.isfinite(run(torch.zeros(1, V), [s])).all()


def test_bad_words_mask_the_last_token_after_their_prefix_and_single_tokens_always():
    sp = SamplingParams(bad_words_token_ids=((20, 21, 22), (30,)))
    batch = admit([(sp, [20, 21, 5, 20, 21], 3)])  # outputs 20 21: the prefix of (20, 21, 22)
    s = batch.seqs[0]
    out = run(torch.zeros(1, V), [s])
    assert torch.isinf(out[0, [22, 30]]).all() and torch.isfinite(out[0, 21])
    s.token_ids.append(9)
    out = run(torch.zeros(1, V), [s])
    assert torch.isfinite(out[0, 22]) and torch.isinf(out[0, 30])


def test_a_prefix_in_the_prompt_alone_bans_nothing():
    sp = SamplingParams(bad_words_token_ids=((20, 21, 22),))
    batch = admit([(sp, [20, 21], 2)])  # the prompt ends with the prefix; no output yet
    assert torch.isfinite(run(torch.zeros(1, V), batch.seqs.values())).all()


@pytest.mark.parametrize("num_free_rows", [0, 1])  # every row constrained (in place), or some (gathered)
def test_the_bitmask_wins_when_the_other_masks_leave_nothing_it_allows(num_free_rows):
    sp = SamplingParams(min_tokens=5, bad_words_token_ids=((40,),), logit_bias=((41, -100.0),),
                        repetition_penalty=2.0, presence_penalty=1.0)
    batch = admit([(sp, [1, 2, 40], 1), (SamplingParams(), [1], 1)] + [(sp, [1], 1)] * num_free_rows)
    raw = torch.randn(2 + num_free_rows, V)
    # row 0: the bitmask allows EOS and 40 only, both masked by min_tokens and bad words: the bitmask alone decides
    out = run(raw, batch.seqs.values(), {0: pack([2, 40]), 1: pack([7])})
    assert torch.equal(torch.isfinite(out[0]).nonzero().flatten(), torch.tensor([2, 40]))
    assert torch.allclose(out[0, [2, 40]], raw[0, [2, 40]])
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [7]
    assert not torch.isnan(out).any()
    if num_free_rows:
        check_rows(out, raw, batch, {0: [2, 40], 1: [7]})


def test_allowed_token_ids_leave_their_logits_as_they_were_and_every_other_one_minus_inf():
    """A batch mixing rows with and without a list (and one whose list meets logit_bias): exact values."""
    batch = admit([(SamplingParams(allowed_token_ids=(0, 5, 99)), [1, 2], 1), (SamplingParams(), [1], 1),
                   (SamplingParams(allowed_token_ids=(7, 8), logit_bias=((8, 2.5), (9, 1.0))), [1], 1),
                   (SamplingParams(temperature=0.5, presence_penalty=0.5), [4, 4], 1)])
    raw = torch.randn(4, V)
    out = run(raw, batch.seqs.values())
    for row, allowed in ((0, [0, 5, 99]), (2, [7, 8])):
        assert torch.isfinite(out[row]).nonzero().flatten().tolist() == allowed
        assert (out[row][torch.isinf(out[row])] == -math.inf).all()
    assert torch.equal(out[0, [0, 5, 99]], raw[0, [0, 5, 99]])
    assert torch.equal(out[1], raw[1])
    assert out[2, 7].item() == raw[2, 7].item() and out[2, 8].item() == (raw[2, 8] + 2.5).item()
    assert torch.isfinite(out[3]).all() and out[3, 4].item() == (raw[3, 4] - 0.5).item()


def test_the_allow_list_mask_is_built_once_per_sequence():
    batch = admit([(SamplingParams(allowed_token_ids=(3, 4)), [1], 1)])
    s = batch.seqs[0]
    mask = s.refused_tokens(torch.device("cpu"), V)
    run(torch.randn(1, V), [s])
    s.token_ids.append(3)
    run(torch.randn(1, V), [s])
    assert s.refused_tokens(torch.device("cpu"), V) is mask
    assert torch.flatten(torch.nonzero(~mask)).tolist() == [3, 4]


def test_min_tokens_and_bad_words_mask_listed_ids_but_never_all_of_them():
    sp = SamplingParams(allowed_token_ids=(2, 40, 41), min_tokens=5, max_tokens=10, bad_words_token_ids=((40,),))
    # every listed id masked: bad words' masks give way (min_tokens' stay: no stop id before min_tokens)
    emptied = SamplingParams(allowed_token_ids=(2, 40), min_tokens=5, max_tokens=10, bad_words_token_ids=((40,),),
                             logit_bias=((40, 1.5),))
    # stop ids alone under min_tokens (the front end refuses such a request): min_tokens' masks give way too
    stops_only = SamplingParams(allowed_token_ids=EOS, min_tokens=5, max_tokens=10, bad_words_token_ids=((3,),))
    batch = admit([(sp, [1], 1), (emptied, [1], 1), (stops_only, [1], 1)])
    raw = torch.randn(3, V)
    out = run(raw, batch.seqs.values())
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [41]  # EOS (min_tokens) and 40 (bad word) masked
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [40]
    assert out[1, 40].item() == (raw[1, 40] + 1.5).item()
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == list(EOS)
    assert torch.equal(out[2, list(EOS)], raw[2, list(EOS)])
    check_rows(out, raw, batch, {})


def test_the_bitmask_wins_over_an_allow_list_it_shares_no_token_with():
    batch = admit([(SamplingParams(allowed_token_ids=(5, 6), logit_bias=((6, 3.0),)), [1], 1),
                   (SamplingParams(allowed_token_ids=(5,)), [1], 1), (SamplingParams(), [1], 1)])
    raw = torch.randn(3, V)
    out = run(raw, batch.seqs.values(), {0: pack([6, 7]), 1: pack([6, 7])})
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [6]  # both agree on 6
    assert out[0, 6].item() == (raw[0, 6] + 3.0).item()
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [6, 7]  # none in common: raw, under the bitmask
    assert torch.equal(out[1, [6, 7]], raw[1, [6, 7]])
    assert torch.equal(out[2], raw[2])
    check_rows(out, raw, batch, {0: [6, 7], 1: [6, 7]})


def test_unpacking_follows_the_little_endian_word_layout():
    vocab = 70  # 3 words, the last partly padding
    allowed = [0, 1, 31, 32, 33, 63, 64, 69]
    bits = unpack_bitmasks([pack(allowed, vocab)], vocab)
    assert len(pack(allowed, vocab)) == bitmask_num_bytes(vocab) == 12
    assert np.flatnonzero(bits[0]).tolist() == allowed
    words = np.array([0b101, 0, 1 << 5], dtype="<u4").tobytes()
    assert np.flatnonzero(unpack_bitmasks([words], vocab)[0]).tolist() == [0, 2, 69]


def test_the_accelerator_unpacking_agrees_with_numpys():
    """A GPU worker unpacks on the device with torch ops (run here on the CPU's tensors)."""
    rng = np.random.default_rng(0)
    vocab = 1000
    masks = [bytes(rng.integers(0, 256, bitmask_num_bytes(vocab), dtype=np.uint8)) for _ in range(5)]
    refused = refused_on_device(masks, vocab, torch.device("cpu"))
    assert torch.equal(refused, torch.from_numpy(~unpack_bitmasks(masks, vocab)))
