"""Help texts that quote a number say what the code does: the scheduler's defaults, not a copy typed twice."""

from __future__ import annotations

from pagedserve_common.config import ConnectionOptions, EngineOptions, LimitOptions
from pagedserve_common.options import leaves
from scheduler_svc.core.speculation import NGRAM_MAX, NGRAM_MIN
from scheduler_svc.core.waiting import ServiceCounter, WaitingQueue
from scheduler_svc.frontend.limits import Limits
from scheduler_svc.ports import MIN_PER_PEER
from scheduler_svc.routing import Router


def help_of(cls: type, name: str) -> str:
    leaf = next(leaf for leaf in leaves(cls) if leaf.name == name)
    return f"{leaf.option.help} (default: {leaf.option.default_text})"


def test_the_engine_flags_help_quotes_the_schedulers_defaults():
    assert f"last {NGRAM_MAX}..{NGRAM_MIN} tokens" in help_of(EngineOptions, "speculative")
    policy, counter = help_of(EngineOptions, "scheduling_policy"), ServiceCounter()
    assert f"waiting through {WaitingQueue('priority').aging_steps} admissions gains one level" in policy
    assert (f"a prompt token counting {counter.prefill_weight:g} and an output token {counter.decode_weight:g}"
            in policy)
    assert f"within {1 + Router().balance_eps:g}x the average load" in help_of(EngineOptions, "routing")


def test_the_bounds_help_quotes_the_front_ends_and_the_ports_defaults():
    assert f"each up to {Limits.for_model(1).max_stop_chars} characters" in help_of(LimitOptions, "max_stop_strings")
    assert f"at least {MIN_PER_PEER}" in help_of(ConnectionOptions, "max_connections_per_peer")
