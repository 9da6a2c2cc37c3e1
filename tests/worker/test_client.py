"""The worker's side of WorkerControl.Attach against a grpcio-testing channel: the test plays the scheduler."""

from __future__ import annotations

import os
import random
import socket
import threading

import grpc
import grpc_testing

from pagedserve.v1 import worker_pb2
from pagedserve_common.wire import plan_to_pb, result_from_pb
from scheduler_svc.core.request import Request
from pagedserve_common.sampling import SamplingParams
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.scheduler import Scheduler
from tests.support.worker import assert_same_greedy, make_runner, reference_greedy, reference_model
from worker_svc.client import serve_plans
from pagedserve_common.kv_geometry import KVGeometry
from pagedserve_common.registration import WorkerRegistration, default_name, name_error

SERVICE = worker_pb2.DESCRIPTOR.services_by_name["WorkerControl"]
ATTACH = SERVICE.methods_by_name["Attach"]


def test_registers_first_then_answers_every_plan_with_its_step(tiny_llama_dir):
    runner = make_runner(tiny_llama_dir, num_blocks=16)
    info = WorkerRegistration(model_id="tiny", max_model_len=512, device="cpu",
                              kv_geometry=KVGeometry(2, 2, 16, "float32", 16), num_blocks=16)
    channel = grpc_testing.channel([SERVICE], grpc_testing.strict_real_time())
    worker = threading.Thread(target=serve_plans, args=(channel, runner, info), daemon=True)
    worker.start()
    _, rpc = channel.take_stream_stream(ATTACH)

    first = rpc.take_request()
    assert first.WhichOneof("kind") == "registration"
    reg = first.registration
    assert (reg.model_id, reg.num_blocks, reg.kv_geometry.block_size, reg.kv_geometry.dtype,
            reg.max_model_len) == ("tiny", 16, 16, "float32", 512)
    # its name: HOST:PID, one the scheduler takes (pagedserve_common.registration.name_error)
    assert reg.name == default_name(socket.gethostname(), os.getpid()) and name_error(reg.name) is None

    # Two sequences, a 2-token budget: chunked prefill, then decodes, every plan a real one from the scheduler.
    prompts = [[random.Random(i).randrange(512) for _ in range(n)] for i, n in enumerate([3, 5])]
    sched = Scheduler(SchedulerConfig(num_blocks=16, max_model_len=512, max_num_batched_tokens=2))
    for i, p in enumerate(prompts):
        sched.add_request(Request(f"r{i}", p, SamplingParams(max_tokens=4, temperature=0.0)))
    tokens: dict[str, list[int]] = {"r0": [], "r1": []}
    while sched.has_unfinished_requests():
        step = sched.schedule()
        plan = step.plan
        rpc.send_response(plan_to_pb(plan))
        answer = rpc.take_request()
        assert answer.WhichOneof("kind") == "result" and answer.result.step_id == plan.step_id
        for out in sched.update(step, result_from_pb(answer.result).sampled):
            tokens[out.request_id] += out.new_token_ids
    rpc.terminate((), grpc.StatusCode.OK, "")
    worker.join(120)  # NOTE: a hang guard only, never a measure of speed
    assert not worker.is_alive()  # the worker leaves once the scheduler closes the stream

    model = reference_model(tiny_llama_dir)
    for i, p in enumerate(prompts):
        assert_same_greedy(tokens[f"r{i}"], *reference_greedy(model, p, 4))
