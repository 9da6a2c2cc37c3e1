"""Moving requests between workers' schedulers: a lost worker releases all, a leaving one its queue."""

from __future__ import annotations

from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.core.step import ScheduledStep

_RUNNING = RequestStatus.RUNNING


class Handover:
    """Part of Scheduler (a mixin over its state): what the engine needs to move requests between workers.

    NOTE: a moved request is recomputed from all its known tokens (prompt and streamed output) with its own
    seed and sample index, so it continues exactly where it stopped; its KV never travels.
    """

    def release_all(self, in_flight: ScheduledStep | None = None) -> list[Request]:
        """The worker is gone: every unfinished client request, oldest first, reset to be recomputed elsewhere
        (adopt()). Every block goes back to the pool, the CPU blocks the step `in_flight` swapped in included."""
        out = sorted(self.requests.values(), key=lambda r: r.arrival_time)
        for seq in self.running:
            self.kv.free(seq.seq_id)
        for req in out:
            for seq in self._unfinished(req):
                self._reset_for_recompute(seq)
        self.running.clear()
        self.waiting.clear()
        self.requests.clear()
        self._num_seq_slots, self.num_constrained = 0, 0
        self._finished_seq_ids = []
        self.min_tokens_request_ids.clear()
        if in_flight is not None and in_flight.cpu_block_ids_to_free:
            self.cpu_pool.free(in_flight.cpu_block_ids_to_free)
            in_flight.cpu_block_ids_to_free = []
        return out

    def take_queued(self) -> list[Request]:
        """Removes the client requests none of whose samples holds blocks here (queued: never started, or
        preempted), reset for another worker to adopt(); for a worker that is leaving."""
        out = []
        for req in list(self.requests.values()):
            seqs = self._unfinished(req)
            if any(s.status is _RUNNING for s in seqs):
                continue
            for seq in seqs:
                self.waiting.remove(seq)
                self._reset_for_recompute(seq)
            del self.requests[req.request_id]
            self.num_constrained -= req.constraint is not None
            out.append(req)
        return out

    def adopt(self, req: Request) -> None:
        """Queues a request released by another worker: its samples get fresh sequence ids and are recomputed
        from all their known tokens (prompt and streamed output) with their own seeds, so they continue exactly
        where they stopped. It queues by arrival time, ahead of younger requests (of its priority, of its tenant).
        Raises ValueError like add_request when this worker can never serve it."""
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in flight")
        self.check_fits(req)
        seqs = self._unfinished(req)
        for seq in seqs:
            seq.seq_id = self._new_seq_id()
        for seq in seqs:
            self.waiting.insert_by_arrival(seq)
        self.requests[req.request_id] = req
        self.num_constrained += req.constraint is not None
        if req.sampling.min_tokens:
            self.min_tokens_request_ids.add(req.request_id)

    @staticmethod
    def _unfinished(req: Request) -> list[Request]:
        """The sequences of a client request that still run: its unfinished samples once forked, else itself."""
        return [c for c in req.children if not c.is_finished] if req.children else [req]

    def _reset_for_recompute(self, seq: Request) -> None:
        if seq.cpu_block_ids is not None:
            self.cpu_pool.free(seq.cpu_block_ids)
            seq.cpu_block_ids = None
        # NOTE: PREEMPTED, not WAITING, keeps the request's first prefix hit as its reported cached tokens.
        if seq.status is not RequestStatus.WAITING:
            seq.status = RequestStatus.PREEMPTED
        seq.num_computed_tokens, seq.on_worker = 0, False
        seq.draft_token_ids = ()  # NOTE: a lost step's drafts are proposed again, if at all, where it runs next

    @property
    def num_pending_tokens(self) -> int:
        """Tokens still to run here: every unfinished sequence's uncomputed tokens plus its remaining output
        budget (an upper bound: EOS may come first). The router's measure of a worker's load."""
        total = 0
        for seq in (*self.running, *self.waiting):
            width = seq.fork_into or 1
            total += len(seq.all_token_ids) - seq.num_computed_tokens + \
                width * max(0, seq.sampling.max_tokens - len(seq.output_token_ids))
        return total
