"""An in-process serving loop for tests and benchmarks: the real scheduler drives one ModelRunner through serialized plans.

Tests and benchmarks use it to run the worker without gRPC transport or processes; everything else is the
production path (scheduler_svc.core.Scheduler, the protobuf plans and results, ModelRunner).
"""

from __future__ import annotations

import dataclasses

from pagedserve.v1 import worker_pb2
from pagedserve_common.step import PositionLogprobs
from pagedserve_common.wire import plan_to_pb, result_from_pb
from scheduler_svc.core.request import Request
from scheduler_svc.core.result_check import check_result
from pagedserve_common.sampling import SamplingParams
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.scheduler import Scheduler
from pagedserve_common.wire import plan_from_pb, result_to_pb
from worker_svc.runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0)


class LocalDriver:
    def __init__(self, runner: ModelRunner, max_num_batched_tokens: int = 256, max_num_seqs: int = 64,
                 eos_token_ids: tuple[int, ...] | None = None, enable_prefix_caching: bool = True,
                 num_cpu_blocks: int = 0, speculative: str = "none", num_speculative_tokens: int = 4) -> None:
        self.runner = runner
        self.scheduler = Scheduler(SchedulerConfig(
            num_blocks=runner.pool.num_blocks, max_model_len=runner.loaded.max_model_len,
            block_size=runner.pool.geometry.block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching,
            eos_token_ids=runner.loaded.eos_token_ids if eos_token_ids is None else eos_token_ids,
            num_cpu_blocks=num_cpu_blocks, speculative=speculative, num_speculative_tokens=num_speculative_tokens,
            kv_group_windows=runner.pool.groups.windows))
        self.pending: list[tuple[int, Request]] = []  # (arrival step, request) not yet submitted
        self.outputs: dict[str, list[list[int]]] = {}
        # Each generated token's logprobs, for the requests whose sampling asks for them (logprobs not None).
        self.logprobs: dict[str, list[list[PositionLogprobs]]] = {}
        self.requests: dict[str, Request] = {}  # every request added (its prompt_log holds its prompt logprobs)
        self.step_id = 0
        self.num_copies = 0

    def add(self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams = GREEDY, arrival_step: int = 0,
            n: int = 1) -> str:
        request_id = f"r{len(self.outputs)}"
        sampling = dataclasses.replace(sampling, max_tokens=max_new_tokens, n=n)
        self.requests[request_id] = Request(request_id, list(prompt), sampling)
        self.pending.append((arrival_step, self.requests[request_id]))
        self.outputs[request_id] = [[] for _ in range(n)]
        self.logprobs[request_id] = [[] for _ in range(n)]
        return request_id

    def move_to(self, other: LocalDriver) -> None:
        """This worker is lost: its scheduler releases every unfinished request (Scheduler.release_all) and `other`
        adopts them, recomputing each from its prompt and the tokens it has streamed (what the engine does)."""
        for req in self.scheduler.release_all():
            other.scheduler.adopt(req)
            other.outputs[req.request_id] = self.outputs.pop(req.request_id)
            other.logprobs[req.request_id] = self.logprobs.pop(req.request_id)
            other.requests[req.request_id] = self.requests.pop(req.request_id)
        other.outputs.update(self.outputs)  # the finished ones, so that `other` answers for all
        self.outputs = {}

    def run(self, max_steps: int = 1_000_000) -> dict[str, list[list[int]]]:
        """Runs until every request finished; returns each request's generated tokens, one list per sample."""
        sched = self.scheduler
        while (self.pending or sched.has_unfinished_requests()) and self.step_id < max_steps:
            for arrival, req in [p for p in self.pending if p[0] <= self.step_id]:
                sched.add_request(req)
                self.pending.remove((arrival, req))
            step = sched.schedule()
            self.step_id += 1
            if step is None:
                continue  # nothing runnable until a later arrival
            plan = step.plan
            self.num_copies += len(plan.copies)
            result = result_from_pb(result_to_pb(self.runner.step(plan_from_pb(worker_pb2.StepPlan.FromString(
                plan_to_pb(plan).SerializeToString())))))
            wrong = check_result(plan.step_id, result, step.due_samples(), self.runner.loaded.vocab_size,
                                 drafted=step.drafted, prompt_due=step.prompt_logprobs_due())
            assert wrong is None, wrong
            for out in sched.update(step, result.sampled, result.num_accepted_drafts, result.prompt_logprobs):
                self.outputs[out.request_id][out.index].extend(out.new_token_ids)
                if out.new_token_ids and out.seq_id in result.logprobs:
                    self.logprobs[out.request_id][out.index].append(result.logprobs[out.seq_id])
        return self.outputs
