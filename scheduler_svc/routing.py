"""Which worker takes a new request: by the exact prefix each worker holds, balanced against load."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pagedserve_common.config import ROUTING as POLICIES, ROUTING_BALANCE_EPS
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


@dataclass(slots=True, frozen=True)
class Load:
    """A worker's load as the router weighs it: pending tokens, then sequences to break ties (two idle workers, or
    equal token counts: the one batching fewer sequences runs shorter steps)."""

    tokens: int  # Scheduler.num_pending_tokens: uncomputed prompt tokens + remaining output budgets
    seqs: int  # running + waiting

    @classmethod
    def of(cls, w: Routable) -> Load:
        return cls(w.scheduler.num_pending_tokens, w.scheduler.num_running + w.scheduler.num_waiting)


class Router:
    """kv: prefix affinity within a load bound.
    1. The bound (bounded-load consistent hashing, Mirrokni et al. 2018): a worker may take the request only if
       its pending tokens are within (1 + `balance_eps`) x the fleet's average counting this prompt. Relative, with
       no absolute slack: with small chat requests a slack of thousands of tokens never binds (issue 48: one shared
       chat-template prefix sent every request to one worker). The least loaded worker is always within it.
    2. Among those, the largest gain: `hit_weight` x the prompt tokens a worker holds (prefill it skips) minus its
       lead in pending tokens over the least loaded of them (work this request shares steps with). A long document's
       holder keeps it while its lead is shorter than that; a short prefix every request shares (a chat template's
       system prompt) is worth less than one request's load, so it spreads at once, and once every worker holds
       it, load alone decides. Nothing held anywhere: the least loaded worker.
    least-loaded: fewest pending tokens. round-robin: in turn. Ties: fewer sequences, then the worker id.

    NOTE: load is pending tokens (Scheduler.num_pending_tokens: uncomputed prompt + remaining output budget, each
    sequence's remaining work); sequences only break ties. A bound in sequences as well (tried at 1.25x and 2x the
    average) cost prefix hits in every scenario of bench/routing.py's simulation tried, for no consistent gain in
    latency: a worker with many nearly finished sequences has little left to do.

    NOTE: what a worker holds is exact: its KV manager's prefix cache (looked up without side effects), plus
    the prompts routed to it whose prefill is still queued or running (tracked here until `prefilled()`), so
    that a burst of requests sharing a long prefix goes to one worker (within the bound) before any of them has
    run.
    """

    # NOTE: eps 0.5 and the weight 4 come from bench/routing.py's multi-tenant simulation (seeds 0-2, rates 1.5-2.5,
    # 2-4 workers). A tighter bound (0.25) or a lighter weight (1, 2) copies tenants' prompts into more caches than
    # hold them all; the preemptions and recomputes that follow raise the loads that spread prompts further (some
    # runs: hit rate 0.84 down to 0.6-0.75, 2-4x the mean latency). A weight above 1 is also the honest price: the
    # lead is mostly output budget decoded in the same steps as this request's prefill, while a missed token is
    # computed before its first token, and a second copy of the prefix evicts someone else's.
    def __init__(self, policy: str = "kv", balance_eps: float = ROUTING_BALANCE_EPS, hit_weight: float = 4.0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing must be one of {', '.join(POLICIES)}, got {policy!r}")
        if balance_eps < 0 or hit_weight < 0:
            raise ValueError(f"balance_eps and hit_weight must be >= 0, got {balance_eps} and {hit_weight}")
        self.policy = policy
        self.balance_eps = balance_eps
        self.hit_weight = hit_weight
        self._turn = itertools.count()
        self._pending: dict[str, _Pending] = {}  # worker_id -> prompts in prefill there
        self._routed: dict[str, tuple[str, list[int]]] = {}  # request_id -> (worker_id, its chain hashes)

    def choose(self, workers: Sequence[Routable], prompt_token_ids: Sequence[int],
               cache_salt: str | None = None) -> RouteDecision:
        if not workers:
            raise ValueError("no worker to route to")
        if self.policy == "kv":
            return self._choose_kv(workers, prompt_token_ids, cache_salt)
        if self.policy == "round-robin":
            w = workers[next(self._turn) % len(workers)]
        else:  # least-loaded
            w = min(workers, key=lambda w: _lighter(Load.of(w), w))
        return RouteDecision(w.worker_id, self._held(w, prompt_token_ids, cache_salt, None))

    def _choose_kv(self, workers: Sequence[Routable], prompt: Sequence[int], salt: str | None) -> RouteDecision:
        loads = [Load.of(w) for w in workers]
        eligible = self.within_bound(loads, len(prompt))
        chains = chain_hashes(prompt, workers[0].scheduler.config.block_size, salt)
        held = {i: self._held(workers[i], prompt, salt, chains) for i in eligible}
        floor = min(loads[i].tokens for i in eligible)
        best = min(eligible, key=lambda i: (loads[i].tokens - floor - self.hit_weight * held[i],
                                            _lighter(loads[i], workers[i])))
        return RouteDecision(workers[best].worker_id, held[best])

    def within_bound(self, loads: Sequence[Load], prompt_len: int) -> list[int]:
        """Indexes of the workers whose pending tokens are within (1 + eps) x the average with this prompt added.
        Never empty: the least loaded one is at most the average."""
        cap = (1 + self.balance_eps) * (sum(load.tokens for load in loads) + prompt_len) / len(loads)
        return [i for i, load in enumerate(loads) if load.tokens <= cap]

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


def _lighter(load: Load, w: Routable) -> tuple[int, int, str]:
    """Sort key, lightest first: fewer pending tokens, then fewer sequences, then the worker id (deterministic)."""
    return (load.tokens, load.seqs, w.worker_id)


def chain_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[int]:
    """One hash per full block a prefix hit could cover (a hit never covers the last token), each chained on
    the one before: equal hashes mean equal prefixes, up to collisions, which cost a routing choice only."""
    h = hash(("salt", cache_salt))
    out = []
    for start in range(0, (len(token_ids) - 1) // block_size * block_size, block_size):
        h = hash((h, block_tokens(token_ids, start, start + block_size)))
        out.append(h)
    return out
