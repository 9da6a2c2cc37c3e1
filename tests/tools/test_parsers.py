"""The tool-call parsers (--tool-call-parser): whole answers and the same answers streamed in pieces."""

from __future__ import annotations

import json

import pytest

from scheduler_svc.frontend.tool_parsers import Call, Content, HermesParser, Llama3JsonParser, make_parser


def parse(name: str, chunks: list[str]) -> list:
    """Every piece of an answer streamed as `chunks`, with adjacent texts joined."""
    parser, pieces = make_parser(name), []
    for chunk in chunks:
        pieces += parser.feed(chunk)
    pieces += parser.finish()
    out: list = []
    for p in pieces:
        if isinstance(p, Content) and out and isinstance(out[-1], Content):
            out[-1] = Content(out[-1].text + p.text)
        else:
            out.append(p)
    return out


def every_split(text: str) -> list[list[str]]:
    """The answer whole, one character at a time, and cut at each position."""
    return [[text], list(text), *([text[:i], text[i:]] for i in range(1, len(text)))]


WEATHER = Call("get_weather", json.dumps({"city": "Paris", "unit": "celsius"}))
TIME = Call("get_time", json.dumps({"zone": "CET"}))


def hermes(name: str, args: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


@pytest.mark.parametrize("text, expected", [
    (hermes("get_weather", {"city": "Paris", "unit": "celsius"}), [WEATHER]),
    ("Let me look.\n" + hermes("get_weather", {"city": "Paris", "unit": "celsius"}) + "\nDone.",
     [Content("Let me look.\n"), WEATHER, Content("\nDone.")]),
    (hermes("get_weather", {"city": "Paris", "unit": "celsius"}) + "\n" + hermes("get_time", {"zone": "CET"}),
     [WEATHER, Content("\n"), TIME]),
    # arguments as a JSON string, or under "parameters": the same call
    ('<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}</tool_call>', [TIME]),
    ('<tool_call>{"name": "get_time", "parameters": {"zone": "CET"}}</tool_call>', [TIME]),
    # no arguments: an empty object
    ('<tool_call>{"name": "now"}</tool_call>', [Call("now", "{}")]),
    # an unclosed block at the end whose JSON is whole (the model stopped before the closing tag)
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n', [TIME]),
    ("no tools here, a < sign and <tool_ without the tag", [Content("no tools here, a < sign and <tool_ without the "
                                                                    "tag")]),
])
def test_hermes_finds_the_calls_and_the_text_around_them_however_the_text_is_split(text, expected):
    for chunks in every_split(text):
        assert parse("hermes", chunks) == expected, chunks


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "get_time", "arguments": {"zone": </tool_call>',  # malformed JSON
    '<tool_call>["get_time"]</tool_call>',  # JSON, but not a call
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "get_time", "arguments": {"zone"',  # cut off
])
def test_hermes_leaves_a_block_that_is_no_call_as_text(text):
    for chunks in every_split(text):
        assert parse("hermes", chunks) == [Content(text)], chunks


def test_hermes_streams_text_at_once_and_holds_back_only_what_may_open_a_call():
    parser = HermesParser()
    assert parser.feed("Sure, ") == [Content("Sure, ")]
    assert parser.feed("checking <tool") == [Content("checking ")]  # "<tool" may open a call
    assert parser.feed("box> ok") == [Content("<toolbox> ok")]  # it did not
    assert parser.feed("<tool_call>{\"name\": \"now\"") == []
    assert parser.feed("}</tool_call>") == [Call("now", "{}")]
    assert parser.finish() == []


@pytest.mark.parametrize("text, expected", [
    ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', [WEATHER]),
    ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}', [TIME]),
    ('  {"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
     '{"name": "get_time", "arguments": {"zone": "CET"}}', [WEATHER, TIME]),
    ("The weather in Paris is {unknown}.", [Content("The weather in Paris is {unknown}.")]),
    ('{"name": "get_time", "parameters": {"zone": ', [Content('{"name": "get_time", "parameters": {"zone": ')]),
    ('{"name": "get_time", "parameters": {"zone": "CET"}} and then text',
     [Content('{"name": "get_time", "parameters": {"zone": "CET"}} and then text')]),
    ('{"city": "Paris"}', [Content('{"city": "Paris"}')]),  # JSON, but no call
])
def test_llama3_json_is_calls_when_the_whole_answer_parses_else_text(text, expected):
    for chunks in every_split(text):
        assert parse("llama3_json", chunks) == expected, chunks


def test_llama3_json_streams_text_once_the_answer_does_not_open_with_json():
    parser = Llama3JsonParser()
    assert parser.feed("  ") == []  # blank: undecided
    assert parser.feed("<|python") == []  # may be the tag
    parser = Llama3JsonParser()
    assert parser.feed(" Hello") == [Content(" Hello")]
    assert parser.feed(" {x}") == [Content(" {x}")]
    assert parser.finish() == []
