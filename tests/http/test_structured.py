"""The HTTP spellings of structured output: OpenAI's response_format, vLLM's guided_* and structured_outputs map to one
StructuredOutput and name the field they came from; two at once, or a malformed one, is a 400 naming the field."""

from __future__ import annotations

import json

import pytest

from pagedserve_common.sampling import StructuredOutput
from scheduler_svc.errors import EngineError
from scheduler_svc.http.schemas import ChatCompletionRequest, CompletionRequest
from scheduler_svc.http.structured import structured_output

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=MESSAGES, **fields)


@pytest.mark.parametrize("fields, want, param", [
    ({}, None, None),
    ({"response_format": {"type": "text"}}, None, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object"), "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     StructuredOutput("json_schema", json.dumps(SCHEMA)), "response_format"),
    ({"guided_json": SCHEMA}, StructuredOutput("json_schema", json.dumps(SCHEMA)), "guided_json"),
    ({"guided_json": '{"type": "string"}'}, StructuredOutput("json_schema", '{"type": "string"}'), "guided_json"),
    ({"guided_regex": "a+"}, StructuredOutput("regex", "a+"), "guided_regex"),
    ({"guided_choice": ["a", "b"]}, StructuredOutput("choice", choices=("a", "b")), "guided_choice"),
    ({"guided_grammar": "start: \"a\""}, StructuredOutput("grammar", "start: \"a\""), "guided_grammar"),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput("json_schema", json.dumps(SCHEMA)),
     "structured_outputs"),
    ({"structured_outputs": {"choice": ["a"]}}, StructuredOutput("choice", choices=("a",)), "structured_outputs"),
    ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object"), "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "grammar": None}}, StructuredOutput("regex", "a"), "structured_outputs"),
])
def test_each_spelling_maps_to_one_structured_output(fields, want, param):
    assert structured_output(chat(**fields)) == (want, param)
    assert structured_output(CompletionRequest(prompt="x", **fields)) == (want, param)


@pytest.mark.parametrize("fields, param, words", [
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex", "guided_json already sets"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "response_format already sets"),
    ({"response_format": {"type": "yaml"}}, "response_format", "text, json_object or json_schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": "yes"}}},
     "response_format", "strict must be a boolean"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "set one of"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural_tag is not supported"),
    ({"structured_outputs": {"choice": "ab"}}, "structured_outputs", "list of strings"),
])
def test_a_second_or_malformed_spelling_is_refused_naming_its_field(fields, param, words):
    with pytest.raises(EngineError, match=words) as e:
        structured_output(chat(**fields))
    assert e.value.field == param
