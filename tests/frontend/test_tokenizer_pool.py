"""TokenizerPool: long inputs are tokenized in processes of their own, equal to the inline tokenizer's ids."""

from __future__ import annotations

import asyncio
import functools

import pytest

from scheduler_svc.errors import EngineError, ErrorCode
from scheduler_svc.frontend import Tokenizer
from scheduler_svc.frontend.inputs import ChatOptions
from scheduler_svc.frontend.pool import INLINE_CHARS, INLINE_TOKENS, TokenizerPool
from scheduler_svc.frontend.tokenizer import FinalMessageError
from tests.support.network import default_model_dir

LONG = "The quick brown fox jumps over the lazy dog. " * (INLINE_CHARS // 20)


@functools.cache
def tokenizer() -> Tokenizer:
    return Tokenizer.from_model_dir(default_model_dir())


def run(coro):
    return asyncio.run(coro)


def test_a_long_prompt_in_a_process_gives_the_inline_ids():
    pool = TokenizerPool(tokenizer(), num_processes=1)
    try:
        assert len(LONG) >= INLINE_CHARS
        assert run(pool.encode(LONG, 10_000)) == tokenizer().encode(LONG)
        assert pool._executor is not None  # it went to the process
        messages = [{"role": "user", "content": LONG}]
        assert run(pool.encode_chat(messages, {}, 10_000)) == tokenizer().encode_chat(messages)
        assert pool.num_pending == 0
    finally:
        pool.shutdown()


def test_chat_options_reach_a_tokenizer_process_and_its_refusal_comes_back():
    pool = TokenizerPool(tokenizer(), num_processes=1)
    try:
        messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": LONG}]
        options = ChatOptions(add_generation_prompt=False, continue_final_message=True, add_special_tokens=True)
        ids = run(pool.encode_chat(messages, {}, 10_000, options))
        assert pool._executor is not None  # it went to the process
        assert ids == tokenizer().encode_chat(messages, add_generation_prompt=False, continue_final_message=True,
                                              add_special_tokens=True)
        assert ids != run(pool.encode_chat(messages, {}, 10_000))  # the default: a new assistant turn
        assert run(pool.encode("x " + LONG, 10_000, add_special_tokens=False)) == \
            tokenizer().encode("x " + LONG, add_special_tokens=False)
        none_content = [{"role": "user", "content": LONG}, {"role": "assistant", "content": None}]
        with pytest.raises(FinalMessageError, match="no text content"):
            run(pool.encode_chat(none_content, {}, 10_000, options))
        assert pool.num_pending == 0
    finally:
        pool.shutdown()


def test_a_long_decode_in_a_process_gives_the_inline_text():
    pool = TokenizerPool(tokenizer(), num_processes=1)
    try:
        ids = tokenizer().encode_chat([{"role": "user", "content": LONG}])  # special tokens among the text
        assert len(ids) >= INLINE_TOKENS
        for skip in (True, False):
            assert run(pool.decode(ids, skip)) == tokenizer().decode(ids, skip_special_tokens=skip)
        assert pool._executor is not None and pool.num_pending == 0
        assert run(pool.decode(ids[:5], False)) == tokenizer().decode(ids[:5], skip_special_tokens=False)
    finally:
        pool.shutdown()


def test_beyond_max_tokens_only_the_count_comes_back():
    pool = TokenizerPool(tokenizer(), num_processes=1)
    try:
        n = len(tokenizer().encode(LONG))
        assert run(pool.encode(LONG, n - 1)) == n
        assert run(pool.encode("short text", 1)) == len(tokenizer().encode("short text"))
    finally:
        pool.shutdown()


def test_a_short_prompt_stays_inline():
    pool = TokenizerPool(tokenizer())
    assert run(pool.encode("Hello there", 100)) == tokenizer().encode("Hello there")
    assert pool._executor is None


def test_more_than_max_pending_long_prompts_is_resource_exhausted():
    pool = TokenizerPool(tokenizer(), num_processes=1, max_pending=2)

    async def main():
        first = [asyncio.ensure_future(pool.encode(LONG * 20, 10**6)) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(EngineError) as err:
            await pool.encode(LONG, 10**6)
        assert err.value.code is ErrorCode.RESOURCE_EXHAUSTED
        assert all(isinstance(ids, list) for ids in await asyncio.gather(*first))
        assert pool.num_pending == 0
        assert isinstance(await pool.encode(LONG, 10**6), list)  # room again

    try:
        run(main())
    finally:
        pool.shutdown()
