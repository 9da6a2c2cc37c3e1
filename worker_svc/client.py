"""The worker process: dials in to the scheduler, registers, then answers one StepPlan per step."""

from __future__ import annotations

import queue
import time

import grpc
import structlog
import torch

from pagedserve.v1 import worker_pb2, worker_pb2_grpc
from worker_svc.convert import plan_from_pb, result_to_pb
from worker_svc.threads import ThreadGovernor
from worker_svc.worker import WorkerConfig, WorkerInfo, available_cores, create_runner

log = structlog.get_logger("pagedserve.worker")


def registration_pb(info: WorkerInfo) -> worker_pb2.WorkerMessage:
    return worker_pb2.WorkerMessage(registration=worker_pb2.WorkerRegistration(
        model_id=info.model_id, num_blocks=info.num_blocks, block_size=info.block_size, dtype=info.dtype,
        max_model_len=info.max_model_len, device=info.device, num_cpu_blocks=info.num_cpu_blocks))


def make_governor(cfg: WorkerConfig) -> ThreadGovernor | None:
    """Adaptive compute threads, unless --threads fixed them (or the worker is on a GPU)."""
    if cfg.threads is not None or cfg.device != "cpu":
        return None

    def changed(old: int, new: int, waiting: float, idle: float) -> None:
        log.info("compute threads changed", threads=new, was=old, cores_waiting=round(waiting, 2),
                 cores_idle=round(idle, 2))
    return ThreadGovernor(available_cores(), torch.set_num_threads, on_change=changed)


def run_worker(scheduler: str, cfg: WorkerConfig, connect_timeout: float = 60.0) -> None:
    runner, info = create_runner(cfg)
    governor = make_governor(cfg)
    log.info("worker ready", scheduler=scheduler, num_blocks=info.num_blocks, block_size=info.block_size,
             dtype=info.dtype, device=info.device, kv_bytes=runner.pool.nbytes, threads=torch.get_num_threads(),
             cores=available_cores(), adaptive_threads=bool(governor and governor.enabled),
             attention=runner.backend.name, forward=runner.forward_path)
    with grpc.insecure_channel(scheduler, options=[("grpc.max_receive_message_length", 64 << 20)]) as channel:
        grpc.channel_ready_future(channel).result(timeout=connect_timeout)
        serve_plans(channel, runner, info, governor)


def serve_plans(channel: grpc.Channel, runner, info: WorkerInfo, governor: ThreadGovernor | None = None) -> None:
    """Attach: registration first, then one StepResult per StepPlan, until the scheduler closes the stream."""
    outbox: queue.Queue = queue.Queue()
    outbox.put(registration_pb(info))

    def messages():
        while (msg := outbox.get()) is not None:
            yield msg

    try:
        sent_at = None
        for plan_pb in worker_pb2_grpc.WorkerControlStub(channel).Attach(messages()):
            t0 = time.perf_counter()
            out = runner.step(plan_from_pb(plan_pb))
            result = result_to_pb(out)
            result.step_seconds = time.perf_counter() - t0
            result.idle_seconds = 0.0 if sent_at is None else t0 - sent_at
            outbox.put(worker_pb2.WorkerMessage(result=result))
            sent_at = time.perf_counter()
            if governor is not None:
                governor.tick()
    except grpc.RpcError as e:
        if e.code() not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE):
            raise
        log.info("scheduler closed the stream", code=e.code().name)
    finally:
        outbox.put(None)
