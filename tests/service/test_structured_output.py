"""Structured output against a real scheduler and worker serving the default model: twenty JSON schemas validate,
greedy and sampled; regex, choice and grammar; bad specs are 400s naming the field; the openai client's parse
helper and LangChain's with_structured_output get parsed objects; gRPC's SamplingParams.structured_output."""

from __future__ import annotations

import asyncio
import json
import re

import grpc
import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from tests.support.service import assert_idle_and_serving, no_error_logged, started_service
from pagedserve_cli.bench.structured_schemas import SCHEMAS

MAX_TOKENS = 512  # room: the longest of the twenty takes ~120 tokens greedy; a string of odd characters more


@pytest.fixture(scope="module")
def service(tmp_path_factory, model_dir):
    log = tmp_path_factory.mktemp("structured") / "scheduler.log"
    with started_service(model_dir, "--max-num-seqs", "32", kv_memory="256MiB",
                         log=log) as s:
        yield s


def chat(service, body: dict) -> httpx.Response:
    return httpx.post(f"http://{service.http}/v1/chat/completions", json={"max_tokens": 64, **body}, timeout=300)


def ask(prompt: str, **fields) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], **fields}


async def _all_schemas(service, **sampling) -> list[dict]:
    async with httpx.AsyncClient(timeout=600) as h:
        async def one(i: int, prompt: str, schema: dict) -> dict:
            r = await h.post(f"http://{service.http}/v1/chat/completions", json=ask(
                prompt, max_tokens=MAX_TOKENS, response_format={"type": "json_schema", "json_schema": {
                    "name": f"s{i}", "schema": schema, "strict": True}}, **sampling, **(
                    {"seed": 1000 + i} if sampling.get("temperature") else {})))
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]
        return await asyncio.gather(*(one(i, p, s) for i, (_, p, s) in enumerate(SCHEMAS)))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_twenty_schemas_validate(service, temperature):
    choices = asyncio.run(_all_schemas(service, temperature=temperature))
    invalid = []
    for (name, _, schema), choice in zip(SCHEMAS, choices):
        try:
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)
            assert choice["finish_reason"] == "stop"
        except (ValueError, jsonschema.ValidationError, AssertionError) as e:
            invalid.append((name, choice["finish_reason"], choice["message"]["content"], str(e)[:200]))
    assert invalid == [], invalid


def test_regex_choice_and_grammar(service):
    r = chat(service, ask("Give me a phone number.", temperature=0, guided_regex=r"\d{3}-\d{4}"))
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.json()["choices"][0]["message"]["content"]), r.text
    for spelling in ({"guided_choice": ["yes", "no"]}, {"structured_outputs": {"choice": ["yes", "no"]}}):
        r = chat(service, ask("Is the sky blue? Answer yes or no.", temperature=0, **spelling))
        assert r.json()["choices"][0]["message"]["content"] in ("yes", "no"), r.text
        assert r.json()["choices"][0]["finish_reason"] == "stop"
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[1-9][0-9]?/'
    r = chat(service, ask("What is 6 times 7?", temperature=1.0, seed=5, guided_grammar=lark))
    assert re.fullmatch(r"The answer is [1-9][0-9]?\.", r.json()["choices"][0]["message"]["content"]), r.text
    gbnf = 'root ::= "x" [0-9]+ "y"'  # GBNF, as llama.cpp clients write it
    r = chat(service, ask("Write something.", temperature=0, structured_outputs={"grammar": gbnf}, max_tokens=12))
    assert re.fullmatch(r"x[0-9]+y?", r.json()["choices"][0]["message"]["content"]), r.text


def test_json_object_and_guided_json_as_text_on_completions(service):
    r = chat(service, ask('Repeat this JSON object: {"name": "Tom", "legs": 4}', temperature=0, max_tokens=MAX_TOKENS,
                         response_format={"type": "json_object"}))
    choice = r.json()["choices"][0]
    assert isinstance(json.loads(choice["message"]["content"]), dict) and choice["finish_reason"] == "stop"
    schema = SCHEMAS[0][2]
    r = httpx.post(f"http://{service.http}/v1/completions", json={
        "prompt": "A person as JSON:", "max_tokens": MAX_TOKENS, "temperature": 0, "guided_json": json.dumps(schema)},
        timeout=300)
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), schema)


def test_n2_samples_each_match_and_a_stop_string_still_ends_a_sample(service):
    _, prompt, schema = SCHEMAS[2]
    r = chat(service, ask(prompt, temperature=1.0, seed=7, n=3, max_tokens=MAX_TOKENS,
                         structured_outputs={"json": schema}))
    outs = [c["message"]["content"] for c in r.json()["choices"]]
    for out in outs:
        jsonschema.validate(json.loads(out), schema)
    r = chat(service, ask(prompt, temperature=0, stop=[","], guided_json=schema))
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and "," not in choice["message"]["content"], r.text


def test_a_prefix_cache_hit_gives_the_same_constrained_output(service):
    _, prompt, schema = SCHEMAS[5]
    body = ask(prompt, temperature=0, max_tokens=MAX_TOKENS, guided_json=schema)
    first, second = chat(service, body).json(), chat(service, body).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert first["choices"][0]["message"] == second["choices"][0]["message"]
    jsonschema.validate(json.loads(first["choices"][0]["message"]["content"]), schema)


@pytest.mark.parametrize("body, param", [
    ({"guided_json": {"type": "nonsense"}}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_regex": "(("}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_regex": "a" * 70_000}, "guided_regex"),  # over --max-structured-output-bytes (64 KiB)
])
def test_a_bad_spec_is_a_400_naming_the_field_and_the_server_keeps_serving(service, body, param):
    with no_error_logged(service):
        r = chat(service, ask("hi", **body))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
        assert_idle_and_serving(service)


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)


class Team(BaseModel):
    team: str = Field(max_length=24)
    members: list[Person] = Field(min_length=1, max_length=3)


def test_the_openai_clients_parse_helper_returns_a_parsed_model(service, client):
    parse = client.chat.completions.parse if hasattr(client.chat.completions, "parse") else \
        client.beta.chat.completions.parse
    out = parse(model=service.model_dir, messages=[{"role": "user", "content": "Describe a team of two people."}],
                response_format=Team, temperature=0, max_tokens=MAX_TOKENS)
    team = out.choices[0].message.parsed
    assert isinstance(team, Team) and 1 <= len(team.members) <= 3, out


def test_langchain_with_structured_output_returns_a_parsed_model(service):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"http://{service.http}/v1", api_key="unused", model=service.model_dir,
                     temperature=0, max_tokens=MAX_TOKENS, max_retries=0, timeout=300)
    person = llm.with_structured_output(Person, method="json_schema").invoke("Describe a person.")
    assert isinstance(person, Person) and 0 <= person.age <= 120


def test_grpc_structured_output_and_a_bad_one_is_invalid_argument(service):
    schema = SCHEMAS[9][2]
    with service.channel() as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        msgs = list(stub.Generate(pb.GenerateRequest(prompt="Settings as JSON:", sampling=pb.SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0, structured_output=pb.StructuredOutput(
                json_schema=json.dumps(schema)))), timeout=300))
        jsonschema.validate(json.loads("".join(m.text for m in msgs)), schema)
        assert msgs[-1].finish_reason == pb.FINISH_REASON_STOP
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(
                structured_output=pb.StructuredOutput(regex="(("))), timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "structured_output" in e.value.details()
        for empty in (pb.StructuredOutput(), pb.StructuredOutput(json_object=False)):  # set, but saying nothing
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(
                    structured_output=empty)), timeout=60))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "structured_output" in e.value.details()
