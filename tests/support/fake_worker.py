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
    send() answers one."""

    def __init__(self, address: str, reg: worker_pb2.WorkerRegistration, metadata=()) -> None:
        self._out: queue.Queue = queue.Queue()
        self._out.put(worker_pb2.WorkerMessage(registration=reg))
        self._plans: queue.Queue = queue.Queue()
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

    def ended(self) -> tuple[grpc.StatusCode, str]:
        """Waits for the scheduler to end the stream (a refusal, or a loss); its status and details."""
        assert self._ended.wait(WAIT), "the scheduler kept the fake worker's stream open"
        return self.status

    def close(self) -> None:
        self._out.put(None)
        self._call.cancel()
        self._channel.close()
