"""One generation as a client API asks for it, before tokenizing: the front end's input type."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve_common.sampling import SamplingParams
from scheduler_svc.identity import MIN_PRIORITY

INPUTS = ("prompt", "prompt_token_ids", "messages")


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """How a conversation becomes prompt ids besides its messages and the template's arguments: vLLM's chat fields,
    with vLLM's defaults. NOTE: plain values: it goes to a tokenizer process as it is."""

    add_generation_prompt: bool = True  # the template opens the assistant's turn
    continue_final_message: bool = False  # the prompt ends inside the final message, its content left open
    add_special_tokens: bool = False  # the tokenizer's special tokens (BOS...) are added to the rendered text too


@dataclass(slots=True)
class GenerateInput:
    """One generation before tokenizing, whichever API it came from. Exactly one of the inputs is set (not None)."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict] | None = None  # [{"role": ..., "content": ...}], rendered with the chat template
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    request_id: str = ""
    cache_salt: str = ""
    priority: int = 0  # --scheduling-policy priority: lower first
    tenant: str = ""  # its caller's (frontend.api.tenant_of: the API key's name, or a trusted header's)
    max_priority: int = MIN_PRIORITY  # the most urgent priority its caller's API key grants (identity.Identity)
    chat_template_kwargs: dict = field(default_factory=dict)  # e.g. enable_thinking; reach the template as is
    chat_options: ChatOptions = field(default_factory=ChatOptions)
    add_special_tokens: bool = True  # a text prompt's ids get the special tokens (BOS...) the tokenizer's config asks
    fill_context: bool = False  # max_tokens unset (OpenAI chat): generate up to the context's end
    # Front-end settings of the text (they need the tokenizer or detokenized text, so they are not SamplingParams)
    bad_words: tuple[str, ...] = ()  # tokenized into sampling.bad_words_token_ids before admission
    include_stop_str_in_output: bool = False  # the stop string that ended a sample stays in its text
    skip_special_tokens: bool = True  # special tokens' text is left out (their ids are always returned)
    echo: bool = False  # the prompt's text comes first (completions' echo)
    # vLLM's truncate_prompt_tokens: keep only this many of the prompt's tokens (-1: as many as max_model_len leaves
    # room for), its last ones (truncation_side "left", the default) or its first ("right"); None: never truncated
    truncate_prompt_tokens: int | None = None
    truncation_side: str = "left"
