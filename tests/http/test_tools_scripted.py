"""Tool calls through the HTTP front with the official `openai` client, against a worker that speaks a scripted
answer (the tokens of a Hermes `<tool_call>` block, say): the shapes, streamed and not, exactly."""

from __future__ import annotations

import json

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from scheduler_svc.frontend import Tokenizer
from tests.support.inproc import EOS, HERMES, Front, Speaker, tokenizer, wait_for, with_server

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def client_of(front: Front) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://{front.http.address}/v1", api_key="unused", max_retries=0,
                              timeout=60)


async def both(client: openai.AsyncOpenAI, **request):
    """(the whole answer, the streamed one accumulated by the client's own stream state) of one request."""
    whole = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=100, **request)
    state = ChatCompletionStreamState(input_tools=request.get("tools", openai.omit))
    chunks = []
    async for chunk in await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=100,
                                                            stream=True, **request):
        chunks.append(chunk)
        state.handle_chunk(chunk)
    return whole, state.get_final_completion(), chunks


def calls_of(message) -> list[tuple[str, dict]]:
    assert all(c.id.startswith("call_") and c.type == "function" for c in message.tool_calls)
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


@with_server(eos_token_ids=(EOS,), max_num_seqs=2)
async def test_auto_with_the_hermes_parser_returns_tool_calls_streamed_and_not(engine, channel):
    Speaker(channel, HERMES)
    await wait_for(lambda: engine.workers)
    front = Front(engine, tool_call_parser="hermes")
    async with front, client_of(front) as client:
        whole, streamed, chunks = await both(client, tools=[WEATHER])
        for out in (whole, streamed):
            choice = out.choices[0]
            assert choice.finish_reason == "tool_calls"
            assert choice.message.content == "I will look it up."
            assert calls_of(choice.message) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lyon"})]
        # streamed as OpenAI does: each call's first delta has its index, id, type and name
        firsts = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
        assert [(d.index, d.function.name) for d in firsts] == [(0, "get_weather"), (1, "get_weather")]
        assert len({d.id for d in firsts}) == 2
        # parallel_tool_calls false: the first call only
        whole, streamed, _ = await both(client, tools=[WEATHER], parallel_tool_calls=False)
        for out in (whole, streamed):
            assert calls_of(out.choices[0].message) == [("get_weather", {"city": "Paris"})]
        # n = 2: each choice has its own calls, numbered from 0, with ids of their own
        whole, streamed, _ = await both(client, tools=[WEATHER], n=2)
        for out in (whole, streamed):
            assert [len(calls_of(c.message)) for c in out.choices] == [2, 2]
            assert len({call.id for c in out.choices for call in c.message.tool_calls}) == 4


@with_server(eos_token_ids=(EOS,))
async def test_auto_with_a_text_answer_and_tool_choice_none_never_return_calls(engine, channel):
    Speaker(channel, HERMES)
    await wait_for(lambda: engine.workers)
    front = Front(engine, tool_call_parser="hermes")
    async with front, client_of(front) as client:
        whole, streamed, _ = await both(client, tools=[WEATHER], tool_choice="none")
        for out in (whole, streamed):
            assert out.choices[0].message.content == HERMES and not out.choices[0].message.tool_calls
            assert out.choices[0].finish_reason == "stop"


@with_server(eos_token_ids=(EOS,))
async def test_auto_with_a_malformed_call_keeps_it_as_content(engine, channel):
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    Speaker(channel, broken)
    await wait_for(lambda: engine.workers)
    front = Front(engine, tool_call_parser="hermes")
    async with front, client_of(front) as client:
        whole, streamed, _ = await both(client, tools=[WEATHER])
        for out in (whole, streamed):
            assert out.choices[0].message.content == broken and not out.choices[0].message.tool_calls
            assert out.choices[0].finish_reason == "stop"


@with_server(eos_token_ids=(EOS,))
async def test_llama3_json_answers_are_tool_calls(engine, channel):
    Speaker(channel, '{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    await wait_for(lambda: engine.workers)
    front = Front(engine, tool_call_parser="llama3_json")
    async with front, client_of(front) as client:
        whole, streamed, _ = await both(client, tools=[WEATHER])
        for out in (whole, streamed):
            assert out.choices[0].message.content is None and out.choices[0].finish_reason == "tool_calls"
            assert calls_of(out.choices[0].message) == [("get_weather", {"city": "Oslo"})]


@with_server(eos_token_ids=(EOS,))
async def test_required_and_named_answers_are_tool_calls(engine, channel):
    # NOTE: compact JSON, as the constraint's grammar allows it: the scheduler checks every scripted token
    # against the mask of the tool calls' schema
    Speaker(channel, '[{"name":"get_weather","arguments":{"city":"Rome"}}]')
    await wait_for(lambda: engine.workers)
    front = Front(engine)
    async with front, client_of(front) as client:
        whole, streamed, _ = await both(client, tools=[WEATHER], tool_choice="required")
        for out in (whole, streamed):
            assert out.choices[0].message.content is None and out.choices[0].finish_reason == "tool_calls"
            assert calls_of(out.choices[0].message) == [("get_weather", {"city": "Rome"})]


@with_server(eos_token_ids=(EOS,))
async def test_a_named_function_streams_its_arguments(engine, channel):
    Speaker(channel, '{"city":"Rome"}')
    await wait_for(lambda: engine.workers)
    front = Front(engine)
    async with front, client_of(front) as client:
        named = {"type": "function", "function": {"name": "get_weather"}}
        whole, streamed, chunks = await both(client, tools=[WEATHER], tool_choice=named)
        for out in (whole, streamed):
            assert out.choices[0].message.content is None and out.choices[0].finish_reason == "tool_calls"
            assert calls_of(out.choices[0].message) == [("get_weather", {"city": "Rome"})]
        parts = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
        assert parts[0].function.name == "get_weather" and parts[0].id.startswith("call_")
        assert len(parts) > 2 and all(p.id is None and p.function.name is None for p in parts[1:])


BROKEN_TEMPLATE = ("{% for m in messages %}{# knows tool_calls, but not a null content #}"
                   "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}")


@with_server()
async def test_a_template_that_fails_on_the_conversation_is_a_400_naming_messages(engine, channel):
    tok = Tokenizer.from_model_dir(tokenizer().model_dir)
    tok.chat_template = BROKEN_TEMPLATE
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    front = Front(engine, tok)
    async with front, client_of(front) as client:
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model="m", messages=history, max_tokens=5)
        error = e.value.body
        assert e.value.status_code == 400 and error["param"] == "messages", error
        assert "cannot render this conversation" in error["message"] and "dict object" not in error["message"]
        assert "NoneType" not in error["message"], error
