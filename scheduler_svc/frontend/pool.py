"""Tokenizing off the event loop: long inputs go to tokenizer processes, with a bounded number waiting."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import signal
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from scheduler_svc.errors import EngineError, ErrorCode
from scheduler_svc.frontend.inputs import ChatOptions
from scheduler_svc.frontend.tokenizer import Tokenizer

# NOTE: tokenizing ~4,000 characters takes about 1 ms on a slow core: below that, a trip to another process and
# back costs more than it saves, and the loop is held no longer than a step's bookkeeping.
INLINE_CHARS = 4096
INLINE_TOKENS = INLINE_CHARS // 4  # decoding: about as many characters

_tokenizer: Tokenizer | None = None  # in a tokenizer process: its own copy


def _load(model_dir: str, chat_template: str | None) -> None:
    global _tokenizer
    # NOTE: Ctrl-C reaches the whole process group: the scheduler shuts this process down itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _tokenizer = Tokenizer.from_model_dir(model_dir)
    _tokenizer.chat_template = chat_template  # NOTE: the scheduler's (--chat-template may replace the model's)


def _capped(ids: list[int], max_tokens: int) -> list[int] | int:
    # NOTE: an over-long prompt comes back as its length only: a million ids would cost the loop their unpickling.
    return ids if len(ids) <= max_tokens else len(ids)


def _encode(text: str, add_special_tokens: bool, max_tokens: int) -> list[int] | int:
    return _capped(_tokenizer.encode(text, add_special_tokens=add_special_tokens), max_tokens)


def _chat_ids(tokenizer: Tokenizer, messages: list[dict], template_kwargs: dict, options: ChatOptions) -> list[int]:
    return tokenizer.encode_chat(messages, add_generation_prompt=options.add_generation_prompt,
                                 continue_final_message=options.continue_final_message,
                                 add_special_tokens=options.add_special_tokens, **template_kwargs)


def _encode_chat(messages: list[dict], template_kwargs: dict, options: ChatOptions, max_tokens: int) -> list[int] | int:
    return _capped(_chat_ids(_tokenizer, messages, template_kwargs, options), max_tokens)


def _decode(ids: list[int], skip_special_tokens: bool) -> str:
    return _tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class TokenizerPool:
    """Tokenizes long prompts in `num_processes` processes of their own, each with its own tokenizer.

    NOTE: processes, not threads: `tokenizers` holds the GIL for much of a long encode when other threads use the
    interpreter (measured: with 8 prompts of 4 MB on two threads, the gRPC server answered nothing for 9-35 s),
    and Jinja templates are pure Python. At most `max_pending` inputs wait or run at once; beyond that a request
    gets RESOURCE_EXHAUSTED at once. A short input is tokenized inline by the caller's tokenizer.
    Results are the ids, or only their number when there are more than `max_tokens` (the caller refuses those)."""

    def __init__(self, tokenizer: Tokenizer, num_processes: int = 2, max_pending: int = 64) -> None:
        self.tokenizer = tokenizer
        self.num_processes = num_processes
        self.max_pending = max_pending
        self.num_pending = 0
        self._lock = threading.Lock()
        self._executor: ProcessPoolExecutor | None = None

    async def encode(self, text: str, max_tokens: int, add_special_tokens: bool = True) -> list[int] | int:
        if len(text) < INLINE_CHARS or self.tokenizer.model_dir is None:
            return _capped(self.tokenizer.encode(text, add_special_tokens=add_special_tokens), max_tokens)
        return await self._run(_encode, text, add_special_tokens, max_tokens)

    async def encode_chat(self, messages: list[dict], template_kwargs: dict, max_tokens: int,
                          options: ChatOptions = ChatOptions()) -> list[int] | int:
        size = sum(len(m.get("content") or "") + 64 for m in messages)  # 64: a turn's markup, roughly
        if template_kwargs or any("tool_calls" in m for m in messages):  # NOTE: tools' schemas, calls' arguments
            size += len(json.dumps([template_kwargs, [m.get("tool_calls") for m in messages]], default=str))
        if size < INLINE_CHARS or self.tokenizer.model_dir is None:
            return _capped(_chat_ids(self.tokenizer, messages, template_kwargs, options), max_tokens)
        return await self._run(_encode_chat, messages, template_kwargs, options, max_tokens)

    async def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """A prompt's text (echo); a long one decoded in a tokenizer process."""
        if len(ids) < INLINE_TOKENS or self.tokenizer.model_dir is None:
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return await self._run(_decode, ids, skip_special_tokens)

    async def _run(self, fn, *args) -> Any:
        with self._lock:
            if self.num_pending >= self.max_pending:
                raise EngineError(ErrorCode.RESOURCE_EXHAUSTED, f"{self.num_pending} long prompts are being "
                                  "tokenized already; retry later")
            self.num_pending += 1
            if self._executor is None:  # NOTE: started on first use: most deployments never send a long prompt
                self._executor = ProcessPoolExecutor(
                    self.num_processes, mp_context=multiprocessing.get_context("spawn"), initializer=_load,
                    initargs=(str(self.tokenizer.model_dir), self.tokenizer.chat_template))
            executor = self._executor
        try:
            job = executor.submit(fn, *args)
        except BrokenProcessPool:
            self._done(None)
            self._restart(executor)
            raise EngineError(ErrorCode.UNAVAILABLE, "a tokenizer process died; retry") from None
        # NOTE: the count drops when the process is done, not when the caller stops waiting (a cancelled
        # request): the work is under way anyway, so the bound holds on the work actually queued.
        job.add_done_callback(self._done)
        try:
            return await asyncio.wrap_future(job)
        except BrokenProcessPool:
            self._restart(executor)
            raise EngineError(ErrorCode.UNAVAILABLE, "a tokenizer process died; retry") from None

    def _done(self, _job) -> None:
        with self._lock:
            self.num_pending -= 1

    def _restart(self, broken: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._executor is broken:
                self._executor = None
        broken.shutdown(wait=False, cancel_futures=True)

    def shutdown(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
