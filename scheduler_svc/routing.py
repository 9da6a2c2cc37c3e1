"""Which worker takes a new request: by the exact prefix each worker holds, balanced against load."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pagedserve_common.config import ROUTING as POLICIES
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.kv.manager import block_tokens


class Routable(Protocol):
    worker_id: str
    scheduler: Scheduler


@dataclass(slots=True)
class RouteDecision:
    worker_id: str
    cached_tokens: int  # prompt tokens the chosen worker holds (in its cache, or being prefilled there)


@dataclass(slots=True)
class _Pending:
    """Prompts routed to a worker whose prefill has not finished: their blocks are not in its cache yet."""

    chains: Counter = field(default_factory=Counter)  # chain hash of a leading run of full blocks -> prompts


class Router:
    """kv: the worker holding the longest prefix of the prompt wins, among the workers whose load (pending
    tokens, Scheduler.num_pending_tokens) is within `balance_ratio` x the least loaded one's plus
    `balance_slack_tokens`; the least loaded worker when no one holds a block of it. So a worker with a hot
    prefix takes its requests until it is loaded well beyond the others, and then the prefix spreads.
    least-loaded: fewest pending tokens. round-robin: in turn.

    NOTE: what a worker holds is exact: its KV manager's prefix cache (looked up without side effects), plus
    the prompts routed to it whose prefill is still queued or running (tracked here until `prefilled()`), so
    that a burst of requests sharing a prefix goes to one worker before any of them has run.
    """

    def __init__(self, policy: str = "kv", balance_ratio: float = 1.5, balance_slack_tokens: int = 4096) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.balance_ratio = balance_ratio
        self.balance_slack_tokens = balance_slack_tokens
        self._turn = itertools.count()
        self._pending: dict[str, _Pending] = {}  # worker_id -> prompts in prefill there
        self._routed: dict[str, tuple[str, list[int]]] = {}  # request_id -> (worker_id, its chain hashes)

    def choose(self, workers: Sequence[Routable], prompt_token_ids: Sequence[int],
               cache_salt: str | None = None) -> RouteDecision:
        if not workers:
            raise ValueError("no worker to route to")
        if self.policy == "round-robin":
            w = workers[next(self._turn) % len(workers)]
            return RouteDecision(w.worker_id, self._held(w, prompt_token_ids, cache_salt, None))
        loads = [w.scheduler.num_pending_tokens for w in workers]
        least = min(range(len(workers)), key=lambda i: (loads[i], w_order(workers[i])))
        if self.policy == "least-loaded":
            w = workers[least]
            return RouteDecision(w.worker_id, self._held(w, prompt_token_ids, cache_salt, None))
        bound = loads[least] * self.balance_ratio + self.balance_slack_tokens
        chains = chain_hashes(prompt_token_ids, workers[0].scheduler.config.block_size, cache_salt)
        best, best_held = least, -1
        for i, w in enumerate(workers):
            if loads[i] > bound:
                continue
            held = self._held(w, prompt_token_ids, cache_salt, chains)
            if held > best_held or (held == best_held and loads[i] < loads[best]):
                best, best_held = i, held
        if best_held <= 0:
            best = least
            best_held = self._held(workers[least], prompt_token_ids, cache_salt, chains)
        return RouteDecision(workers[best].worker_id, best_held)

    def _held(self, w: Routable, prompt: Sequence[int], salt: str | None, chains: list[int] | None) -> int:
        """Prompt tokens `w` holds: cached there now, or in a prompt being prefilled there."""
        cached = w.scheduler.kv.cached_prefix_len(prompt, salt)
        pending = self._pending.get(w.worker_id)
        if pending is None or not pending.chains:
            return cached
        if chains is None:
            chains = chain_hashes(prompt, w.scheduler.config.block_size, salt)
        n = 0
        for h in chains:
            if h not in pending.chains:
                break
            n += 1
        return max(cached, n * w.scheduler.config.block_size)

    # -- prompts in prefill -------------------------------------------------------------------------------
    def routed(self, request_id: str, worker_id: str, prompt_token_ids: Sequence[int], block_size: int,
               cache_salt: str | None = None) -> None:
        """`request_id` was placed on `worker_id`: its prompt counts as held there until prefilled()."""
        if self.policy != "kv":
            return
        self.prefilled(request_id)
        chains = chain_hashes(prompt_token_ids, block_size, cache_salt)
        self._pending.setdefault(worker_id, _Pending()).chains.update(chains)
        self._routed[request_id] = (worker_id, chains)

    def prefilled(self, request_id: str) -> None:
        """Its prompt is in the worker's cache now (or it finished, or moved): stop counting it as pending."""
        entry = self._routed.pop(request_id, None)
        if entry is None:
            return
        pending = self._pending[entry[0]]
        pending.chains.subtract(entry[1])
        for h in entry[1]:
            if pending.chains[h] <= 0:
                del pending.chains[h]

    def forget_worker(self, worker_id: str) -> None:
        self._pending.pop(worker_id, None)
        for rid in [r for r, (w, _) in self._routed.items() if w == worker_id]:
            del self._routed[rid]


def w_order(w: Routable) -> tuple[int, str]:
    """Tie-break: fewer sequences first, then the worker id (deterministic)."""
    return (w.scheduler.num_running + w.scheduler.num_waiting, w.worker_id)


def chain_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[int]:
    """One hash per full block a prefix hit could cover (a hit never covers the last token), each chained on
    the one before: equal hashes mean equal prefixes, up to collisions, which cost a routing choice only."""
    h = hash(("salt", cache_salt))
    out = []
    for start in range(0, (len(token_ids) - 1) // block_size * block_size, block_size):
        h = hash((h, block_tokens(token_ids, start, start + block_size)))
        out.append(h)
    return out
