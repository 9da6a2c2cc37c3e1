"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) with the official `anthropic` SDK and
litellm's anthropic provider: against real processes (a scheduler with an API key file and a worker), every answer
compared with the chat route's for the same conversation; tool calls against a scripted worker in this process."""

from __future__ import annotations

import collections
import json
import socket
import subprocess
import sys

import anthropic
import grpc
import httpx
import openai
import pytest

from pagedserve_common.ports import free_port
from tests.support.service import EXACT, KV_MEMORY, MAX_BATCHED, Service, recv_until, stop_processes, wait_until
from tests.support.inproc import EOS, HERMES, Front, Speaker, tokenizer, wait_for, with_server

KEY = "messages-test-key-0123456789abcdef"
WRONG_KEY = "messages-test-key-wrong"
SYSTEM = "You answer in one short sentence."
CONVERSATION = [{"role": "user", "content": "Name a city in France."},
                {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": [{"type": "text", "text": "And one "}, {"type": "text", "text": "more?"}]}]
# the same conversation as the chat route takes it (text blocks joined, as its text parts are)
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a city in France."},
        {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And one more?"}]


class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                           "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


class _WithKey(grpc.UnaryUnaryClientInterceptor):
    """Sends the API key with every unary call (Service's GetKVState and GetModelInfo)."""

    def intercept_unary_unary(self, continuation, details, request):
        metadata = [*(details.metadata or ()), ("authorization", f"Bearer {KEY}")]
        return continuation(_CallDetails(details.method, details.timeout, metadata, details.credentials,
                                         details.wait_for_ready, details.compression), request)


class Keyed(Service):
    def channel(self) -> grpc.Channel:
        return grpc.intercept_channel(grpc.insecure_channel(self.address), _WithKey())


@pytest.fixture(scope="module")
def keyed(tiny_served_model, tmp_path_factory):
    """A scheduler with an API key file (an Anthropic client always sends a key) and one worker."""
    from pagedserve_cli.up_cmd import wait_healthy

    d = tmp_path_factory.mktemp("messages")
    (d / "keys").write_text(f"{KEY} anthropic-tenant\n")
    listen, worker_listen, metrics, http = (f"127.0.0.1:{free_port()}" for _ in range(4))
    exe = [sys.executable, "-m", "pagedserve_cli.main"]
    with open(d / "scheduler.log", "wb") as err:
        sched = subprocess.Popen([*exe, "scheduler", "--model", tiny_served_model, "--listen", listen,
                                  "--worker-listen", worker_listen, "--metrics", metrics, "--http", http,
                                  "--max-num-batched-tokens", str(MAX_BATCHED), "--api-key-file", str(d / "keys")],
                                 stderr=err)
    worker = subprocess.Popen([*exe, "worker", "--scheduler", worker_listen, "--model", tiny_served_model,
                               "--kv-memory", str(KV_MEMORY), "--threads", "1", *EXACT])
    procs = [worker, sched]
    try:
        wait_healthy(listen, 120, procs, metadata=(("authorization", f"Bearer {KEY}"),))
        yield Keyed(tiny_served_model, listen, metrics, procs, http, worker_listen, log=d / "scheduler.log")
    finally:
        stop_processes(procs)


@pytest.fixture(scope="module")
def claude(keyed):
    with anthropic.Anthropic(base_url=f"http://{keyed.http}", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def chat(keyed):
    with openai.OpenAI(base_url=f"http://{keyed.http}/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


def shape(message) -> dict:
    """What a message says, as plain data: its blocks, why it stopped, its tokens (the prompt's: uncached and
    cached together; the prefix cache makes the split differ between two requests of one prompt)."""
    blocks = [(b.type, b.text) if b.type == "text" else (b.type, b.name, b.input) for b in message.content]
    usage = message.usage
    return {"content": blocks, "stop_reason": message.stop_reason, "stop_sequence": message.stop_sequence,
            "prompt_tokens": usage.input_tokens + (usage.cache_read_input_tokens or 0),
            "output_tokens": usage.output_tokens}


def chat_reference(keyed, chat, **fields) -> tuple[str, str, object]:
    """(text, finish reason, usage) of the chat route's greedy answer to CHAT."""
    out = chat.chat.completions.create(model=keyed.model_dir, messages=CHAT, temperature=0, **fields)
    return out.choices[0].message.content, out.choices[0].finish_reason, out.usage


# NOTE: this SDK no longer takes temperature (nor top_p, top_k) as arguments; the API does (litellm sends it)
GREEDY = {"temperature": 0}


def create(keyed, claude, **fields):
    return claude.messages.create(model=keyed.model_dir, system=SYSTEM, messages=CONVERSATION, extra_body=GREEDY,
                                  **fields)


def test_create_greedy_equals_the_chat_route(keyed, claude, chat):
    text, reason, usage = chat_reference(keyed, chat, max_tokens=12)
    assert text, "the tiny model's greedy answer is some text (else this compares nothing)"
    served = keyed.metric("pagedserve_tenant_ttft_seconds_count", tenant="anthropic-tenant")
    message = create(keyed, claude, max_tokens=12)
    # the key's name is the request's tenant, as on the chat route
    assert keyed.metric("pagedserve_tenant_ttft_seconds_count", tenant="anthropic-tenant") == served + 1
    assert message.id.startswith("msg_") and (message.type, message.role) == ("message", "assistant")
    assert message.model == keyed.model_dir
    want_reason = {"length": "max_tokens", "stop": "end_turn"}[reason]
    assert shape(message) == {"content": [("text", text)] if text else [], "stop_reason": want_reason,
                              "stop_sequence": None, "prompt_tokens": usage.prompt_tokens,
                              "output_tokens": usage.completion_tokens}
    assert message.usage.cache_creation_input_tokens == 0


def test_a_last_assistant_message_is_continued_as_a_prefill(keyed, claude, chat):
    """Anthropic's prefill: the answer continues the last assistant message's text (the chat route's
    continue_final_message), and holds the continuation alone."""
    prefill = "Lyon, and"
    messages = [*CONVERSATION, {"role": "assistant", "content": prefill}]
    want = chat.chat.completions.create(model=keyed.model_dir, messages=[*CHAT, messages[-1]], temperature=0,
                                        max_tokens=6, extra_body={"add_generation_prompt": False,
                                                                  "continue_final_message": True})
    message = claude.messages.create(model=keyed.model_dir, system=SYSTEM, messages=messages, max_tokens=6,
                                     extra_body=GREEDY)
    assert [b.text for b in message.content] == [want.choices[0].message.content]
    assert message.usage.output_tokens == want.usage.completion_tokens
    opened = create(keyed, claude, max_tokens=6)  # a new turn: another prompt
    counted = claude.messages.count_tokens(model=keyed.model_dir, system=SYSTEM, messages=messages)
    assert counted.input_tokens == want.usage.prompt_tokens != opened.usage.input_tokens + (
        opened.usage.cache_read_input_tokens or 0)


def test_max_tokens_gives_stop_reason_max_tokens(keyed, claude, chat):
    text, reason, _ = chat_reference(keyed, chat, max_tokens=3, extra_body={"ignore_eos": True})
    message = create(keyed, claude, max_tokens=3)
    assert reason == "length" and message.usage.output_tokens == 3
    assert (message.stop_reason, message.content[0].text) == ("max_tokens", text)


def test_a_stop_sequence_ends_the_text_before_it_and_is_named(keyed, claude, chat):
    full = create(keyed, claude, max_tokens=16).content[0].text
    stop = full[4:7]  # NOTE: greedy: the same text again, cut where `stop` first occurs
    assert stop.strip(), full
    want, reason, _ = chat_reference(keyed, chat, max_tokens=16, stop=[stop, "never-said-0x"])
    assert reason == "stop" and want == full[:full.index(stop)]
    message = create(keyed, claude, max_tokens=16, stop_sequences=["never-said-0x", stop])
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert [b.text for b in message.content] == ([want] if want else [])
    with claude.messages.stream(model=keyed.model_dir, system=SYSTEM, messages=CONVERSATION, extra_body=GREEDY,
                                max_tokens=16, stop_sequences=["never-said-0x", stop]) as stream:
        assert shape(stream.get_final_message()) == shape(message)


def test_a_stream_says_anthropics_events_and_ends_as_the_whole_message(keyed, claude):
    whole = create(keyed, claude, max_tokens=10)
    events = list(create(keyed, claude, max_tokens=10, stream=True))
    kinds = [e.type for e in events]
    num_deltas = kinds.count("content_block_delta")
    # NOTE: the SDK passes on every event but ping (test_the_wire_format_is_named_events_without_done sees it)
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * num_deltas,
                     "content_block_stop", "message_delta", "message_stop"], kinds
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == whole.content[0].text
    assert events[0].message.id.startswith("msg_") and events[0].message.content == []
    assert (events[-2].delta.stop_reason, events[-2].usage.output_tokens) == ("max_tokens", 10)
    with claude.messages.stream(model=keyed.model_dir, system=SYSTEM, messages=CONVERSATION, extra_body=GREEDY,
                                max_tokens=10) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text and shape(final) == shape(whole)


def test_the_wire_format_is_named_events_without_done(keyed, claude):
    body = {"model": keyed.model_dir, "max_tokens": 4, "temperature": 0, "stream": True, "messages": CONVERSATION}
    with httpx.stream("POST", f"http://{keyed.http}/v1/messages", json=body, headers={"x-api-key": KEY},
                      timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [chunk.split("\n") for chunk in raw.strip().split("\n\n")]
    assert all(len(e) == 2 and e[0].startswith("event: ") and e[1].startswith("data: ") for e in events), raw
    assert all(e[0][len("event: "):] == json.loads(e[1][len("data: "):])["type"] for e in events)
    names = [e[0][len("event: "):] for e in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-1] == "message_stop", names
    assert "[DONE]" not in raw


def test_count_tokens_is_the_prompt_the_answer_was_given(keyed, claude, chat):
    counted = claude.messages.count_tokens(model=keyed.model_dir, system=SYSTEM, messages=CONVERSATION)
    message = create(keyed, claude, max_tokens=2)
    _, _, usage = chat_reference(keyed, chat, max_tokens=2)
    assert counted.input_tokens == shape(message)["prompt_tokens"] == usage.prompt_tokens
    # with tools: the tools reach the chat template (this one renders none), whatever tool_choice
    tools = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    with_tools = claude.messages.count_tokens(model=keyed.model_dir, system=SYSTEM, messages=CONVERSATION,
                                              tools=tools)
    assert with_tools.input_tokens == counted.input_tokens


def test_tool_choice_auto_without_a_tool_call_parser_is_a_400(keyed, claude):
    tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    with pytest.raises(anthropic.BadRequestError) as e:
        create(keyed, claude, max_tokens=4, tools=tools)
    assert "--tool-call-parser" in e.value.body["error"]["message"]


@pytest.mark.parametrize("fields, named", [
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"mcp_servers": [{"type": "url", "url": "https://example.com", "name": "x"}]}, "mcp_servers"),
    ({"frobnicate": 1}, "frobnicate: unknown field"),
    ({"top_logprobs": 2}, "top_logprobs: unknown field"),  # the chat route's, not Anthropic's
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]}, "'image' is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "citations": [{"x": 1}]}]}]},
     "messages[0].content[0].citations is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "colour": "red"}]}]},
     "messages[0].content[0].colour: unknown field"),
    ({"messages": [*CONVERSATION, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]}]}, "a prefill"),
])
def test_a_refused_or_unknown_field_is_a_400_in_anthropics_shape_naming_it(keyed, claude, fields, named):
    fields = dict(fields)
    messages = fields.pop("messages", CONVERSATION)
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=keyed.model_dir, max_tokens=4, messages=messages, extra_body=fields or None)
    assert e.value.status_code == 400 and e.value.body["type"] == "error", e.value.body
    assert e.value.body["error"]["type"] == "invalid_request_error" and named in e.value.body["error"]["message"]
    # and the server serves on: the same request without the field
    assert create(keyed, claude, max_tokens=2).usage.output_tokens <= 2


def test_ignored_fields_are_accepted(keyed, claude):
    cached = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    message = claude.messages.create(model=keyed.model_dir, system=cached, messages=CONVERSATION, max_tokens=6,
                                     metadata={"user_id": "u-1"}, service_tier="standard_only", speed="standard",
                                     cache_control={"type": "ephemeral"}, inference_geo="eu", extra_body=GREEDY)
    assert shape(message) == shape(create(keyed, claude, max_tokens=6))


@pytest.mark.parametrize("body, status, kind, says", [
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error", "max_tokens: Field required"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "hi"}]}, 400, "invalid_request_error",
     "messages.0.role"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "model": "claude-sonnet-4-5"}, 404,
     "not_found_error", "claude-sonnet-4-5"),
])
def test_invalid_bodies_are_answered_in_anthropics_shape(keyed, body, status, kind, says):
    r = httpx.post(f"http://{keyed.http}/v1/messages", json={"model": keyed.model_dir, **body},
                   headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == status and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == kind and says in r.json()["error"]["message"], r.text
    r = httpx.post(f"http://{keyed.http}/v1/messages", content=b"{not json", headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_the_servers_own_refusals_are_in_anthropics_shape_on_its_paths(keyed, claude):
    """404 (a route under /v1/messages that is not served), 405 (a wrong method), 413 (a body over
    --max-message-size, refused before it is parsed): Anthropic's shape there, OpenAI's elsewhere."""
    from pagedserve_common.config import MAX_MESSAGE_SIZE

    with pytest.raises(anthropic.NotFoundError) as e:  # the SDK's batches API: POST /v1/messages/batches
        claude.messages.batches.create(requests=[])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    assert "POST /v1/messages/count_tokens" in e.value.body["error"]["message"]  # what is served
    r = httpx.get(f"http://{keyed.http}/v1/messages", headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 405 and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    huge = {"model": keyed.model_dir, "max_tokens": 1, "messages": [{"role": "user", "content": "x" * MAX_MESSAGE_SIZE}]}
    for path in ("/v1/messages", "/v1/chat/completions"):
        r = httpx.post(f"http://{keyed.http}{path}", json=huge, headers={"x-api-key": KEY}, timeout=60)
        assert r.status_code == 413 and "--max-message-size" in r.text, r.text
        assert ("type" in r.json()) == (path == "/v1/messages"), r.text  # Anthropic's top-level "type": "error"
    assert shape(create(keyed, claude, max_tokens=2))["output_tokens"] == 2  # still serving


def test_the_key_as_x_api_key_or_bearer_and_a_bad_key_is_a_401_in_anthropics_shape(keyed, claude):
    want = shape(create(keyed, claude, max_tokens=3))["content"]
    with anthropic.Anthropic(base_url=f"http://{keyed.http}", auth_token=KEY, api_key=None, max_retries=0) as c:
        assert shape(create(keyed, c, max_tokens=3))["content"] == want  # authorization: Bearer KEY
    with anthropic.Anthropic(base_url=f"http://{keyed.http}", api_key=WRONG_KEY, max_retries=0) as c:
        for call in (lambda: create(keyed, c, max_tokens=3),
                     lambda: c.messages.count_tokens(model=keyed.model_dir, messages=CONVERSATION)):
            with pytest.raises(anthropic.AuthenticationError) as e:
                call()
            assert e.value.status_code == 401 and e.value.body["type"] == "error"
            assert e.value.body["error"] == {"type": "authentication_error", "message": "invalid API key"}
    r = httpx.post(f"http://{keyed.http}/v1/chat/completions", json={"messages": CHAT}, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"  # OpenAI's shape there


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_blocks(keyed, claude, stream):
    """As the chat route's test (tests/http/test_app.py): the worker paused, so that the request still holds
    its blocks when its client goes away; the scheduler's state is polled."""
    body = json.dumps({"model": keyed.model_dir, "max_tokens": 400, "messages": CONVERSATION,
                       "stream": stream}).encode()
    host, port = keyed.http.rsplit(":", 1)
    with keyed.worker_paused():
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            sock.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nx-api-key: %s"
                         b"\r\nContent-Length: %d\r\n\r\n%s" % (keyed.http.encode(), KEY.encode(), len(body), body))
            wait_until(lambda: len(keyed.live_request_ids()) == 1)  # admitted: holds blocks, a step in flight
            if stream:  # the event stream is open: its headers (and message_start) came before any token
                head = recv_until(sock, b"event: ping")
                assert head.startswith(b"HTTP/1.1 200") and b"event: message_start" in head
        wait_until(lambda: keyed.live_request_ids() == [])  # the disconnect aborted it; its blocks are free
    assert create(keyed, claude, max_tokens=2).usage.output_tokens <= 2  # and the worker, resumed, serves on


def test_litellms_anthropic_provider_gets_the_chat_routes_text(keyed, chat):
    import litellm

    text, _, usage = chat_reference(keyed, chat, max_tokens=8)
    out = litellm.completion(model=f"anthropic/{keyed.model_dir}", messages=CHAT, max_tokens=8, temperature=0,
                             api_base=f"http://{keyed.http}", api_key=KEY, num_retries=0)
    assert out.choices[0].message.content == text
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (usage.prompt_tokens, usage.completion_tokens)


# -- tool calls: a scripted worker says a Hermes tool call ------------------------------------------------------
WEATHER = {"name": "get_weather", "description": "the weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def async_claude(front: Front) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=f"http://{front.http.address}", api_key="unused", max_retries=0,
                                    timeout=60)


async def both(claude: anthropic.AsyncAnthropic, **request):
    """(the whole message, the streamed one as the SDK folds it) of one request."""
    whole = await claude.messages.create(model="m", max_tokens=100, **request)
    async with claude.messages.stream(model="m", max_tokens=100, **request) as stream:
        streamed = await stream.get_final_message()
    return whole, streamed


@with_server(eos_token_ids=(EOS,), max_num_seqs=2)
async def test_a_tool_round_trip_tool_use_out_and_tool_result_in(engine, channel):
    speaker = Speaker(channel, HERMES)
    await wait_for(lambda: engine.workers)
    front = Front(engine, tool_call_parser="hermes")
    async with front as http, async_claude(front) as claude:
        for message in await both(claude, messages=ASK, tools=[WEATHER]):
            assert message.stop_reason == "tool_use" and message.content[0].text == "I will look it up."
            calls = [(b.name, b.input) for b in message.content[1:]]
            assert calls == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lyon"})]
            assert all(b.type == "tool_use" and b.id.startswith("toolu_") for b in message.content[1:])
        one = await claude.messages.create(model="m", max_tokens=100, messages=ASK, tools=[WEATHER],
                                           tool_choice={"type": "auto", "disable_parallel_tool_use": True})
        assert [(b.type, getattr(b, "input", None)) for b in one.content][1:] == [("tool_use", {"city": "Paris"})]
        # the call's result back: the prompt is the chat route's for the same history, token for token
        call = one.content[1]
        answer = [*ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in one.content]},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "18 C"}]},
                      {"type": "text", "text": "Warm?"}]}]
        counted = await claude.messages.count_tokens(model="m", system="Be brief.", messages=answer, tools=[WEATHER])
        before = len(speaker.plans)
        await claude.messages.create(model="m", max_tokens=4, system="Be brief.", messages=answer, tools=[WEATHER])
        history = [{"role": "system", "content": "Be brief."}, *ASK,
                   {"role": "assistant", "content": "I will look it up.", "tool_calls": [
                       {"id": call.id, "type": "function",
                        "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
                   {"role": "tool", "tool_call_id": call.id, "content": "18 C"},
                   {"role": "user", "content": "Warm?"}]
        openai_tool = {"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                        "parameters": WEATHER["input_schema"]}}
        r = await http.post("/v1/chat/completions", json={"model": "m", "messages": history, "max_tokens": 4,
                                                          "tools": [openai_tool]})
        assert r.status_code == 200, r.text
        prompts = [list(n.token_ids) for p in speaker.plans[before:] for n in p.new_seqs]
        assert len(prompts) == 2 and prompts[0] == prompts[1] and counted.input_tokens == len(prompts[0])
        rendered = tokenizer().decode(prompts[0], skip_special_tokens=False)
        assert "<|im_start|>tool\n18 C<|im_end|>" in rendered and '"arguments": {"city": "Paris"}' in rendered


def test_tool_use_and_tool_result_blocks_become_the_chat_routes_messages():
    from scheduler_svc.http.messages_api import chat_request
    from scheduler_svc.http.messages_schemas import MessagesRequest

    calls = [{"type": "tool_use", "id": f"toolu_{i}", "name": "get_weather", "input": {"city": city}}
             for i, city in enumerate(("Paris", "Lyon"))]
    results = [{"type": "tool_result", "tool_use_id": "toolu_0", "content": "18 C"},
               {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True},
               {"type": "text", "text": "Warm"}, {"type": "text", "text": "er?"}]
    choice = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    body = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "S"}], "tools": [WEATHER],
        "tool_choice": choice, "messages": [*ASK, {"role": "assistant", "content": calls},
                                            {"role": "user", "content": results}]})
    chat = chat_request(body, "none")
    as_calls = [{"id": c["id"], "type": "function",
                 "function": {"name": "get_weather", "arguments": json.dumps(c["input"])}} for c in calls]
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "S"}, *ASK, {"role": "assistant", "tool_calls": as_calls},
        {"role": "tool", "content": "18 C", "tool_call_id": "toolu_0"},
        {"role": "tool", "content": "", "tool_call_id": "toolu_1", "is_error": True},
        {"role": "user", "content": "Warmer?"}]
    assert (chat.tool_choice, chat.parallel_tool_calls) == ({"type": "function", "function": {"name": "get_weather"}},
                                                            False)
    assert (chat.max_tokens, chat.stop, chat.include_stop_str_in_output) == (5, None, True)


@with_server(eos_token_ids=(EOS,))
async def test_tool_choice_any_and_a_named_tool_are_tool_use_blocks(engine, channel):
    # NOTE: compact JSON, as the constraint's grammar allows it (tool choice any: an array of calls)
    speaker = Speaker(channel, '[{"name":"get_weather","arguments":{"city":"Rome"}}]')
    await wait_for(lambda: engine.workers)
    front = Front(engine)
    async with front, async_claude(front) as claude:
        for message in await both(claude, messages=ASK, tools=[WEATHER], tool_choice={"type": "any"}):
            assert message.stop_reason == "tool_use"
            assert [(b.type, b.name, b.input) for b in message.content] == [("tool_use", "get_weather",
                                                                            {"city": "Rome"})]
        speaker.script = [*tokenizer().encode('{"city":"Oslo"}', add_special_tokens=False), EOS]
        named = {"type": "tool", "name": "get_weather"}
        events = [e async for e in await claude.messages.create(model="m", max_tokens=100, messages=ASK,
                                                                  tools=[WEATHER], tool_choice=named, stream=True)]
        parts = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
        assert len(parts) > 2 and json.loads("".join(parts)) == {"city": "Oslo"}  # streamed as it comes
        for message in await both(claude, messages=ASK, tools=[WEATHER], tool_choice=named):
            assert message.stop_reason == "tool_use"
            assert [(b.type, b.name, b.input) for b in message.content] == [("tool_use", "get_weather",
                                                                            {"city": "Oslo"})]
