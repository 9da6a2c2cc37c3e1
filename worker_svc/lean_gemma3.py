"""The lean forward of Gemma 3 text decoders (gemma3_text): LeanModel's fused weights (kept quantised where the GGUF
stores them so: the quantised kernel runs them as stored), over Gemma 3's own math, op for op as transformers'
modeling_gemma3 computes it in float32: the embedding scaled by sqrt(hidden_size), RMSNorm times (1 + weight) in
float32 (input, post-attention, pre- and post-feedforward, q and k norms), a rope base per layer type, attention
scaled by query_pre_attn_scalar ** -0.5 with each sliding layer's window, a GELU (tanh) gated MLP and the optional
final logit softcap."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker_svc.lean_model import LeanModel, _rotate
from worker_svc.quant.linear import QuantEmbedding


def _norm(x: torch.Tensor, weight1: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Gemma3RMSNorm, op for op, with weight1 = 1 + weight (float32) computed once."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight1).type_as(x)


def _plus_one(weight: torch.Tensor) -> torch.Tensor:
    return 1.0 + weight.detach().float()


class LeanGemma3(LeanModel):
    """forward(input_ids [T], positions [T], step, keep) -> logits [len(keep), vocab], as LeanModel."""

    def __init__(self, model: torch.nn.Module, batch_invariant: bool = False, quantized=None,
                 int8_activations: bool = False) -> None:
        super().__init__(model, batch_invariant, quantized, int8_activations)
        cfg = model.config
        inner = model.model
        self.ops = None  # NOTE: the fused CPU ops compute Llama's norm (times weight) and SiLU: not Gemma's
        self.stack = None  # NOTE: lean_stack.cpp's loop is Llama's
        if self.final_norm.device.type != "cpu":
            # NOTE: its (1 + weight) norms run on torch, whose row reductions on a GPU are configured by the row
            # count (cuda/dense_gemm.cu's norm is Llama's): not batch invariant there, whatever the matmuls
            self.batch_invariant = False
        self.embed_scale = inner.embed_tokens.embed_scale.detach().to(self.dtype)
        self.layer_types = list(cfg.layer_types)
        self.windows = [int(cfg.sliding_window) if t == "sliding_attention" else 0 for t in self.layer_types]
        self.norms = [tuple(_plus_one(w) for w in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                                                     layer.pre_feedforward_layernorm.weight,
                                                     layer.post_feedforward_layernorm.weight,
                                                     layer.self_attn.q_norm.weight, layer.self_attn.k_norm.weight))
                      for layer in inner.layers]
        self.final_norm1 = _plus_one(inner.norm.weight)
        self.softcap = cfg.final_logit_softcapping

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step, keep: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[0]
        nh, nkv, hd, eps = self.num_heads, self.num_kv_heads, self.head_dim, self.eps
        nq, nk = nh * hd, nkv * hd
        x = self.embed(input_ids) if isinstance(self.embed, QuantEmbedding) else F.embedding(input_ids, self.embed)
        x = x * self.embed_scale
        rope = {}
        for layer_type in set(self.layer_types):  # [T, 1, hd]: broadcast over heads
            cos, sin = self.rotary(x[None], positions[None], layer_type)
            rope[layer_type] = cos[0][:, None, :], sin[0][:, None, :]
        backend = step.backend
        for i, layer in enumerate(self.layers):
            input_norm, post_attn, pre_ff, post_ff, q_norm, k_norm = self.norms[i]
            qkv = layer.qkv(_norm(x, input_norm, eps))
            q = _norm(qkv[:, :nq].view(t, nh, hd), q_norm, eps)
            k = _norm(qkv[:, nq:nq + nk].view(t, nkv, hd), k_norm, eps)
            cos, sin = rope[self.layer_types[i]]
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            v = qkv[:, nq + nk:].view(t, nkv, hd)
            kv_layer, layer_scales, meta = step.layer(i)
            backend.write_kv(kv_layer, k, v, meta.slot_mapping, layer_scales)
            attn = backend.forward(q, kv_layer, meta, self.scaling, layer_scales, window=self.windows[i])
            x = x + _norm(layer.o(attn.reshape(t, nq)), post_attn, eps)
            gu = layer.gate_up(_norm(x, pre_ff, eps))
            inter = gu.shape[1] // 2
            mlp = layer.down(F.gelu(gu[:, :inter], approximate="tanh") * gu[:, inter:])
            x = x + _norm(mlp, post_ff, eps)
        logits = self.lm_head(_norm(x.index_select(0, keep), self.final_norm1, eps))  # rows independent past here
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
