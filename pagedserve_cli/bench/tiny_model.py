"""The tiny random Llama that the tests and the benchmarks serve: two layers of width 64, fast on one CPU thread.
Served (save_tiny_served_model) it speaks the default model's vocabulary, with its tokenizer and chat template, so
text prompts, chat and stop strings work; its outputs are meaningless, its shapes and speed are what matter
(bench/load.py and bench/attack.py start a server over it when not given --model)."""

from __future__ import annotations

import shutil
from pathlib import Path

# NOTE: initializer_range 0.2: random weights peaked enough that greedy outputs vary with the context.
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, eos_token_id=None,
            bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def save_tiny_served_model(path: Path | str, tokenizer_dir: Path | str | None = None) -> str:
    """Writes the tiny served model into the folder `path` with the tokenizer files of `tokenizer_dir` (default: the
    default model's directory, pulled into the model cache if not there); returns `path` as a str."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    if tokenizer_dir is None:
        from pagedserve_common.defaults import DEFAULT_MODEL
        from worker_svc.model_store import resolve_model

        tokenizer_dir = resolve_model(DEFAULT_MODEL)
    src, path = Path(tokenizer_dir), Path(path)
    torch.manual_seed(0)
    config = LlamaConfig(**{**TINY, "vocab_size": 49152, "eos_token_id": 2, "bos_token_id": 1})
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, path / name)
    return str(path)
