"""`pagedserve up --speculative ngram` over gRPC, the default model in float32: greedy tokens identical to a plain
`up`'s, drafts accepted and counted in /metrics; and a worker that claims more accepted drafts than it was sent is
lost, its request finishing on the honest worker with the same tokens."""

from __future__ import annotations

import threading

import grpc
import pytest

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc, worker_pb2
from pagedserve_common.defaults import DEFAULT_MODEL
from pagedserve_cli.up_cmd import wait_healthy
from pagedserve_common.ports import free_port
from tests.support.service import RPC_TIMEOUT, metric_value, scrape, started_service, wait_until
from tests.support.fake_worker import FakeWorker, registration
from tests.support.processes import stop_all, up
from worker_svc.model_store import resolve_model

PASSAGE = ("It was a bright cold day in April, and the clocks were striking thirteen. Winston Smith, his chin nuzzled "
           "into his breast in an effort to escape the vile wind, slipped quickly through the glass doors of Victory "
           "Mansions, though not quickly enough to prevent a swirl of gritty dust from entering along with him.")
PROMPTS = [f"Text: {PASSAGE}\n\nThe same text again, word for word: It was a bright", "The three primary colors are"]
NEW = 40


def generate(listen: str, prompt: str) -> list[int]:
    with grpc.insecure_channel(listen) as ch:
        return [t for m in generate_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
            prompt=prompt, sampling=pb.SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)),
            timeout=RPC_TIMEOUT) for t in m.token_ids]


def served(*extra: str) -> tuple[list[list[int]], str]:
    """Each prompt's greedy tokens from an `up` of the default model with `extra` flags, and its /metrics text."""
    listen, metrics = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    proc = up(str(resolve_model(DEFAULT_MODEL)), listen, "--dtype", "float32", "--kv-memory", "64MiB",
              "--metrics", metrics, *extra)
    try:
        assert wait_healthy(listen, 300, [proc])
        return [generate(listen, p) for p in PROMPTS], scrape(metrics)
    finally:
        stop_all(proc)


@pytest.mark.slow
def test_up_with_ngram_speculation_gives_the_plain_greedy_tokens_and_counts_its_drafts():
    plain, plain_metrics = served()
    fast, text = served("--speculative", "ngram", "--num-speculative-tokens", "4")
    assert fast == plain
    drafted = metric_value(text, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric_value(text, "vllm:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= drafted and metric_value(text, "vllm:spec_decode_num_drafts_total") > 0
    assert metric_value(text, "pagedserve_spec_decode_accepted_tokens_total") == accepted
    per_pos = [metric_value(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(j))
               for j in range(4)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)  # position j needs all before it
    assert "vllm:spec_decode_num_drafts_total" not in plain_metrics.replace("# HELP", "").split("\n# TYPE")[0] or \
        metric_value(plain_metrics, "vllm:spec_decode_num_drafts_total") == 0


def test_a_worker_claiming_more_accepted_drafts_than_it_was_sent_is_lost(tiny_served_model, tmp_path):
    log = tmp_path / "scheduler.log"
    with started_service(tiny_served_model, "--speculative", "ngram", "--routing", "round-robin", log=log) as svc:
        fake = FakeWorker(svc.worker_listen, registration(svc.model_dir))
        try:
            wait_until(lambda: len(_workers(svc.address)) == 2)
            # round-robin: one request on each worker. The fake answers 7 every time, so that [.., 6, 7] recurs
            # in its sequence and the scheduler drafts [8, 5, 6, 7] for it on its second step.
            clients = [Client(svc.address, [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]) for _ in range(2)]
            while True:
                plan = fake.next_plan()
                answer = worker_pb2.StepResult(step_id=plan.step_id)
                for n in plan.new_seqs:
                    if n.num_computed_tokens + n.num_scheduled_tokens == len(n.token_ids):
                        answer.tokens.add(seq_id=n.seq_id, token_id=7)
                lying = False
                for r in plan.running:
                    t = answer.tokens.add(seq_id=r.seq_id, token_id=7)
                    if r.draft_token_ids:
                        assert list(r.draft_token_ids) == [8, 5, 6, 7] and r.num_scheduled_tokens == 5
                        t.num_accepted_drafts, lying = 5, True  # one more than it was sent
                fake.send(answer)
                if lying:
                    break
            assert fake.ended() == (grpc.StatusCode.OK, "")  # the scheduler closed the fake worker's stream
        finally:
            fake.close()
        assert [len(c.result()) for c in clients] == [8, 8]  # the lied-about request finished on the real worker
        assert svc.metric("pagedserve_workers_lost_total", reason="bad_result") == 1
        assert "num_accepted_drafts 5 of seq" in log.read_text() and "which drafted 4 tokens" in log.read_text()


class Client:
    """One greedy request of 8 tokens in a thread."""

    def __init__(self, address: str, prompt: list[int]) -> None:
        self.tokens: list[int] = []
        self.thread = threading.Thread(target=self._run, args=(address, prompt))
        self.thread.start()

    def _run(self, address: str, prompt: list[int]) -> None:
        with grpc.insecure_channel(address) as ch:
            for m in generate_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
                    prompt_token_ids=prompt, sampling=pb.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)),
                    timeout=RPC_TIMEOUT):
                self.tokens.extend(m.token_ids)

    def result(self) -> list[int]:
        self.thread.join(RPC_TIMEOUT)
        return self.tokens


def _workers(listen: str) -> list:
    with grpc.insecure_channel(listen) as ch:
        return list(generate_pb2_grpc.GenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=60).workers)
