"""Nothing silently ignored: every field of OpenAI's and vLLM's completion and chat requests, sent to a real server,
lands in exactly one class: implemented, accepted and deliberately ignored (on fields.py's one list), or refused."""

from __future__ import annotations

import json
import typing
import uuid
from pathlib import Path

import grpc
import httpx
import pytest
from openai.types import completion_create_params
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionStreamOptionsParam
from openai.types.chat import completion_create_params as chat_create_params

from scheduler_svc.http import fields
from scheduler_svc.http.fields import CHAT, COMPLETIONS, IGNORED, IMPLEMENTED, REFUSED
from scheduler_svc.http.schemas import StreamOptions
from tests.support.service import idle, wait_until

VLLM = json.loads(Path(__file__).with_name("vllm_request_fields.json").read_text())  # record_vllm_fields.py
API_PAGE = Path(__file__).parents[2] / "docs" / "api.md"


def _keys(*typed_dicts) -> set[str]:
    return {name for t in typed_dicts for name in typing.get_type_hints(t)}


OPENAI = {  # NOTE: from the installed client, so that a field a newer client sends fails here until classified
    COMPLETIONS: _keys(completion_create_params.CompletionCreateParamsBase,
                       completion_create_params.CompletionCreateParamsStreaming),
    CHAT: _keys(chat_create_params.CompletionCreateParamsBase, chat_create_params.CompletionCreateParamsStreaming),
    "messages": _keys(*typing.get_args(ChatCompletionMessageParam)),
    "stream_options": _keys(ChatCompletionStreamOptionsParam),
}


def names(kind: str) -> list[str]:
    """Every field OpenAI's client or vLLM has for `kind`, and every one fields.py classifies."""
    ours: set[str] = set()
    if kind in (COMPLETIONS, CHAT):
        ours = {*fields.MODELS[kind].model_fields, *fields.IGNORED_FIELDS[kind], *fields.REFUSED_FIELDS[kind]}
    return sorted(OPENAI[kind] | set(VLLM[kind]) | ours)


TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
# A plausible value of each field that asks for something (never its neutral value), and the fields it needs with it
BOTH_VALUES: dict[str, dict] = {
    "model": {},  # (the served id, as every request here sends it)
    "request_id": {"request_id": f"fields-{uuid.uuid4().hex}"},
    "max_tokens": {"max_tokens": 2}, "n": {"n": 2}, "seed": {"seed": 7}, "stop": {"stop": ["\n", "."]},
    "stream": {"stream": True}, "stream_options": {"stream": True, "stream_options": {"include_usage": True}},
    "temperature": {"temperature": 0.5}, "top_p": {"top_p": 0.9}, "user": {"user": "user-1"},
    "frequency_penalty": {"frequency_penalty": 0.5}, "presence_penalty": {"presence_penalty": 0.5},
    "logit_bias": {"logit_bias": {"42": -100}}, "use_beam_search": {"use_beam_search": True},
    "top_k": {"top_k": 5}, "min_p": {"min_p": 0.1}, "repetition_penalty": {"repetition_penalty": 1.2},
    "watermarking": {"watermarking": True}, "length_penalty": {"length_penalty": 0.5},
    "stop_token_ids": {"stop_token_ids": [13]}, "include_stop_str_in_output": {"include_stop_str_in_output": True},
    "ignore_eos": {"ignore_eos": True}, "min_tokens": {"min_tokens": 1, "max_tokens": 2},
    "skip_special_tokens": {"skip_special_tokens": False},
    "spaces_between_special_tokens": {"spaces_between_special_tokens": False},
    "truncate_prompt_tokens": {"truncate_prompt_tokens": 4}, "truncation_side": {"truncation_side": "left"},
    "allowed_token_ids": {"allowed_token_ids": [42, 43]}, "prompt_logprobs": {"prompt_logprobs": 1},
    "logprob_token_ids": {"logprob_token_ids": [42]}, "bad_words": {"bad_words": ["Paris"]},
    "prompt_embeds": {"prompt_embeds": "AAAAAA=="},
    "response_format": {"response_format": {"type": "json_object"}},
    "structured_outputs": {"structured_outputs": {"choice": ["yes", "no"]}},
    "guided_json": {"guided_json": {"type": "object"}}, "guided_regex": {"guided_regex": "[a-z]+"},
    "guided_choice": {"guided_choice": ["yes", "no"]}, "guided_grammar": {"guided_grammar": 'root ::= "yes" | "no"'},
    "priority": {"priority": 1}, "session_id": {"session_id": "session-1"},
    "return_tokens_as_token_ids": {"return_tokens_as_token_ids": True}, "return_token_ids": {"return_token_ids": True},
    "routed_experts_prompt_start": {"routed_experts_prompt_start": 1},
    "return_token_offsets": {"return_token_offsets": True}, "mm_payload": {"mm_payload": "none"},
    "return_mm_kwargs": {"return_mm_kwargs": False}, "cache_salt": {"cache_salt": "tenant-1"},
    "kv_transfer_params": {"kv_transfer_params": {"do_remote_decode": True}},
    "ec_transfer_params": {"ec_transfer_params": {"do_remote_encode": True}},
    "vllm_xargs": {"vllm_xargs": {"key": 1}}, "repetition_detection": {"repetition_detection": {"max_pattern_size": 4}},
    "thinking_token_budget": {"thinking_token_budget": 16}, "stream_interval": {"stream_interval": 4},
}
VALUES: dict[str, dict[str, dict]] = {
    COMPLETIONS: {**BOTH_VALUES, "prompt": {"prompt": ["Hello", "Goodbye"]}, "best_of": {"best_of": 2},
                  "echo": {"echo": True}, "logprobs": {"logprobs": 2}, "suffix": {"suffix": " world."},
                  "add_special_tokens": {"add_special_tokens": False}},
    CHAT: {**BOTH_VALUES,
           "messages": {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
           "logprobs": {"logprobs": True}, "top_logprobs": {"logprobs": True, "top_logprobs": 2},
           "max_completion_tokens": {"max_completion_tokens": 2},
           "audio": {"audio": {"voice": "alloy", "format": "wav"}},
           "function_call": {"function_call": "auto"},
           "functions": {"functions": [{"name": "f", "parameters": {"type": "object"}}]},
           "metadata": {"metadata": {"team": "a"}}, "modalities": {"modalities": ["text", "audio"]},
           "moderation": {"moderation": {"model": "omni-moderation-latest"}},
           "parallel_tool_calls": {"parallel_tool_calls": False},
           "prediction": {"prediction": {"type": "content", "content": "Hello"}},
           "prompt_cache_key": {"prompt_cache_key": "key-1"},
           "prompt_cache_options": {"prompt_cache_options": {"mode": "explicit"}},
           "prompt_cache_retention": {"prompt_cache_retention": "24h"}, "reasoning_effort": {"reasoning_effort": "low"},
           "safety_identifier": {"safety_identifier": "user-1"}, "service_tier": {"service_tier": "flex"},
           "store": {"store": True}, "tools": {"tools": [TOOL], "tool_choice": "none"},
           "tool_choice": {"tools": [TOOL], "tool_choice": "required"}, "verbosity": {"verbosity": "low"},
           "web_search_options": {"web_search_options": {"search_context_size": "low"}},
           "include_reasoning": {"include_reasoning": False}, "echo": {"echo": True},
           "add_generation_prompt": {"add_generation_prompt": False},
           "continue_final_message": {"continue_final_message": True, "add_generation_prompt": False,
                                      "messages": [{"role": "user", "content": "Hi"},
                                                   {"role": "assistant", "content": "Hello, I"}]},
           "add_special_tokens": {"add_special_tokens": True},
           "documents": {"documents": [{"title": "Paris", "text": "Paris is the capital of France."}]},
           "chat_template": {"chat_template": "{{ messages[0]['content'] }}"},
           "chat_template_kwargs": {"chat_template_kwargs": {"enable_thinking": False}},
           "media_io_kwargs": {"media_io_kwargs": {"image": {"max_size": 64}}},
           "mm_processor_kwargs": {"mm_processor_kwargs": {"num_crops": 4}},
           "return_prompt_text": {"return_prompt_text": True}},
}
CALL = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
MESSAGE_VALUES: dict[str, list[dict]] = {  # a conversation where the message field is set
    "role": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    "content": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]}],
    "name": [{"role": "user", "content": "Hi", "name": "alice"}],
    "tool_calls": [{"role": "user", "content": "Weather in Paris?"},
                   {"role": "assistant", "content": None, "tool_calls": CALL},
                   {"role": "tool", "tool_call_id": "call_1", "content": "20 C"}],
    "tool_call_id": [{"role": "user", "content": "Weather in Paris?"},
                     {"role": "assistant", "content": "", "tool_calls": CALL},
                     {"role": "tool", "tool_call_id": "call_1", "content": "20 C"}],
    "reasoning": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "reasoning": "greet"},
                  {"role": "user", "content": "Bye"}],
    "reasoning_content": [{"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "Hello", "reasoning_content": "greet"},
                          {"role": "user", "content": "Bye"}],
    "refusal": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "No.", "refusal": "No."},
                {"role": "user", "content": "Why?"}],
    "audio": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "audio": {"id": "audio_1"}},
              {"role": "user", "content": "Bye"}],
    "function_call": [{"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
                      {"role": "user", "content": "Bye"}],
    "tools": [{"role": "system", "content": "Use tools.", "tools": [TOOL]}, {"role": "user", "content": "Hi"}],
    "task": [{"role": "user", "content": "Hi", "task": "chat"}],
    **{name: [{"role": "user", "content": "Hi", name: value}] for name, value in
       (("author", {"role": "user"}), ("channel", "final"), ("content_type", "text"), ("recipient", "functions.f"))},
}
STREAM_OPTIONS_VALUES = {"include_usage": True, "include_obfuscation": False, "continuous_usage_stats": True}


@pytest.fixture(scope="module")
def http(service):
    with httpx.Client(base_url=f"http://{service.http}/v1", timeout=120) as c:
        yield c


def _base(kind: str, model: str) -> dict:
    if kind == COMPLETIONS:
        return {"model": model, "prompt": "Hello", "max_tokens": 1}
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}


def _post(http, kind: str, body: dict) -> tuple[int, dict | str]:
    r = http.post("/completions" if kind == COMPLETIONS else "/chat/completions", json=body)
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        return r.status_code, r.text
    return r.status_code, r.json()


def _assert_lands_in(cls: str, name: str, status: int, body, param: str | None = None, strict: bool = False) -> None:
    """`strict`: an implemented field's value is valid, so it must be served (200)."""
    param = param or name
    error = body.get("error") if isinstance(body, dict) else None
    if cls == REFUSED:
        assert status == 400 and error and error["param"] == param, (name, status, body)
        assert name in error["message"], error
        return
    assert not error or "unknown field" not in error["message"] and "support" not in error["message"], error
    if cls == IGNORED or status == 200 or strict:
        assert status == 200 and error is None, (name, status, body)
        assert '"error"' not in body if isinstance(body, str) else True, body  # no error event in the stream
    else:  # implemented: a deliberately strict value may be refused, by name (never as unsupported)
        assert status == 400 and error["param"] == param, (name, status, body)


@pytest.mark.parametrize("kind, name", [(k, n) for k in (COMPLETIONS, CHAT) for n in names(k)])
def test_every_request_field_is_implemented_ignored_or_refused(service, http, kind, name):
    cls = fields.classify(kind, name)
    assert cls is not None, f"{kind} field {name!r} is not classified: add it to scheduler_svc/http/fields.py"
    assert name in VALUES[kind], f"no plausible value for the {kind} field {name!r}: add one to VALUES"
    status, body = _post(http, kind, {**_base(kind, service.model_dir), **VALUES[kind][name]})
    _assert_lands_in(cls, name, status, body)


@pytest.mark.parametrize("name", names("messages"))
def test_every_message_field_is_implemented_or_refused(service, http, name):
    assert name in MESSAGE_VALUES, f"messages' field {name!r}: classify it in fields.py and give it a value"
    refused = name in fields.MESSAGE_REFUSED
    assert refused or name in ("role", "content", *fields.MESSAGE_TEMPLATE_FIELDS), f"{name!r} is not classified"
    status, body = _post(http, CHAT, {**_base(CHAT, service.model_dir), "messages": MESSAGE_VALUES[name]})
    _assert_lands_in(REFUSED if refused else IMPLEMENTED, name, status, body, "messages", strict=True)


@pytest.mark.parametrize("name", names("stream_options"))
def test_every_stream_option_is_implemented_ignored_or_refused(service, http, name):
    cls = (REFUSED if name in fields.STREAM_OPTIONS_REFUSED else IGNORED if name in fields.STREAM_OPTIONS_IGNORED
           else IMPLEMENTED if name in StreamOptions.model_fields else None)
    assert cls is not None, f"stream_options.{name} is not classified"
    body = {**_base(COMPLETIONS, service.model_dir), "stream": True,
            "stream_options": {name: STREAM_OPTIONS_VALUES[name]}}
    status, out = _post(http, COMPLETIONS, body)
    _assert_lands_in(cls, name, status, out, "stream_options")


def test_an_unknown_field_is_refused_by_name_and_the_server_keeps_serving(service, http):
    for kind in (COMPLETIONS, CHAT):
        status, body = _post(http, kind, {**_base(kind, service.model_dir), "guided_jsn": {"type": "object"}})
        assert status == 400 and body["error"]["param"] == "guided_jsn", body
        assert "unknown field" in body["error"]["message"] and body["error"]["type"] == "invalid_request_error"
        status, body = _post(http, kind, {**_base(kind, service.model_dir), "use_beam_search": False})  # neutral
        assert status == 200, body
    status, body = _post(http, CHAT, {**_base(CHAT, service.model_dir),
                                      "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi",
                                                                                 "cache": {}}]}]})
    assert status == 400 and body["error"]["param"] == "messages", body
    assert "messages[0].content[0].cache: unknown field" in body["error"]["message"]
    part = {"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}  # on the ignored list
    status, body = _post(http, CHAT, {**_base(CHAT, service.model_dir), "messages": [{"role": "user",
                                                                                      "content": [part]}]})
    assert status == 200, body
    wait_until(lambda: idle(service))


def test_request_id_names_the_response_and_cache_salt_keeps_prefix_cache_hits_apart(service, http):
    rid = f"my-request-{uuid.uuid4().hex}"
    status, body = _post(http, COMPLETIONS, {**_base(COMPLETIONS, service.model_dir), "request_id": rid})
    assert status == 200 and body["id"] == f"cmpl-{rid}", body
    status, body = _post(http, CHAT, {**_base(CHAT, service.model_dir), "request_id": "x" * 257})
    assert status == 400 and body["error"]["param"] == "request_id", body
    prompt = uuid.uuid4().hex + " the quick brown fox jumps over the lazy dog" * 6  # several KV blocks, new

    def cached_tokens(salt: str) -> int:
        status, body = _post(http, COMPLETIONS, {**_base(COMPLETIONS, service.model_dir), "prompt": prompt,
                                                 "cache_salt": salt})
        assert status == 200, body
        return body["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached_tokens("tenant-a") == 0 and cached_tokens("tenant-a") > 0
    assert cached_tokens("tenant-b") == 0
    wait_until(lambda: idle(service))


UNKNOWN_111 = bytes([0xF8, 0x06, 0x01])  # field 111 (not in generate.proto), varint 1


def _field_bytes(message_type, name: str, payload: bytes) -> bytes:
    """`payload` as the length-delimited field `name` of a `message_type` message."""
    number = message_type.DESCRIPTOR.fields_by_name[name].number
    assert number < 16 and len(payload) < 128  # one-byte key and length
    return bytes([number << 3 | 2, len(payload)]) + payload


@pytest.mark.parametrize("where", ["GenerateRequest", "sampling", "messages"])
def test_grpc_a_field_these_protos_do_not_know_is_invalid_argument(service, where):
    """Protobuf keeps unknown fields silently; the servicer refuses them (a newer client's constraint would be
    ignored otherwise)."""
    from pagedserve.v1 import generate_pb2 as pb

    base = pb.GenerateRequest(prompt="Hello", sampling=pb.SamplingParams(max_tokens=1))
    if where == "GenerateRequest":
        raw = base.SerializeToString() + UNKNOWN_111
    elif where == "sampling":
        raw = pb.GenerateRequest(prompt="Hello").SerializeToString() + _field_bytes(
            pb.GenerateRequest, "sampling", pb.SamplingParams(max_tokens=1).SerializeToString() + UNKNOWN_111)
    else:
        message = pb.ChatMessage(role="user", content="Hi").SerializeToString() + UNKNOWN_111
        raw = _field_bytes(pb.GenerateRequest, "messages", message) + _field_bytes(
            pb.GenerateRequest, "sampling", pb.SamplingParams(max_tokens=1).SerializeToString())
    with service.channel() as ch:
        call = ch.unary_stream("/pagedserve.v1.Generation/Generate", request_serializer=None,
                               response_deserializer=pb.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as e:
            list(call(raw, timeout=120))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    named = {"GenerateRequest": "GenerateRequest:", "sampling": "sampling:", "messages": "messages[0]:"}[where]
    assert e.value.details().startswith(named) and "field number 111" in e.value.details(), e.value.details()
    with service.channel() as ch:  # the same request without it is served
        out = list(ch.unary_stream("/pagedserve.v1.Generation/Generate", request_serializer=None,
                                   response_deserializer=pb.GenerateResponse.FromString)(
            base.SerializeToString(), timeout=120))
    assert out[-1].usage.completion_tokens == 1


def test_the_classes_are_disjoint():
    for kind in (COMPLETIONS, CHAT):
        declared = set(fields.MODELS[kind].model_fields)
        ignored, refused = set(fields.IGNORED_FIELDS[kind]), set(fields.REFUSED_FIELDS[kind])
        assert not ignored & refused and not ignored & declared
        assert refused & declared == ({"best_of"} if kind == COMPLETIONS else set())  # checked where it is used


def test_the_docs_list_the_ignored_and_refused_fields():
    assert fields.markdown() in API_PAGE.read_text(), "docs/api.md: paste fields.markdown()"


def test_the_vllm_record_names_its_version():
    assert VLLM["vllm_version"] and all(VLLM[k] for k in (COMPLETIONS, CHAT, "messages", "stream_options"))
