"""A GrammarCompiler for the default model's tokenizer, shared by the module's tests."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve_common.defaults import DEFAULT_MODEL
from scheduler_svc.frontend import Tokenizer
from scheduler_svc.structured import GrammarCompiler
from worker_svc.model_store import resolve_model

VOCAB = 49152
EOS = 2


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_model_dir(resolve_model(DEFAULT_MODEL))


@pytest.fixture(scope="session")
def compiler(tokenizer) -> GrammarCompiler:
    c = GrammarCompiler(tokenizer.to_json(), VOCAB, [EOS])
    yield c
    c.close()


@pytest.fixture(scope="session")
def compile_(compiler):
    """compile_(spec) -> Grammar, run to completion on a fresh event loop."""
    return lambda so: asyncio.run(compiler.compile(so))
