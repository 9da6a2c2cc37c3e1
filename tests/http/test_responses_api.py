"""OpenAI's Responses API (/v1/responses, stateless) against real processes (a scheduler and a worker over the tiny
model): the official `openai` client (create, streamed and not, and its stream helper), LangChain's ChatOpenAI with
use_responses_api and litellm, every text compared with the chat route's greedy answer to the same conversation;
function calls and text.format through structured output; the fields it refuses, by name. In this process, against
scripted workers: an engine error mid-stream, and text with parsed (Hermes) calls."""

from __future__ import annotations

import asyncio
import json
import os
import typing

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import ValidationError

from tests.support.inproc import EOS, HERMES, Front, ScriptedWorker, Speaker, wait_for, with_server
from tests.support.service import assert_idle_and_serving, no_error_logged

CONVERSATION = [{"role": "user", "content": "Name a city in France."},
                {"role": "assistant", "content": [{"type": "output_text", "text": "Paris."}]},
                {"role": "user", "content": [{"type": "input_text", "text": "And one "},
                                             {"type": "input_text", "text": "more?"}]}]
# the same conversation as the chat route takes it (text parts joined)
CHAT = [{"role": "user", "content": "Name a city in France."}, {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And one more?"}]
MAX = 8  # tokens: the tiny model never says EOS this soon, so its texts end at max_output_tokens (incomplete)
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
          "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": PARAMS,
           "strict": True}
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                 "parameters": PARAMS, "strict": True}}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]


def chat_text(service, client, messages: list[dict], max_tokens: int = MAX, **fields):
    """(text, finish reason, usage) of the chat route's greedy answer: the reference."""
    out = client.chat.completions.create(model=service.model_dir, messages=messages, max_tokens=max_tokens,
                                         temperature=0, **fields)
    return out.choices[0].message.content, out.choices[0].finish_reason, out.usage


def create(service, client, **fields):
    return client.responses.create(model=service.model_dir, temperature=0, **{"max_output_tokens": MAX, **fields})


def streamed(service, client, **fields) -> list:
    """Every event of a streamed response, numbered 0, 1, ... in order."""
    events = list(create(service, client, stream=True, **fields))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    return events


def text_of(events: list) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def test_greedy_text_equals_the_chat_routes_streamed_and_not(service, client):
    text, reason, usage = chat_text(service, client, CHAT)
    assert reason == "length"
    whole = create(service, client, input=CONVERSATION)
    assert whole.output_text == text and whole.id.startswith("resp_") and whole.object == "response"
    [message] = whole.output
    assert (message.type, message.role, message.id[:4], [c.type for c in message.content]) == (
        "message", "assistant", "msg_", ["output_text"])
    assert (whole.status, whole.incomplete_details.reason, message.status) == ("incomplete", "max_output_tokens",
                                                                              "incomplete")
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (usage.prompt_tokens, MAX)
    assert whole.usage.total_tokens == usage.prompt_tokens + MAX
    events = streamed(service, client, input=CONVERSATION)
    assert text_of(events) == text and events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == text and events[-1].response.usage.output_tokens == MAX
    assert [e.type for e in events[2:4]] == ["response.output_item.added", "response.content_part.added"]
    assert [e.type for e in events[-4:]] == ["response.output_text.done", "response.content_part.done",
                                             "response.output_item.done", "response.incomplete"]
    assert events[-4].text == text and events[-3].part.text == text and events[-2].item.status == "incomplete"
    assert {e.type for e in events[4:-4]} == {"response.output_text.delta"}
    # a string input is one user message
    one = create(service, client, input="Name a city in France.")
    assert one.output_text == chat_text(service, client, CHAT[:1])[0]


def test_the_clients_stream_helper_folds_the_events_into_the_whole_response(service, client):
    """The helper needs response.completed: a structured answer, which ends by itself."""
    fmt = {"type": "json_schema", "name": "weather", "schema": PARAMS, "strict": True}
    whole = create(service, client, input=ASK, text={"format": fmt}, max_output_tokens=100)
    assert whole.status == "completed" and whole.incomplete_details is None
    with client.responses.stream(model=service.model_dir, input=ASK, temperature=0, max_output_tokens=100,
                                 text={"format": fmt}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and final.status == "completed"
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]


def test_instructions_are_a_system_message_first(service, client):
    instructions = "You are a pirate. Answer briefly."
    text, _, _ = chat_text(service, client, [{"role": "system", "content": instructions}, *CHAT])
    out = create(service, client, instructions=instructions, input=CONVERSATION)
    assert out.output_text == text and out.instructions == instructions
    assert text_of(streamed(service, client, instructions=instructions, input=CONVERSATION)) == text
    # a system (or developer) message item says the same
    as_item = create(service, client, input=[{"role": "system", "content": instructions}, *CONVERSATION])
    assert as_item.output_text == text


def test_max_output_tokens_ends_an_incomplete_response(service, client):
    text, reason, _ = chat_text(service, client, CHAT, max_tokens=3)
    out = create(service, client, input=CONVERSATION, max_output_tokens=3)
    assert (out.output_text, out.status, out.incomplete_details.reason) == (text, "incomplete", "max_output_tokens")
    assert out.usage.output_tokens == 3 and out.max_output_tokens == 3
    last = streamed(service, client, input=CONVERSATION, max_output_tokens=3)[-1]
    assert (last.type, last.response.status, last.response.incomplete_details.reason) == (
        "response.incomplete", "incomplete", "max_output_tokens")


def calls_of(output) -> list[tuple[str, str]]:
    assert all(item.type == "function_call" and item.call_id.startswith("call_") and item.id.startswith("fc_")
               for item in output), output
    return [(item.name, item.arguments) for item in output]


def test_a_function_call_round_trip(service, client):
    named = {"type": "function", "name": "get_weather"}
    ref = client.chat.completions.create(model=service.model_dir, messages=ASK, tools=[CHAT_WEATHER], temperature=0,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                         max_tokens=100).choices[0].message.tool_calls
    out = create(service, client, input=ASK, tools=[WEATHER], tool_choice=named, max_output_tokens=100)
    assert out.status == "completed" and calls_of(out.output) == [("get_weather", ref[0].function.arguments)]
    jsonschema.validate(json.loads(out.output[0].arguments), PARAMS)
    assert out.tools[0].name == "get_weather" and out.tool_choice.name == "get_weather"
    # streamed: the call's item, its arguments' deltas, then the whole
    events = streamed(service, client, input=ASK, tools=[WEATHER], tool_choice=named, max_output_tokens=100)
    added = [e.item for e in events if e.type == "response.output_item.added"]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [args_done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(a.type, a.name, a.arguments) for a in added] == [("function_call", "get_weather", "")]
    assert "".join(deltas) == args_done.arguments == out.output[0].arguments and len(deltas) > 1
    assert events[-1].type == "response.completed" and calls_of(events[-1].response.output) == calls_of(out.output)
    # the second turn: the call (the output item as the client returned it) and its output
    result = "18 degrees and sunny"
    history = [*ASK, *out.output, {"type": "function_call_output", "call_id": out.output[0].call_id, "output": result}]
    chat_history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": out.output[0].call_id, "type": "function",
         "function": {"name": "get_weather", "arguments": out.output[0].arguments}}]},
                    {"role": "tool", "tool_call_id": out.output[0].call_id, "content": result}]
    text, _, _ = chat_text(service, client, chat_history, tools=[CHAT_WEATHER], tool_choice="none")
    answer = create(service, client, input=history, tools=[WEATHER], tool_choice="none")
    assert answer.output_text == text and answer.output[0].type == "message"


def test_tool_choice_required_gives_the_chat_routes_calls(service, client):
    ref = client.chat.completions.create(model=service.model_dir, messages=ASK, tools=[CHAT_WEATHER], temperature=0,
                                         tool_choice="required", max_tokens=200).choices[0].message.tool_calls
    out = create(service, client, input=ASK, tools=[WEATHER], tool_choice="required", max_output_tokens=200)
    assert calls_of(out.output) == [(c.function.name, c.function.arguments) for c in ref]
    assert len({item.call_id for item in out.output}) == len(out.output)


def test_text_format_json_schema_validates_and_equals_response_format(service, client):
    fmt = {"type": "json_schema", "name": "weather", "schema": PARAMS, "strict": True}
    text, reason, _ = chat_text(service, client, ASK, max_tokens=100, response_format={
        "type": "json_schema", "json_schema": {"name": "weather", "schema": PARAMS, "strict": True}})
    out = create(service, client, input=ASK, text={"format": fmt}, max_output_tokens=100)
    assert (out.output_text, out.status, reason) == (text, "completed", "stop")
    jsonschema.validate(json.loads(out.output_text), PARAMS)
    assert out.text.format.type == "json_schema"
    assert text_of(streamed(service, client, input=ASK, text={"format": fmt}, max_output_tokens=100)) == text


@pytest.mark.parametrize("fields, param", [
    ({"previous_response_id": "resp_abc"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}, "tools": [WEATHER]}, "tool_choice"),
    ({"tools": [WEATHER]}, "tool_choice"),  # auto, the default, needs --tool-call-parser
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": "x" * 200_000}, "input"),  # longer than the model
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "string", "pattern": "(unclosed"}}}},
     "text"),
    ({"text": {"verbosity": "high"}}, "text"),
])
def test_refusals_name_the_field_and_the_server_keeps_serving(service, client, fields, param):
    with no_error_logged(service):
        with pytest.raises(openai.BadRequestError) as e:
            create(service, client, input="hello", extra_body=fields)  # NOTE: sent as they are, over input
        assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
        assert e.value.body["type"] == "invalid_request_error"
        assert create(service, client, input="hello", max_output_tokens=2).usage.output_tokens == 2
    assert_idle_and_serving(service)


def test_fields_that_cannot_change_the_output_are_accepted(service, client):
    text = create(service, client, input=CONVERSATION).output_text
    out = create(service, client, input=CONVERSATION, store=False, metadata={"k": "v"}, user="u", truncation="disabled",
                 safety_identifier="s", prompt_cache_key="p", service_tier="auto", reasoning={"effort": None},
                 include=["reasoning.encrypted_content"], parallel_tool_calls=True, text={"format": {"type": "text"}})
    assert out.output_text == text and out.metadata == {"k": "v"}


def event_model(kind: str) -> type:
    """The installed openai package's model of the stream event of type `kind`."""
    union = typing.get_args(ResponseStreamEvent)[0]  # NOTE: Annotated[Union[...], discriminator]
    [model] = [m for m in typing.get_args(union) if typing.get_args(m.model_fields["type"].annotation) == (kind,)]
    return model


def assert_valid(model: type, data: dict) -> None:
    """`data` validates against the installed openai package's own pydantic model (the client parses without
    validating), but for the one field not computed here: the tokens a request wrote to the prefix cache."""
    try:
        model.model_validate(data)
    except ValidationError as e:
        wrong = [err for err in e.errors() if err["type"] != "missing"
                 or err["loc"][-2:] != ("input_tokens_details", "cache_write_tokens")]
        assert not wrong, e


@pytest.mark.parametrize("fields", [{}, {"tools": [WEATHER], "tool_choice": "required", "max_output_tokens": 200}])
def test_raw_http_bodies_and_named_events_validate_against_the_clients_models(service, fields):
    url = f"http://{service.http}/v1/responses"
    body = {"input": ASK, "max_output_tokens": 4, "temperature": 0, **fields}
    whole = httpx.post(url, json=body, timeout=60)
    assert whole.status_code == 200 and whole.json()["output"], whole.text
    assert_valid(Response, whole.json())
    r = httpx.post(url, json={**body, "stream": True}, timeout=60)
    assert r.headers["content-type"].startswith("text/event-stream") and "[DONE]" not in r.text
    events = []
    for block in r.text.split("\n\n")[:-1]:  # each event names its type, and its data says it again
        head, data = block.split("\n")
        events.append(json.loads(data.removeprefix("data: ")))
        assert head.removeprefix("event: ") == events[-1]["type"]
        assert_valid(event_model(events[-1]["type"]), events[-1])
    final = events[-1]["response"]
    assert [(o["type"], o.get("name")) for o in final["output"]] == [
        (o["type"], o.get("name")) for o in whole.json()["output"]]


def test_an_unknown_model_is_a_404(service):
    r = httpx.post(f"http://{service.http}/v1/responses", json={"model": "gpt-4o", "input": "hi"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model" and "gpt-4o" in r.json()["error"]["message"]


def test_a_client_that_goes_away_mid_stream_frees_its_blocks(service, client):
    stream = create(service, client, input=CONVERSATION, max_output_tokens=400, stream=True)
    for event in stream:
        if event.type == "response.output_text.delta":
            break
    stream.close()
    assert_idle_and_serving(service)


def test_langchain_with_use_responses_api_gets_the_same_text(service, client):
    from langchain_openai import ChatOpenAI

    text = create(service, client, input="Name a city in France.").output_text
    llm = ChatOpenAI(use_responses_api=True, base_url=f"http://{service.http}/v1", api_key="unused",
                     model=service.model_dir, temperature=0, max_tokens=MAX, max_retries=0, timeout=120)
    message = llm.invoke("Name a city in France.")
    assert message.text == text == chat_text(service, client, CHAT[:1])[0]
    assert "".join(chunk.text for chunk in llm.stream("Name a city in France.")) == text


def test_litellms_openai_provider_gets_the_same_text(service, client):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # NOTE: else it fetches a price list at import
    import litellm

    base, max_tokens = f"http://{service.http}/v1", 16  # NOTE: litellm raises max_output_tokens to OpenAI's least, 16
    text = create(service, client, input=CHAT, max_output_tokens=max_tokens).output_text
    out = litellm.responses(model=f"openai/{service.model_dir}", input=CHAT, temperature=0,
                            max_output_tokens=max_tokens, api_base=base, api_key="unused", num_retries=0)
    assert "".join(c.text for item in out.output if item.type == "message" for c in item.content) == text
    assert (out.status, out.usage.output_tokens) == ("incomplete", max_tokens)
    out = litellm.completion(model=f"openai/{service.model_dir}", messages=CHAT, temperature=0, max_tokens=max_tokens,
                             api_base=base, api_key="unused", num_retries=0)
    assert out.choices[0].message.content == text


# -- an engine error mid-stream: a scripted worker in this process fails the request's step ----------------------
@with_server(max_migrations=1)
async def test_an_engine_error_mid_stream_is_an_error_event(engine, channel):
    worker = ScriptedWorker(channel)  # silent until told to fail
    await wait_for(lambda: engine.workers)
    front = Front(engine)
    async with front, openai.AsyncOpenAI(base_url=f"http://{front.http.address}/v1", api_key="unused",
                                         max_retries=0, timeout=60) as client:
        async def read() -> list:
            stream = await client.responses.create(model="m", input="hi", max_output_tokens=4, stream=True)
            return [event async for event in stream]

        reader = asyncio.ensure_future(read())
        await wait_for(lambda: worker.plans)
        worker.fail_step(worker.plans[0], message="CUDA error: an illegal memory access")
        events = await reader
    assert [e.type for e in events] == ["response.created", "response.in_progress", "error"]
    assert [e.sequence_number for e in events] == [0, 1, 2]
    assert events[-1].code == "internal_error" and "illegal memory access" in events[-1].message
    await wait_for(lambda: not engine.streams)  # the request is gone


@with_server(eos_token_ids=(EOS,))
async def test_text_and_parsed_calls_are_a_message_then_function_call_items(engine, channel):
    """tool_choice auto with --tool-call-parser hermes, a scripted worker saying text and two Hermes calls: the
    whole response and the streamed one (folded by the client's stream helper) have the same three items."""
    Speaker(channel, HERMES)
    await wait_for(lambda: engine.workers)
    front = Front(engine, tool_call_parser="hermes")
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
    async with front, openai.AsyncOpenAI(base_url=f"http://{front.http.address}/v1", api_key="unused",
                                         max_retries=0, timeout=60) as client:
        request = {"model": "m", "input": "Weather in Paris and Lyon?", "tools": [tool], "max_output_tokens": 100}
        whole = await client.responses.create(**request)
        async with client.responses.stream(**request) as stream:
            kinds = [event.type async for event in stream]
            streamed = await stream.get_final_response()
    for out in (whole, streamed):
        assert out.status == "completed" and [item.type for item in out.output] == ["message", "function_call",
                                                                                    "function_call"]
        assert out.output_text == "I will look it up."
        assert [(c.name, json.loads(c.arguments)) for c in out.output[1:]] == [("get_weather", {"city": "Paris"}),
                                                                              ("get_weather", {"city": "Lyon"})]
        assert len({c.call_id for c in out.output[1:]}) == 2
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 3
    assert kinds.index("response.output_item.done") < kinds.index("response.function_call_arguments.delta")
