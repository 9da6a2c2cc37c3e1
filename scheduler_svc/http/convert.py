"""OpenAI request bodies to front-end inputs, stream items to OpenAI's JSON: the only place that knows both."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from pydantic import BaseModel

from pagedserve_common.sampling import SamplingParams, allow_list
from pagedserve_common.step import PositionLogprobs
from scheduler_svc.core.request import FinishReason
from scheduler_svc.errors import EngineError, ErrorCode
from scheduler_svc.frontend import FrontEnd, GenerateInput, StreamItem
from scheduler_svc.frontend.api import invalid
from scheduler_svc.frontend.inputs import ChatOptions
from scheduler_svc.http import history, tools
from scheduler_svc.http.schemas import ChatCompletionRequest, CompletionRequest
from scheduler_svc.http.structured import structured_output
from scheduler_svc.http.tools import Shaper, ToolPlan

FINISH_REASONS = {FinishReason.LENGTH: "length", FinishReason.STOP: "stop", FinishReason.STOP_STRING: "stop",
                  FinishReason.ABORT: "abort"}
HTTP_STATUS = {ErrorCode.INVALID_ARGUMENT: 400, ErrorCode.NOT_FOUND: 404, ErrorCode.FAILED_PRECONDITION: 400,
               ErrorCode.ALREADY_EXISTS: 409, ErrorCode.PERMISSION_DENIED: 403, ErrorCode.RESOURCE_EXHAUSTED: 429,
               ErrorCode.UNAVAILABLE: 503,
               ErrorCode.INTERNAL: 500}
ERROR_TYPES = {400: "invalid_request_error", 403: "permission_error", 404: "invalid_request_error",
               409: "invalid_request_error",
               429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable_error"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error shape. NOTE: a lone surrogate a message quotes (a dict key pydantic names) is escaped: UTF-8
    cannot hold it, and the response would fail to encode."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def engine_error(e: EngineError, params: dict[str, str]) -> tuple[int, dict]:
    """(HTTP status, body) for an engine error; `params` renames generate.proto fields to this API's."""
    status = HTTP_STATUS.get(e.code, 500)
    param = params.get(e.field, e.field) if e.field else None
    return status, error_body(status, str(e), param, "model_not_found" if status == 404 else None)


@dataclass(slots=True)
class Job:
    """One HTTP request as front-end inputs: several prompts (a completions batch), each with n samples."""

    inputs: list[GenerateInput]
    n: int
    params: dict[str, str] = field(default_factory=dict)  # generate.proto field -> the name this request used
    tools: ToolPlan | None = None  # chat with tools: how its answers become tool calls
    # vLLM's prompt_logprobs field: the top entries each position of it shows; None: answers carry no such field
    prompt_logprobs: int | None = None
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids in the answer
    names: object = None  # what names a token in logprobs (`token_text(id)`): the front end, or TokenIdNames
    echo_text: str = ""  # chat's echo (vLLM's): the text each choice's content starts with

    @property
    def wants_logprobs(self) -> bool:
        return self.inputs[0].sampling.logprobs is not None

    @property
    def num_logprobs(self) -> int | None:
        """The top logprobs a token shows (an echoed prompt's too); None: no logprobs."""
        return self.inputs[0].sampling.logprobs

    def choice_index(self, prompt_index: int, sample_index: int) -> int:
        return prompt_index * self.n + sample_index

    def shaper(self) -> Shaper:
        """A new shaper of one chat choice's answer into OpenAI's deltas (content, tool_calls)."""
        return Shaper() if self.tools is None else self.tools.shaper()


class TokenIdNames:
    """vLLM's return_tokens_as_token_ids: logprobs name a token `token_id:N` (its text may not survive JSON, or may
    be ambiguous), and its offsets and bytes are that name's, as vLLM writes them."""

    __slots__ = ()

    @staticmethod
    def token_text(token_id: int) -> str:
        return f"token_id:{token_id}"


def _job_options(body, frontend: FrontEnd) -> dict:
    """Job's fields that shape the answer's token ids and logprobs' token names."""
    return {"return_token_ids": body.return_token_ids,
            "names": TokenIdNames() if body.return_tokens_as_token_ids else frontend}


def _logit_bias(body) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: token ids as JSON keys (strings) -> bias; ids ascending."""
    out = []
    for key, bias in (body.logit_bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise invalid("logit_bias", f"logit_bias: key {key[:40]!r} is not a token id") from None
        out.append((token_id, float(bias)))
    return tuple(sorted(out))


def _sampling(body, max_tokens: int | None, logprobs: int | None, params: dict[str, str],
              defaults: SamplingParams) -> SamplingParams:
    """`params` (Job.params) learns which field set structured_output, so that an error names it; `defaults`: what
    an unset field means (the front end's, --generation-config)."""
    so, so_param = structured_output(body)
    if so_param is not None:
        params["structured_output"] = so_param

    def pick(value, default):
        return default if value is None else value

    d = defaults
    return SamplingParams(max_tokens=pick(max_tokens, d.max_tokens), temperature=pick(body.temperature, d.temperature),
                          top_p=pick(body.top_p, d.top_p), top_k=pick(body.top_k, d.top_k),
                          min_p=pick(body.min_p, d.min_p),
                          seed=body.seed, n=body.n, stop_token_ids=tuple(body.stop_token_ids or ()),
                          ignore_eos=body.ignore_eos, logprobs=logprobs,
                          presence_penalty=pick(body.presence_penalty, d.presence_penalty),
                          frequency_penalty=pick(body.frequency_penalty, d.frequency_penalty),
                          repetition_penalty=pick(body.repetition_penalty, d.repetition_penalty),
                          logit_bias=_logit_bias(body), min_tokens=pick(body.min_tokens, d.min_tokens),
                          allowed_token_ids=allow_list(body.allowed_token_ids or ()),
                          structured_output=so, prompt_logprobs=body.prompt_logprobs)


def _text_options(body) -> dict:
    """GenerateInput's front-end settings of the text (and the prefix cache's salt, the priority), as both endpoints
    take them."""
    return {"stop": _stop(body), "bad_words": tuple(body.bad_words or ()),
            "include_stop_str_in_output": body.include_stop_str_in_output,
            "skip_special_tokens": body.skip_special_tokens, "cache_salt": body.cache_salt or "",
            "priority": body.priority or 0, "truncate_prompt_tokens": body.truncate_prompt_tokens,
            "truncation_side": body.truncation_side or "left"}


def _stop(body) -> tuple[str, ...]:
    return (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())


def completion_job(body: CompletionRequest, request_id: str, frontend: FrontEnd) -> Job:
    if body.best_of is not None and body.best_of != body.n:
        raise invalid("best_of", f"best_of must equal n ({body.n}) when set: samples are not ranked")
    p = body.prompt
    if isinstance(p, str):
        prompts: list = [p]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [list(p)]
    else:
        prompts = list(p)
    if not prompts:
        raise invalid("prompt", "prompt is empty")
    frontend.check_batch(len(prompts), body.n)  # NOTE: before an input is made for each of up to a million prompts
    params = {"prompt_token_ids": "prompt"}
    sampling = _sampling(body, body.max_tokens, body.logprobs, params, frontend.sampling_defaults)
    shown = body.prompt_logprobs
    # the echoed prompt's logprobs lead choices[].logprobs (legacy). NOTE: a negative prompt_logprobs is left for
    # the front end to refuse by name
    if body.echo and body.logprobs is not None and (body.prompt_logprobs or 0) >= 0:
        sampling = dataclasses.replace(sampling, prompt_logprobs=max(body.prompt_logprobs or 0, body.logprobs))
        shown = body.logprobs if shown is None else shown  # NOTE: as vLLM, which then fills the field too
    inputs = []
    for i, one in enumerate(prompts):
        rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
        kind = "prompt" if isinstance(one, str) else "prompt_token_ids"
        inputs.append(GenerateInput(**{kind: one}, sampling=sampling, request_id=rid, echo=body.echo,
                                    add_special_tokens=body.add_special_tokens, **_text_options(body)))
    return Job(inputs, body.n, params, prompt_logprobs=shown, **_job_options(body, frontend))


def chat_job(body: ChatCompletionRequest, request_id: str, frontend: FrontEnd, tool_call_parser: str = "none") -> Job:
    """(completion_job's signature: one prompt, whose n the front end checks before tokenizing)"""
    tool_plan = tools.plan(body, tool_call_parser)
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs", "top_logprobs needs logprobs: true")
    max_tokens, name = body.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens, name = body.max_tokens, "max_tokens"
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = {"max_tokens": name, "logprobs": "top_logprobs"}
    sampling = _sampling(body, max_tokens, logprobs, params, frontend.sampling_defaults)
    options = chat_options(body)
    template_kwargs = body.chat_template_kwargs or {}
    if body.documents is not None:  # NOTE: as vLLM: chat_template_kwargs may name documents too, and win
        template_kwargs = {"documents": body.documents, **template_kwargs}
    if tool_plan is not None:
        sampling, template_kwargs = tools.apply(tool_plan, sampling, template_kwargs)
        if tool_plan.constrained:
            params["structured_output"] = "tools"  # NOTE: a schema the engine refuses is a tool's parameters
    messages = history.template_messages(body.messages, frontend.tokenizer.chat_template)
    inp = GenerateInput(messages=messages, sampling=sampling, request_id=request_id,
                        chat_template_kwargs=template_kwargs, chat_options=options, fill_context=max_tokens is None,
                        **_text_options(body))
    return Job([inp], body.n, params, tool_plan, prompt_logprobs=body.prompt_logprobs,
               echo_text=_chat_echo(body, messages), **_job_options(body, frontend))


def chat_options(body) -> ChatOptions:
    """vLLM's chat fields of `body` (a chat or a /tokenize request). Raises EngineError(INVALID_ARGUMENT) when
    add_generation_prompt and continue_final_message are both true, as vLLM does."""
    if body.add_generation_prompt and body.continue_final_message:
        raise invalid("continue_final_message", "continue_final_message and add_generation_prompt cannot both be "
                                                "true: one leaves the final message open, the other opens a new "
                                                "assistant turn (add_generation_prompt is true unless sent false)")
    return ChatOptions(body.add_generation_prompt, body.continue_final_message, bool(body.add_special_tokens))


def _chat_echo(body: ChatCompletionRequest, messages: list[dict]) -> str:
    """vLLM's chat echo: the final message's content (as the template got it) when that message is the assistant's,
    the role of the answer; else nothing."""
    final = messages[-1]
    return (final.get("content") or "") if body.echo and final["role"] == "assistant" else ""


_SURROGATE = re.compile("[\ud800-\udfff]")
_SCALARS = (int, float, bool, type(None))


def check_text(body: BaseModel) -> None:
    """Raises EngineError(INVALID_ARGUMENT) naming the first string of `body` (values, keys, extra fields of every
    nested model) that holds a lone surrogate: JSON's "\\ud800" parses into one, and no UTF-8 holds it (the
    tokenizer, an error message or a log line would fail on it). O(size of the body)."""
    for name, value in _fields(body):
        if (where := _surrogate_at(value, name)) is not None:
            raise invalid(name, f"{where} holds a lone surrogate (a JSON \\u escape of half a UTF-16 pair): text "
                                f"must be valid Unicode")


def _fields(model: BaseModel):
    yield from ((name, getattr(model, name)) for name in type(model).model_fields)
    yield from (model.__pydantic_extra__ or {}).items()


def _surrogate_at(value, path: str) -> str | None:
    """The path of the first string in `value` with a lone surrogate (`path` itself when `value` is one), or None.
    NOTE: a loop, not recursion (chat_template_kwargs may nest as deep as the JSON parser lets it); numbers are
    skipped without a path made for each (a prompt of a million token ids)."""
    todo = [(path, value)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return path
            continue
        if isinstance(value, BaseModel):
            items = [(f"{path}.{k}", v) for k, v in _fields(value) if not isinstance(v, _SCALARS)]
        elif isinstance(value, dict):
            if any(isinstance(k, str) and _SURROGATE.search(k) for k in value):
                return f"{path} (a key)"
            items = [(f"{path}.{k}", v) for k, v in value.items() if not isinstance(v, _SCALARS)]
        elif isinstance(value, list | tuple):
            items = [(f"{path}[{i}]", v) for i, v in enumerate(value) if not isinstance(v, _SCALARS)]
        else:
            continue
        todo.extend(reversed(items))
    return None


def request_id(body, limits) -> str | None:
    """vLLM's request_id, within its bound (it names the request's log lines and its response), or None."""
    if body.request_id and len(body.request_id) > limits.max_request_id_chars:
        raise invalid("request_id", f"request_id has {len(body.request_id)} characters; the limit is "
                                    f"{limits.max_request_id_chars}")
    return body.request_id or None


def check_model(frontend: FrontEnd, model: str | None) -> None:
    if model is not None and model not in frontend.model_names:
        served = ", ".join(f"`{name}`" for name in frontend.model_names)
        raise EngineError(ErrorCode.NOT_FOUND, f"The model `{model}` does not exist (this server serves {served})",
                          "model")


# -- responses ----------------------------------------------------------------------------------------------
def finish_reason(item: StreamItem) -> str | None:
    return None if item.finish_reason is None else FINISH_REASONS[item.finish_reason]


def completion_logprobs(frontend: FrontEnd, item: StreamItem, offset: int, num_top: int | None = None) -> dict:
    """Completions' logprobs for one item's tokens; `offset` is where its text starts in the choice's text. An echo
    item's are its prompt's (null for the first token), `num_top` top entries each."""
    if item.echo:
        return echo_logprobs(frontend, item, offset, num_top)
    tokens, token_logprobs, top, text_offset = [], [], [], []
    for lp in item.logprobs:
        text = frontend.token_text(lp.sampled.token_id)
        tokens.append(text)
        token_logprobs.append(lp.sampled.logprob)
        top.append({frontend.token_text(t.token_id): t.logprob for t in lp.top})
        text_offset.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": text_offset}


MIN_LOGPROB = -9999.0  # vLLM's clamp of a prompt logprob: JSON has no -Infinity (a token of probability 0)


def _clamped(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def echo_logprobs(frontend: FrontEnd, item: StreamItem, offset: int, num_top: int | None) -> dict:
    """OpenAI's legacy logprobs of an echo item (the prompt's tokens): null for the first token (nothing precedes
    it), `num_top` top entries (None: all the worker sent) at the others; `offset` is where the prompt's text starts
    in the choice's text."""
    tokens, token_logprobs, top, text_offset = [], [], [], []
    entries = item.prompt_logprobs or [None] * len(item.token_ids)
    for token_id, lp in zip(item.token_ids, entries):
        text = frontend.token_text(token_id)
        tokens.append(text)
        token_logprobs.append(None if lp is None else _clamped(lp.sampled.logprob))
        top.append(None if lp is None else {frontend.token_text(t.token_id): _clamped(t.logprob)
                                            for t in lp.top[:num_top]})
        text_offset.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": text_offset}


def vllm_prompt_logprobs(frontend: FrontEnd, entries: list[PositionLogprobs | None], num_top: int) -> list:
    """vLLM's prompt_logprobs list from a prompt's PositionLogprobs (None first): per position {token id (a JSON key):
    {"logprob", "rank", "decoded_token"}}, the prompt's token first, then `num_top` top ones (a token once)."""
    out: list[dict | None] = []
    for lp in entries:
        if lp is None:
            out.append(None)
            continue
        own = lp.sampled
        position = {str(own.token_id): {"logprob": _clamped(own.logprob), "rank": lp.rank,
                                        "decoded_token": frontend.token_text(own.token_id)}}
        for rank, t in enumerate(lp.top[:num_top], 1):
            position.setdefault(str(t.token_id), {"logprob": _clamped(t.logprob), "rank": rank,
                                                  "decoded_token": frontend.token_text(t.token_id)})
        out.append(position)
    return out


def _chat_entry(frontend: FrontEnd, token_id: int, logprob: float) -> dict:
    text = frontend.token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(frontend: FrontEnd, item: StreamItem) -> list[dict]:
    return [{**_chat_entry(frontend, lp.sampled.token_id, lp.sampled.logprob),
             "top_logprobs": [_chat_entry(frontend, t.token_id, t.logprob) for t in lp.top]} for lp in item.logprobs]


@dataclass(slots=True)
class UsageCount:
    """Tokens of the whole HTTP request: each prompt once, every sample's output."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    _prompts_seen: set = field(default_factory=set)

    def add(self, prompt_index: int, item: StreamItem) -> None:
        self.completion_tokens += item.completion_tokens
        if prompt_index not in self._prompts_seen:
            self._prompts_seen.add(prompt_index)
            self.prompt_tokens += item.prompt_tokens
            self.cached_tokens += item.cached_prompt_tokens

    def to_json(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


class UsageReport:
    """What a stream says of its usage as it goes (`stream_options`): with include_usage, a last chunk holding the
    whole request's usage and `"usage": null` in the others; with continuous_usage_stats (vLLM's) as well, the usage
    so far in every chunk: every prompt opened, the tokens output until then."""

    def __init__(self, options, streams) -> None:
        self.include_usage = bool(options and options.include_usage)
        self.continuous = self.include_usage and bool(options.continuous_usage_stats)
        self.prompt_tokens = sum(len(s.request.prompt_token_ids) for s in streams)
        self.completion_tokens = 0

    def saw(self, item: StreamItem) -> None:
        if not item.echo:  # NOTE: an echo item carries the prompt's ids, counted as prompt tokens already
            self.completion_tokens += len(item.token_ids)

    def chunk_usage(self) -> dict:
        """The `usage` entry of a chunk that carries choices."""
        if not self.include_usage:
            return {}
        if not self.continuous:
            return {"usage": None}
        return {"usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                          "total_tokens": self.prompt_tokens + self.completion_tokens}}
