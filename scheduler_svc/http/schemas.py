"""Request bodies of the OpenAI-compatible API (pydantic), with vLLM's sampling extensions."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


# NOTE: extra="allow" keeps the fields these models do not declare for scheduler_svc.http.fields.check, which
# refuses each by name unless it is on its list of fields accepted and deliberately ignored (or neutral).
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the usage so far in every chunk (guidellm asks for it)


class _Common(BaseModel):
    """Fields both endpoints take (and implement). Undeclared ones are checked by scheduler_svc.http.fields."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    request_id: str | None = None  # vLLM's: the request's id in logs and the response's id (else a random one)
    cache_salt: str | None = None  # vLLM's: prefix-cache hits only between requests of the same salt
    priority: int | None = None  # vLLM's: --scheduling-policy priority admits lower first
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a JSON key) -> bias
    min_tokens: int | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's: only these token ids may be sampled
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and the top N at its position
    truncate_prompt_tokens: int | None = None  # vLLM's: keep only the prompt's last (or first) N tokens
    truncation_side: str | None = None  # vLLM's: "left" (the default: the last tokens stay) or "right"
    return_token_ids: bool = False  # vLLM's: prompt_token_ids and each choice's token_ids in the answer
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens `token_id:N`, not by their text
    # Structured output: OpenAI's response_format, vLLM's guided_* and their newer structured_outputs spelling
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    add_special_tokens: bool = True  # vLLM's: false encodes a text prompt without the tokenizer's BOS (etc.)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. name; passed to the chat template as they are (fields.check)

    role: str
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: reach the chat template (e.g. enable_thinking)
    # vLLM's: how the conversation becomes the prompt (ChatOptions), and documents for the template (RAG templates)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    echo: bool = False  # vLLM's: a final assistant message's content starts each choice's content
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


FinishReasonName = Literal["stop", "length", "abort"]
