"""Fixtures for worker tests: tiny random Llama, Qwen2, Qwen3 and Mistral checkpoints, and SmolLM2 itself."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from pagedserve_cli.bench.tiny_model import TINY
from worker_svc.model_store import resolve_model


def _save(tmp_path_factory, name: str, config) -> str:
    from transformers import AutoModelForCausalLM as Auto

    torch.manual_seed(0)
    model = Auto.from_config(config, dtype=torch.float32)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    return _save(tmp_path_factory, "tiny-llama", LlamaConfig(**TINY))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> str:
    return _save(tmp_path_factory, "tiny-qwen2", Qwen2Config(**TINY))


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> str:
    return _save(tmp_path_factory, "tiny-qwen3", Qwen3Config(**TINY, head_dim=16))


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory) -> str:
    return _save(tmp_path_factory, "tiny-mistral", MistralConfig(**TINY, sliding_window=None))


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct's directory, by name (the tests that use it are about that model, whatever the default)."""
    return str(resolve_model("smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def gemma3_dir() -> str:
    """Gemma 3 270M converted from its GGUF (tests.support.gemma3; skipped without the dev extra's package)."""
    from tests.support.gemma3 import gemma3_dir as converted

    return str(converted())
