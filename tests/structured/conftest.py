"""A GrammarCompiler for the default model's tokenizer, shared by the module's tests."""

from __future__ import annotations

import asyncio

import pytest

from scheduler_svc.frontend import Tokenizer
from scheduler_svc.structured import GrammarCompiler
from tests.support.grammar import EOS, VOCAB


@pytest.fixture(scope="session")
def tokenizer(default_model) -> Tokenizer:
    return Tokenizer.from_model_dir(default_model)


@pytest.fixture(scope="session")
def compiler(tokenizer) -> GrammarCompiler:
    c = GrammarCompiler(tokenizer.to_json(), VOCAB, [EOS])
    yield c
    c.close()


@pytest.fixture(scope="session")
def compile_(compiler):
    """compile_(spec) -> Grammar, run to completion on a fresh event loop."""
    return lambda so: asyncio.run(compiler.compile(so))
