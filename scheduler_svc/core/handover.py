"""Moving requests between workers' schedulers (Scheduler.release_all, take_queued, adopt): what a moved sequence
keeps and what it drops.

NOTE: a moved request is recomputed from all its known tokens (prompt and streamed output) with its own seed and
sample index, so it continues exactly where it stopped; its KV never travels.
"""

from __future__ import annotations

from collections.abc import Iterable

from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.kv.block_pool import BlockPool


def unfinished(req: Request) -> list[Request]:
    """The sequences of a client request that still run: its unfinished samples once forked, else itself."""
    return [c for c in req.children if not c.is_finished] if req.children else [req]


def reset_for_recompute(seq: Request, cpu_pool: BlockPool | None) -> None:
    """`seq` leaves its worker: its swapped-out KV (if any) back to `cpu_pool`, nothing computed, not on a worker."""
    if seq.cpu_block_ids is not None:
        cpu_pool.free(seq.cpu_block_ids)
        seq.cpu_block_ids = None
    # NOTE: PREEMPTED, not WAITING, keeps the request's first prefix hit as its reported cached tokens.
    if seq.status is not RequestStatus.WAITING:
        seq.status = RequestStatus.PREEMPTED
    seq.num_computed_tokens, seq.on_worker = 0, False
    seq.draft_token_ids = ()  # NOTE: a lost step's drafts are proposed again, if at all, where it runs next


def num_pending_tokens(seqs: Iterable[Request]) -> int:
    """Tokens still to run for `seqs`: every one's uncomputed tokens plus its remaining output budget (an upper
    bound: EOS may come first)."""
    total = 0
    for seq in seqs:
        width = seq.fork_into or 1
        total += len(seq.all_token_ids) - seq.num_computed_tokens + \
            width * max(0, seq.sampling.max_tokens - len(seq.output_token_ids))
    return total
