"""Tool calling on /v1/chat/completions against real processes: the official `openai` client and LangChain's
ChatOpenAI, the default model forced to call a tool (tool_choice required or named) through structured output."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.support.service import started_service

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                            "parameters": WEATHER_PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone",
                                         "parameters": {"type": "object", "properties": {
                                             "zone": {"type": "string", "enum": ["CET", "UTC", "PST"]}},
                                             "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
# NOTE: a history as an agent sends it back: the assistant's call (content null) and the tool's answer
CALL = {"id": "call_abc", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}
HISTORY = [*ASK, {"role": "assistant", "content": None, "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "call_abc", "content": "18 degrees and sunny"}]


# -- the tiny model, no --tool-call-parser ---------------------------------------------------------------------------
def test_tool_choice_none_with_tools_answers_with_text(service, client):
    out = client.chat.completions.create(model=service.model_dir, messages=ASK, tools=[WEATHER], tool_choice="none",
                                         max_tokens=5)
    choice = out.choices[0]
    assert isinstance(choice.message.content, str) and not choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length")


@pytest.mark.parametrize("tool_choice", [openai.omit, "auto"])
def test_auto_without_a_tool_call_parser_is_a_400_naming_tool_choice(service, client, tool_choice):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=service.model_dir, messages=ASK, tools=[WEATHER],
                                       tool_choice=tool_choice, max_tokens=5)
    assert e.value.body["param"] == "tool_choice" and "--tool-call-parser" in e.value.body["message"]


@pytest.mark.parametrize("request_fields, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}], "tool_choice": "none"}, "tools"),
    # a schema the grammar engine cannot compile: a tool's parameters
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(unclosed"}}}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tools_are_a_400_naming_the_field(service, client, request_fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=service.model_dir, messages=ASK, max_tokens=5, **request_fields)
    assert e.value.body["param"] == param, e.value.body


def test_a_history_with_a_tool_call_and_the_tools_answer_renders(service, client):
    for stream in (False, True):
        out = client.chat.completions.create(model=service.model_dir, messages=HISTORY, tools=[WEATHER],
                                             tool_choice="none", max_tokens=5, stream=stream)
        if stream:
            out = list(out)
            assert out[-1].choices[0].finish_reason in ("stop", "length")
        else:
            assert isinstance(out.choices[0].message.content, str)


# -- the default model, --tool-call-parser hermes ------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_service(default_model):
    with started_service(str(default_model), "--tool-call-parser", "hermes",
                         kv_memory=str(256 << 20)) as s:
        yield s


def arguments_of(call, tool: dict) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_required_makes_the_default_model_call_a_tool_with_valid_arguments(model_service):
    with model_service.openai_client() as client:
        out = client.chat.completions.create(model=model_service.model_dir, messages=ASK, tools=[WEATHER, TIME],
                                             tool_choice="required", max_tokens=120, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    by_name = {"get_weather": WEATHER, "get_time": TIME}
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        arguments_of(call, by_name[call.function.name])


def test_a_named_function_streamed_is_one_call_of_it_with_valid_arguments(model_service):
    named = {"type": "function", "function": {"name": "get_weather"}}
    with model_service.openai_client() as client:
        state = ChatCompletionStreamState(input_tools=[WEATHER, TIME])
        for chunk in client.chat.completions.create(model=model_service.model_dir, messages=ASK, tools=[WEATHER, TIME],
                                                    tool_choice=named, max_tokens=120, temperature=0, stream=True):
            state.handle_chunk(chunk)
    choice = state.get_final_completion().choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and arguments_of(call, WEATHER)["unit"] in ("celsius", "fahrenheit")


def test_auto_with_the_hermes_parser_answers_text_or_tool_calls(model_service):
    """The model's own choice (a 135M model rarely calls): only the answer's shape is checked here;
    test_tools_scripted checks the parsing on scripted answers."""
    with model_service.openai_client() as client:
        out = client.chat.completions.create(model=model_service.model_dir, messages=HISTORY, tools=[WEATHER],
                                             max_tokens=20, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.tool_calls or isinstance(choice.message.content, str)


def test_langchain_bind_tools_with_a_forced_tool_returns_its_call(model_service):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class GetWeather(BaseModel):
        """The current weather in a city."""

        city: str = Field(description="the city", max_length=24)
        unit: str = Field(description="celsius or fahrenheit", pattern="^(celsius|fahrenheit)$")

    llm = ChatOpenAI(model=model_service.model_dir, base_url=f"http://{model_service.http}/v1", api_key="unused",
                     temperature=0, max_tokens=120, max_retries=0, timeout=300)
    for forced in ("GetWeather", "any"):  # a named function, and LangChain's spelling of required
        message = llm.bind_tools([GetWeather], tool_choice=forced).invoke("What is the weather like in Paris?")
        assert message.tool_calls, message
        for call in message.tool_calls:
            assert call["name"] == "GetWeather" and call["id"].startswith("call_")
            GetWeather(**call["args"])
