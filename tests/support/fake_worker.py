"""A worker written from the protos alone (pagedserve.v1 worker_pb2), as an attacker would: it registers whatever it
is given and answers each plan with whatever the test sends, over the real Attach stream of a scheduler process."""

from __future__ import annotations

import queue
import threading

import grpc

from pagedserve.v1 import worker_pb2, worker_pb2_grpc

WAIT = 120  # seconds; a hang guard only


def registration(model_id: str, *, block_size: int = 16, dtype: str = "float32",
                 **fields) -> worker_pb2.WorkerRegistration:
    """A registration like a real CPU worker's of the tiny test model, with `fields` overriding it."""
    reg = {**dict(model_id=model_id, max_model_len=512, device="cpu", num_blocks=64, name="fake:666"), **fields}
    return worker_pb2.WorkerRegistration(kv_geometry=worker_pb2.KVGeometry(
        num_layers=2, num_kv_heads=2, head_dim=16, dtype=dtype, block_size=block_size), **reg)


class FakeWorker:
    """Attaches with `reg` (and the call's `metadata`: a worker token); the plans it receives queue up (next_plan);
    send() answers one, or, `answering`, each is answered as it comes (answer)."""

    def __init__(self, address: str, reg: worker_pb2.WorkerRegistration, metadata=(), answering: bool = False) -> None:
        self.answering = answering
        self._out: queue.Queue = queue.Queue()
        self._out.put(worker_pb2.WorkerMessage(registration=reg))
        self._plans: queue.Queue = queue.Queue()
        self._lengths: dict[int, list[int]] = {}  # seq_id -> [known tokens, computed] (answer)
        self.status: tuple[grpc.StatusCode, str] | None = None  # how the scheduler ended the stream
        self._ended = threading.Event()
        self._channel = grpc.insecure_channel(address)
        self._call = worker_pb2_grpc.WorkerControlStub(self._channel).Attach(iter(self._out.get, None),
                                                                               metadata=metadata)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for plan in self._call:
                self._plans.put(plan)
                if self.answering:
                    self.answer(plan)
            self.status = (grpc.StatusCode.OK, "")
        except grpc.RpcError as e:
            self.status = (e.code(), e.details())
        self._ended.set()

    @property
    def num_plans(self) -> int:
        """Plans received and not yet taken by next_plan()."""
        return self._plans.qsize()

    def next_plan(self) -> worker_pb2.StepPlan:
        return self._plans.get(timeout=WAIT)

    def send(self, result: worker_pb2.StepResult) -> None:
        self._out.put(worker_pb2.WorkerMessage(result=result))

    def answer(self, plan: worker_pb2.StepPlan, token_id: int = 5) -> None:
        """A well-formed answer to `plan`, as a real worker's is shaped: `token_id` for each sequence that reaches
        the end of its known tokens (the scheduler refuses an answer with any other sequence's token)."""
        result = worker_pb2.StepResult(step_id=plan.step_id)
        for seq_id in (*plan.finished_seq_ids, *plan.preempted_seq_ids):
            self._lengths.pop(seq_id, None)
        for n in plan.new_seqs:
            self._lengths[n.seq_id] = [len(n.token_ids), n.num_computed_tokens]
        for s in (*plan.new_seqs, *plan.running):
            length = self._lengths[s.seq_id]  # [known tokens, computed]
            length[1] += s.num_scheduled_tokens
            if length[1] >= length[0]:
                result.tokens.add(seq_id=s.seq_id, token_id=token_id)
                length[0] += 1
        self.send(result)

    def leave(self, reason: str = "SIGTERM") -> None:
        """Announces a deliberate shutdown: the scheduler moves this worker's work, then ends the stream."""
        self._out.put(worker_pb2.WorkerMessage(leaving=worker_pb2.Leaving(reason=reason)))

    def ended(self) -> tuple[grpc.StatusCode, str]:
        """Waits for the scheduler to end the stream (a refusal, or a loss); its status and details."""
        assert self._ended.wait(WAIT), "the scheduler kept the fake worker's stream open"
        return self.status

    def close(self) -> None:
        self._out.put(None)
        self._call.cancel()
        self._channel.close()
