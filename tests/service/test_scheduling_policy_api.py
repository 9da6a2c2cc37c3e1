"""--scheduling-policy through the client APIs: the priority field and the tenant header, on a real gRPC server and
its HTTP front, with a scripted worker over the real Attach stream."""

from __future__ import annotations

import grpc

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from scheduler_svc.auth import ApiKeys
from scheduler_svc.identity import GATEWAY, MIN_PRIORITY, OPERATOR, Identity
from tests.support.inproc import Front, ScriptedWorker, status_of, tokens_of, wait_for, with_server


def generate(channel, ids, priority: int = 0, metadata=(), max_tokens: int = 2):
    return generate_pb2_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
        prompt_token_ids=ids, priority=priority,
        sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)), metadata=metadata)


@with_server(scheduling_policy="priority", max_num_seqs=1, max_queued_requests=8)
async def test_priority_admits_the_lower_value_first_and_preempts_for_it(engine, channel):
    worker = ScriptedWorker(channel)
    await wait_for(lambda: engine.workers)
    busy = generate(channel, [1, 2, 3])
    await wait_for(lambda: worker.plans)  # busy holds the one sequence slot; its step is unanswered
    low = generate(channel, [4, 5, 6], priority=5)
    high = generate(channel, [7, 8, 9], priority=-1)
    await wait_for(lambda: engine.num_unfinished == 3)
    worker.answer = True
    worker.reply(worker.plans[-1])
    for call in (busy, low, high):
        assert await tokens_of(call) == [[7, 7]]
    # high (-1) outranks busy (0), which has the one slot: busy is preempted in the next step, recomputed after
    # high, before low (5); its client still gets every token
    admitted = [list(n.token_ids[:3]) for p in worker.plans for n in p.new_seqs]
    assert admitted == [[1, 2, 3], [7, 8, 9], [1, 2, 3], [4, 5, 6]]
    assert [list(p.preempted_seq_ids) for p in worker.plans if p.preempted_seq_ids] == \
        [[worker.plans[0].new_seqs[0].seq_id]]


@with_server()
async def test_priority_under_fcfs_is_refused_by_name(engine, channel):
    ScriptedWorker(channel, answer=True)
    await wait_for(lambda: engine.workers)
    code, details = await status_of(generate(channel, [1, 2], priority=1))
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("priority 1 needs --scheduling-policy priority (this server admits by fcfs)")
    assert await tokens_of(generate(channel, [1, 2], priority=0)) == [[7, 7]]  # 0 is the default: served
    async with Front(engine) as http:
        r = await http.post("/v1/completions", json={"model": "m", "prompt": [1, 2], "max_tokens": 1, "priority": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
        r = await http.post("/v1/completions", json={"model": "m", "prompt": [1, 2], "max_tokens": 1,
                                                     "priority": 0})
        assert r.status_code == 200, r.text


@with_server(scheduling_policy="priority", max_queued_requests=8)
async def test_priority_out_of_32_bits_is_refused_over_http(engine, channel):
    ScriptedWorker(channel, answer=True)
    await wait_for(lambda: engine.workers)
    async with Front(engine) as http:
        r = await http.post("/v1/completions", json={"model": "m", "prompt": [1, 2], "max_tokens": 1,
                                                     "priority": 2**31})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
        r = await http.post("/v1/completions", json={"model": "m", "prompt": [1, 2], "max_tokens": 1,
                                                     "priority": -3})
        assert r.status_code == 200, r.text


@with_server(scheduling_policy="fair", max_queued_requests=8)
async def test_the_tenant_header_and_metadata_name_whose_service_a_request_counts_for(engine, channel):
    ScriptedWorker(channel, answer=True)
    await wait_for(lambda: engine.workers)
    # 3 prompt tokens: 2 counted as prefill (1 each), then the last one's and one decode sample a token (2 each)
    assert await tokens_of(generate(channel, [1, 2, 3], metadata=(("x-pagedserve-tenant", "team-a"),))) == [[7, 7]]
    assert engine.service.service == {"team-a": 6.0}
    async with Front(engine) as http:
        r = await http.post("/v1/completions", headers={"x-pagedserve-tenant": "team b"},
                            json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200, r.text
        r = await http.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 2,
                                                     "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert engine.service.service == {"team-a": 6.0, "team b": 6.0, "": 6.0}  # no header: the shared tenant
        r = await http.post("/v1/completions", headers=[("x-pagedserve-tenant", "a"), ("x-pagedserve-tenant", "b")],
                            json={"model": "m", "prompt": [1, 2], "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-pagedserve-tenant"
        r = await http.post("/v1/completions", headers={"x-pagedserve-tenant": "x" * 129},
                            json={"model": "m", "prompt": [1, 2], "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-pagedserve-tenant"
    code, details = await status_of(generate(channel, [1, 2], metadata=(("x-pagedserve-tenant", "a"),
                                                                        ("x-pagedserve-tenant", "b"))))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "x-pagedserve-tenant is sent 2 times" in details


@with_server(scheduling_policy="fair", max_queued_requests=8)
async def test_per_tenant_service_queue_and_ttft_series(engine, channel):
    from prometheus_client import generate_latest

    ScriptedWorker(channel, answer=True)
    await wait_for(lambda: engine.workers)
    for tenant in ("team-a", "team-b", "team-a"):
        assert await tokens_of(generate(channel, [1, 2, 3], metadata=(("x-pagedserve-tenant", tenant),))) == [[7, 7]]
    text = generate_latest(engine.metrics.registry).decode()
    assert 'pagedserve_tenant_service{tenant="team-a"} 12.0' in text  # 2 requests x (2 prompt + 2 x 2 output)
    assert 'pagedserve_tenant_service{tenant="team-b"} 6.0' in text
    assert 'pagedserve_tenant_requests_waiting{tenant="team-a"} 0.0' in text
    assert 'pagedserve_tenant_ttft_seconds_count{tenant="team-a"} 2.0' in text
    assert 'pagedserve_tenant_ttft_seconds_count{tenant="team-b"} 1.0' in text


NAMED_KEYS = ApiKeys.of(["k-a", "k-a2", "k-free", "k-gw", "k-op"],
                        ["team-a", "team-a", "", Identity("gw", GATEWAY), Identity("ops", OPERATOR, MIN_PRIORITY)])


def bearer(key: str) -> tuple[str, str]:
    return ("authorization", f"Bearer {key}")


@with_server(api_keys=NAMED_KEYS, scheduling_policy="fair", max_queued_requests=8)
async def test_an_api_key_is_its_requests_tenant_and_only_a_gateway_names_another(engine, channel):
    ScriptedWorker(channel, answer=True)
    await wait_for(lambda: engine.workers)
    # two keys of one name count for one tenant; the header may repeat the key's name
    assert await tokens_of(generate(channel, [1, 2, 3], metadata=(bearer("k-a"),))) == [[7, 7]]
    assert await tokens_of(generate(channel, [1, 2, 3], metadata=(bearer("k-a2"),
                                                                  ("x-pagedserve-tenant", "team-a")))) == [[7, 7]]
    # an unnamed key counts for the shared tenant, and names no other (one key, many tenants: a sybil flood)
    assert await tokens_of(generate(channel, [1, 2, 3], metadata=(bearer("k-free"),))) == [[7, 7]]
    code, details = await status_of(generate(channel, [1, 2], metadata=(bearer("k-free"),
                                                                        ("x-pagedserve-tenant", "team-z"))))
    assert code is grpc.StatusCode.PERMISSION_DENIED
    assert details == ("x-pagedserve-tenant: this API key's requests count for its own tenant: leave it out (only a "
                       "key with role=gateway or role=operator names a tenant)")
    # a gateway key names its users' tenants; without the header, its own name
    assert await tokens_of(generate(channel, [1, 2, 3], metadata=(bearer("k-gw"),
                                                                  ("x-pagedserve-tenant", "team-z")))) == [[7, 7]]
    assert await tokens_of(generate(channel, [1, 2, 3], metadata=(bearer("k-gw"),))) == [[7, 7]]
    service = engine.service.service
    assert set(service) == {"team-a", "", "team-z", "gw"}
    assert service["team-a"] == 12.0  # both of team-a's requests (2 prompt tokens at 1 + 2 outputs at 2, each)
    code, details = await status_of(generate(channel, [1, 2], metadata=(bearer("k-a"),
                                                                        ("x-pagedserve-tenant", "team-z"))))
    assert code is grpc.StatusCode.PERMISSION_DENIED
    assert details.startswith("x-pagedserve-tenant: this API key's requests count for its own tenant: send "
                              "'team-a' or leave it out")
    async with Front(engine, api_keys=NAMED_KEYS) as http:
        body = {"model": "m", "prompt": [1, 2], "max_tokens": 2, "ignore_eos": True}
        before = dict(service)
        r = await http.post("/v1/completions", json=body, headers={"authorization": "Bearer k-a"})
        assert r.status_code == 200, r.text
        assert service["team-a"] > before["team-a"] and service[""] == before[""]
        for key in ("k-a", "k-free"):
            r = await http.post("/v1/completions", json=body, headers={"authorization": f"Bearer {key}",
                                                                       "x-pagedserve-tenant": "team-z"})
            assert r.status_code == 403 and r.json()["error"]["param"] == "x-pagedserve-tenant"
            assert r.json()["error"]["type"] == "permission_error"
        before = dict(service)
        r = await http.post("/v1/completions", json=body, headers={"authorization": "Bearer k-op",
                                                                   "x-pagedserve-tenant": "team-z"})
        assert r.status_code == 200, r.text
        assert service["team-z"] > before["team-z"] and service["team-a"] == before["team-a"]
    assert set(service) == {"team-a", "", "team-z", "gw"}
    assert await tokens_of(generate(channel, [1, 2, 3], metadata=(bearer("k-a"),))) == [[7, 7]]  # still serving


@with_server(api_keys=NAMED_KEYS, scheduling_policy="fair", max_num_seqs=2, max_queued_requests=8)
async def test_get_kv_state_names_each_running_sequences_tenant_to_an_operator(engine, channel):
    worker = ScriptedWorker(channel)  # silent: both sequences stay running
    await wait_for(lambda: engine.workers)
    calls = [generate(channel, [1, 2, 3], metadata=(bearer("k-a"),)),
             generate(channel, [4, 5, 6], metadata=(bearer("k-gw"), ("x-pagedserve-tenant", "team z")))]
    await wait_for(lambda: worker.plans and engine.num_unfinished == 2)
    worker.reply(worker.plans[0])  # the first step's answer: the next one admits the other request too
    await wait_for(lambda: engine.workers["worker-0"].scheduler.num_running == 2)
    state = await generate_pb2_grpc.GenerationStub(channel).GetKVState(pb.GetKVStateRequest(),
                                                                      metadata=(bearer("k-op"),))
    assert sorted(s.tenant for s in state.sequences) == ["team z", "team-a"]
    for call in calls:
        call.cancel()


def test_the_engine_bounds_the_tenant_counters(monkeypatch):
    from scheduler_svc import engine as engine_mod

    monkeypatch.setattr(engine_mod, "MAX_TENANT_COUNTERS", 8)

    @with_server(scheduling_policy="fair", max_queued_requests=8)
    async def run(engine, channel):
        ScriptedWorker(channel, answer=True)
        await wait_for(lambda: engine.workers)
        for i in range(8):
            assert await tokens_of(generate(channel, [1, 2, 3], metadata=(("x-pagedserve-tenant", f"t{i}"),))) == \
                [[7, 7]]
        assert len(engine.service.service) == 8
        # a 9th tenant: the counters are pruned to half first (the idle ones, the least served first)
        assert await tokens_of(generate(channel, [1, 2, 3], metadata=(("x-pagedserve-tenant", "new"),))) == [[7, 7]]
        assert len(engine.service.service) == 5 and "new" in engine.service.service

    run()
