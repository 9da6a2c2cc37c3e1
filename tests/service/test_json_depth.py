"""JSON nested too deep in a request is a 400 naming the field, and the server keeps serving (issue 50): a history's
tool-call arguments of 5,000 `[`, a response_format schema nested past the bound. Both were parsed by json.loads
unbounded (a RecursionError: a 500 with a traceback)."""

from __future__ import annotations

from tests.support.inproc import Front, Speaker, wait_for, with_server

ASK = {"role": "user", "content": "What is the weather in Paris?"}


def history(arguments: str) -> list[dict]:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return [ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


def nested_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


@with_server()
async def test_deep_json_is_a_400_naming_the_field_and_the_server_keeps_serving(engine, channel):
    Speaker(channel, "Sunny.")
    await wait_for(lambda: engine.workers)
    async with Front(engine) as client:
        r = await client.post("/v1/chat/completions", json={"messages": history("[" * 5000), "max_tokens": 4})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "messages", error
        assert error["message"].startswith("messages[1].tool_calls[0].function.arguments: JSON nested more than 64")
        schema = {"type": "json_schema", "json_schema": {"name": "deep", "schema": nested_schema(100)}}
        r = await client.post("/v1/chat/completions", json={"messages": [ASK], "max_tokens": 4,
                                                             "response_format": schema})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
        assert "more than 64 levels deep" in r.json()["error"]["message"]
        ok = await client.post("/v1/chat/completions", json={"messages": history('{"city": "Paris"}'),
                                                              "max_tokens": 4})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "Sunny.", ok.text
