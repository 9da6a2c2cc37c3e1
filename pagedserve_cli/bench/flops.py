"""The model's FLOPs per forwarded token and per run, from a decoder's config.json (pure arithmetic, no torch)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True, frozen=True)
class ModelShape:
    """What the FLOP count needs of a Llama-like decoder (GQA attention, gated MLP)."""

    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, cfg: dict) -> ModelShape:
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(hidden, int(cfg["intermediate_size"]), int(cfg["num_hidden_layers"]), num_heads,
                   int(cfg.get("num_key_value_heads") or num_heads),
                   int(cfg.get("head_dim") or hidden // num_heads), int(cfg["vocab_size"]))

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelShape:
        return cls.from_config(json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8")))

    def gemms(self) -> dict[str, tuple[int, int]]:
        """The per-token matmuls as the worker runs them (lean_model: q/k/v fused, gate/up fused): name -> (K, N)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {"qkv": (self.hidden, q + 2 * kv), "o_proj": (q, self.hidden),
                "gate_up": (self.hidden, 2 * self.intermediate), "down": (self.intermediate, self.hidden),
                "lm_head": (self.hidden, self.vocab)}

    @property
    def layer_matmul_params(self) -> int:
        return sum(k * n for name, (k, n) in self.gemms().items() if name != "lm_head")

    @property
    def linear_flops(self) -> int:
        """2 x the non-embedding matmul weights of every layer: what each forwarded token costs in the linears."""
        return 2 * self.num_layers * self.layer_matmul_params

    @property
    def lm_head_flops(self) -> int:
        """One row of the lm_head (hidden x vocab): paid only by the rows that are sampled."""
        return 2 * self.hidden * self.vocab

    def attention_flops(self, first: int, last: int) -> int:
        """QK^T and PV (2 + 2 FLOPs per query head, head_dim element and key) of every layer, for the tokens at
        positions first..last-1, the one at position p seeing p + 1 keys (causal, itself included)."""
        if last <= first:
            return 0
        keys = (last * (last + 1) - first * (first + 1)) // 2  # sum of p + 1 over first <= p < last
        return 4 * self.num_layers * self.num_heads * self.head_dim * keys


@dataclass(slots=True)
class RunFlops:
    """A run's forwarded tokens and their FLOPs, by kind."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    sampled_rows: int = 0
    linear: int = 0
    attention: int = 0
    lm_head: int = 0

    @property
    def total(self) -> int:
        return self.linear + self.attention + self.lm_head


def request_flops(shape: ModelShape, prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> RunFlops:
    """What the server computes for one request: the prompt's positions past its prefix-cache hits, then every
    output token but the last (the last is sampled, never fed back); the lm_head only for the rows that sample
    (the prompt's last position and each decode token: one row per output token)."""
    cached = min(max(cached_tokens, 0), max(prompt_tokens - 1, 0))  # NOTE: the last prompt token always runs
    prefill, decode = prompt_tokens - cached, max(output_tokens - 1, 0)
    forwarded = prefill + decode
    return RunFlops(prefill, decode, output_tokens, forwarded * shape.linear_flops,
                    shape.attention_flops(cached, cached + forwarded), output_tokens * shape.lm_head_flops)


def run_flops(shape: ModelShape, requests: list[tuple[int, int]], hit_tokens: float = 0.0) -> RunFlops:
    """The sum over (prompt_tokens, output_tokens) of every request that produced a token. The run's prefix-cache
    hits (a counter: not per request) are spread over the requests in proportion to their prompts: exact for the
    linears and the lm_head, and for attention whenever the hits are 0."""
    total_prompt = sum(p for p, _ in requests)
    rate = min(max(hit_tokens, 0.0) / total_prompt, 1.0) if total_prompt else 0.0
    out = RunFlops()
    for prompt, output in requests:
        r = request_flops(shape, prompt, output, round(prompt * rate))
        out.prefill_tokens += r.prefill_tokens
        out.decode_tokens += r.decode_tokens
        out.sampled_rows += r.sampled_rows
        out.linear += r.linear
        out.attention += r.attention
        out.lm_head += r.lm_head
    return out
