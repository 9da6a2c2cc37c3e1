"""The per-request sequence bound (Limits.check_seqs): n alone names n, prompts x n names prompt."""

from __future__ import annotations

import pytest

from scheduler_svc.errors import EngineError, ErrorCode
from scheduler_svc.frontend.limits import Limits


def refusal(num_prompts: int, n: int, bound: int = 256) -> tuple[str, str] | None:
    try:
        Limits.for_model(128, max_seqs_per_request=bound).check_seqs(num_prompts, n)
    except EngineError as e:
        assert e.code == ErrorCode.INVALID_ARGUMENT
        return e.field, str(e)
    return None


@pytest.mark.parametrize("num_prompts, n", [(1, 1), (1, 256), (256, 1), (4, 64), (16, 16), (1, 0), (1000, 0)])
def test_within_the_bound(num_prompts, n):
    assert refusal(num_prompts, n) is None  # NOTE: n < 1 is the sampling check's to refuse


def test_n_alone_over_the_bound_names_n():
    assert refusal(1, 257) == ("n", "n is 257; the limit is 256 sequences per request (--max-seqs-per-request)")
    assert refusal(3, 300)[0] == "n"


def test_prompts_times_n_over_the_bound_names_prompt():
    assert refusal(1000, 64) == ("prompt", "prompt has 1000 prompts and n is 64: 64000 sequences; the limit is 256 "
                                           "per request (--max-seqs-per-request)")
    assert refusal(1500, 1)[0] == "prompt"
    assert refusal(3, 2, bound=5)[0] == "prompt"
