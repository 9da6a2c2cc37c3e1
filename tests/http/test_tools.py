"""Tools and tool_choice as a chat request gives them: checked, turned into a constraint, and the answers shaped
into OpenAI's tool_calls (streamed deltas and whole messages alike); histories as the chat template reads them."""

from __future__ import annotations

import json

import jsonschema
import pytest

from scheduler_svc.errors import EngineError
from scheduler_svc.frontend.tokenizer import _compile_template
from scheduler_svc.http import history, tools
from scheduler_svc.http.schemas import ChatCompletionRequest
from scheduler_svc.http.tools import Message

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": WEATHER_PARAMS}}
NOW = {"type": "function", "function": {"name": "now"}}


def body(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(**{"messages": [{"role": "user", "content": "hi"}], **fields})


def refusal(parser: str = "none", **fields) -> EngineError:
    with pytest.raises(EngineError) as e:
        tools.plan(body(**fields), parser)
    return e.value


@pytest.mark.parametrize("fields, param, words", [
    ({"tools": []}, "tools", "empty"),
    ({"tools": [NOW] * 129}, "tools", "the limit is 128"),
    ({"tools": [{"type": "function"}]}, "tools", "tools[0] must be"),
    ({"tools": [{"type": "code_interpreter", "function": {"name": "f"}}]}, "tools", "tools[0] must be"),
    ({"tools": [{"type": "function", "function": {"name": "f", "params": {}}}]}, "tools", "unknown field 'params'"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools", "tools[0].function.name"),
    ({"tools": [NOW, WEATHER, NOW]}, "tools", "tools[2].function.name: 'now' is the name of an earlier tool"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools", "JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools",
     "JSON schema of an object"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "'get_time', which is not among tools (get_weather)"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", "to name a function"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "must be one of none, auto, required"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls", "only allowed when tools are given"),
])
def test_bad_tools_and_tool_choice_are_refused_naming_the_field(fields, param, words):
    e = refusal("hermes", **fields)
    assert e.field == param and words in str(e), str(e)


@pytest.mark.parametrize("tool_choice", [None, "auto"])
def test_auto_without_a_parser_is_refused_naming_tool_choice_and_the_flag(tool_choice):
    e = refusal(tools=[WEATHER], tool_choice=tool_choice)
    assert e.field == "tool_choice" and "--tool-call-parser" in str(e), str(e)
    assert tools.plan(body(tools=[WEATHER], tool_choice=tool_choice), "hermes").mode == "auto"


def test_none_and_no_tools_leave_the_output_free():
    assert tools.plan(body(), "none") is None
    plan = tools.plan(body(tools=[WEATHER], tool_choice="none"), "none")
    assert plan.mode == "none" and plan.structured_output() is None and plan.tools == [WEATHER]


def schema_of(**fields) -> dict:
    out = tools.plan(body(**fields), "none").structured_output()
    assert out.kind == "json_schema"
    return json.loads(out.spec)


def test_required_is_a_schema_of_one_or_more_calls_of_the_tools():
    schema = schema_of(tools=[WEATHER, NOW], tool_choice="required")
    valid = [[{"name": "get_weather", "arguments": {"city": "Paris"}}],
             [{"name": "now", "arguments": {}},
              {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]]
    invalid = [[], [{"name": "get_time", "arguments": {}}], [{"name": "get_weather", "arguments": {}}],
               [{"name": "now", "arguments": {"x": 1}}], {"name": "now", "arguments": {}},
               [{"name": "get_weather", "arguments": {"city": "Paris", "country": "France"}}]]
    for value in valid:
        jsonschema.validate(value, schema)
    for value in invalid:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, schema)
    one = schema_of(tools=[WEATHER, NOW], tool_choice="required", parallel_tool_calls=False)
    jsonschema.validate(valid[0], one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(valid[1], one)


def test_a_named_function_is_the_schema_of_its_arguments():
    # NOTE: the arguments are the function's parameters and nothing else: an object left open is closed
    assert schema_of(tools=[NOW, WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}) \
        == {**WEATHER_PARAMS, "additionalProperties": False}
    open_object = {**WEATHER_PARAMS, "additionalProperties": {"type": "string"}}
    assert schema_of(tools=[{"type": "function", "function": {"name": "f", "parameters": open_object}}],
                     tool_choice={"type": "function", "function": {"name": "f"}}) == open_object
    assert schema_of(tools=[NOW], tool_choice={"type": "function", "function": {"name": "now"}}) \
        == tools.NO_PARAMETERS


def test_a_constraint_of_its_own_and_tool_choice_required_cannot_be_combined():
    from pagedserve_common.sampling import SamplingParams, StructuredOutput

    plan = tools.plan(body(tools=[WEATHER], tool_choice="required"), "none")
    sampling, kwargs = tools.apply(plan, SamplingParams(), {"enable_thinking": False})
    assert sampling.structured_output == plan.structured_output()
    assert kwargs == {"enable_thinking": False, "tools": [WEATHER]}
    with pytest.raises(EngineError) as e:
        tools.apply(plan, SamplingParams(structured_output=StructuredOutput("json_object")), {})
    assert e.value.field == "tool_choice"


# -- answers -----------------------------------------------------------------------------------------------------
def shaped(plan_fields: dict, chunks: list[str], reason: str = "stop", parser: str = "hermes"):
    """(streamed deltas joined into a message, its finish reason) and the same answer non-streamed."""
    plan = tools.plan(body(**plan_fields), parser)
    shaper, streamed, final = plan.shaper(), Message(), None
    for i, chunk in enumerate(chunks):
        deltas, final = shaper.push(chunk, reason if i == len(chunks) - 1 else None)
        for delta in deltas:
            streamed.add(delta)
    whole = tools.message(plan.shaper(), "".join(chunks), reason)
    assert _without_ids(streamed.to_json()) == _without_ids(whole[0]) and final == whole[1]
    return whole


def _without_ids(message: dict) -> dict:
    for call in message.get("tool_calls", ()):
        assert call.pop("id").startswith("call_") and call["type"] == "function"
    return message


def calls_of(message: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]


def test_auto_returns_the_calls_with_the_text_around_them_as_content():
    answer = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    for chunks in ([answer], list(answer), [answer[:20], answer[20:]]):
        message, reason = shaped({"tools": [WEATHER]}, chunks)
        assert message["content"] == "Checking." and reason == "tool_calls"
        assert calls_of(message) == [("get_weather", {"city": "Paris"})]


def test_auto_with_only_calls_has_null_content_and_parallel_false_keeps_the_first_call():
    call = '<tool_call>{"name": "%s", "arguments": {}}</tool_call>\n'
    message, reason = shaped({"tools": [WEATHER, NOW]}, [call % "now", call % "get_weather"])
    assert message["content"] is None and reason == "tool_calls"
    assert calls_of(message) == [("now", {}), ("get_weather", {})]
    shaper = tools.plan(body(tools=[NOW]), "hermes").shaper()
    ids = [c["id"] for c in tools.message(shaper, (call % "now") * 2, "stop")[0]["tool_calls"]]
    assert len(set(ids)) == 2
    message, _ = shaped({"tools": [WEATHER, NOW], "parallel_tool_calls": False}, [call % "now", call % "get_weather"])
    assert calls_of(message) == [("now", {})]


def test_auto_text_without_calls_is_plain_content():
    message, reason = shaped({"tools": [WEATHER]}, ["It is ", "sunny.  "])
    assert message == {"role": "assistant", "content": "It is sunny.  "} and reason == "stop"
    message, reason = shaped({"tools": [WEATHER]}, ['{"name": "now", "parameters": {}}'], parser="llama3_json")
    assert calls_of(message) == [("now", {})] and message["content"] is None and reason == "tool_calls"


def test_a_cut_off_call_stays_text_with_finish_reason_length():
    message, reason = shaped({"tools": [WEATHER]}, ['<tool_call>{"name": "now", '], reason="length")
    assert message == {"role": "assistant", "content": '<tool_call>{"name": "now", '} and reason == "length"


def test_named_streams_the_arguments_as_they_come():
    plan = tools.plan(body(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                      "none")
    shaper = plan.shaper()
    first, _ = shaper.push('{"city"', None)
    assert first[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first[1] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"city"'}}]}
    rest = {"tool_calls": [{"index": 0, "function": {"arguments": ': "Oslo"}'}}]}
    assert shaper.push(': "Oslo"}', "stop") == ([rest], "tool_calls")
    message, reason = shaped({"tools": [WEATHER], "tool_choice": {"type": "function",
                                                                  "function": {"name": "get_weather"}}},
                             ['{"city": ', '"Oslo"}'])
    assert calls_of(message) == [("get_weather", {"city": "Oslo"})] and reason == "tool_calls"


def test_required_parses_the_array_of_calls_at_the_end():
    answer = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": {}}]'
    message, reason = shaped({"tools": [WEATHER, NOW], "tool_choice": "required"}, [answer[:30], answer[30:]])
    assert calls_of(message) == [("get_weather", {"city": "Paris"}), ("now", {})] and reason == "tool_calls"
    assert message["content"] is None
    message, reason = shaped({"tools": [WEATHER], "tool_choice": "required"}, [answer[:30]], reason="length")
    assert message == {"role": "assistant", "content": answer[:30]} and reason == "length"


# -- histories ---------------------------------------------------------------------------------------------------
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
QWEN_LIKE = ("{% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}"
             "<tool_call>{{ c.function.name }} {{ c.function.arguments.city }}</tool_call>{% endfor %}"
             "{% elif m.content is none %}NONE{% else %}{{ m.role }}: {{ m.content }}{% endif %}\n{% endfor %}"
             "{% for t in tools %}[{{ t.function.name }}]{% endfor %}")


def test_a_template_that_knows_tool_calls_gets_them_with_their_arguments_as_objects():
    messages = history.template_messages(body(messages=HISTORY).messages, QWEN_LIKE)
    assert messages[1]["content"] is None and messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[2] == HISTORY[2]
    text = _compile_template(QWEN_LIKE).render(messages=messages, tools=[WEATHER])
    assert text == "user: Weather in Paris?<tool_call>get_weather Paris</tool_call>tool: 18 C, sunny[get_weather]"


def test_a_template_that_knows_no_tool_calls_sees_them_written_into_the_text():
    messages = history.template_messages(body(messages=HISTORY).messages, "{{ messages }}")
    assert messages[1]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                      '</tool_call>')
    assert messages[2]["content"] == "18 C, sunny"


@pytest.mark.parametrize("calls", [{"id": "x"}, [{"id": "x"}], [{"function": {"arguments": "{}"}}]])
def test_malformed_tool_calls_in_a_history_are_refused_naming_messages(calls):
    with pytest.raises(EngineError) as e:
        history.template_messages(body(messages=[{"role": "assistant", "tool_calls": calls}]).messages, None)
    assert e.value.field == "messages" and "messages[0].tool_calls" in str(e.value)
