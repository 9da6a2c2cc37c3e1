"""The lean forward: Llama-family decoders run as plain torch ops over fused weights, without the HF modules.

Same math as transformers' modeling code (float32 greedy tokens match its generate: tests/worker): RMSNorm in
float32, rotate-half rotary from the model's own rotary embedding, SiLU-gated MLP; on the CPU the norms, residual
adds, SiLU product and rotary run as fused kernels (cpu_ops.py: torch's roundings, but the RMSNorm's sum in an order
of its own, so an ulp away at most there), and the matmuls as linear.py lays them out. What changes is the plumbing:
one QKV matmul and one gate/up matmul per layer over fused weights, no per-layer module calls, kwargs or
reshapes/transposes, and the packed [T, ...] layout end to end. A config outside what it knows (another
activation, sliding windows, ...) returns None from `lean_build.build_lean`, and the runner keeps the transformers path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker_svc.cpu_ops import FUSED_DTYPES, shared_ops
from worker_svc.dense_gpu import gpu_dense_kernel
from worker_svc.lean_stack import LeanStack
from worker_svc.linear import Linear, f32_copies_fit, make_linear, transposed
from worker_svc.quant.cupy_kernel import shared_gpu_kernel
from worker_svc.quant.kernel import shared_kernel
from worker_svc.quant.linear import QuantEmbedding, QuantLinear, quant_linear
from worker_svc.quant.weight import QuantWeight


@dataclass(slots=True)
class LeanLayer:
    qkv: Linear  # hidden -> (H + 2 KVH) * hd
    o: Linear
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None  # Qwen3: RMSNorm over each head before rotary
    k_norm: torch.Tensor | None


def _fuse(linears: list[torch.nn.Linear], cpu_layout: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One [sum(out), in] weight (and bias) for `linears`, whose own parameters become views into it.

    NOTE: the views keep the transformers modules working (and sharing memory) for the fallback path. A float32
    weight on the CPU is stored transposed (linear.py: what torch.mm wants), a view of it is returned.
    """
    weight = torch.cat([m.weight.detach() for m in linears])
    weight = _layout(weight) if cpu_layout else weight
    biases = [m.bias for m in linears]
    bias = torch.cat([b.detach() for b in biases]) if all(b is not None for b in biases) else None
    if bias is None and any(b is not None for b in biases):
        raise ValueError("mixed biases")
    at = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = torch.nn.Parameter(weight[at:at + n], requires_grad=False)
        if bias is not None:
            m.bias = torch.nn.Parameter(bias[at:at + n], requires_grad=False)
        at += n
    return weight, bias


def _layout(weight: torch.Tensor) -> torch.Tensor:
    return transposed(weight) if weight.device.type == "cpu" and weight.dtype == torch.float32 else weight


def _own(linear: torch.nn.Linear, f32_copy: bool, invariant: bool, dense_kernel) -> Linear:
    """A Linear over `linear`'s weight, re-laid out (the module keeps a view of the new storage)."""
    weight = _layout(linear.weight.detach()) if dense_kernel is None else linear.weight.detach()
    if weight.data_ptr() != linear.weight.data_ptr():
        linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    return make_linear(weight, _bias(linear), f32_copy=f32_copy, invariant=invariant, dense_kernel=dense_kernel)


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, op for op."""
    dtype = x.dtype
    xf = x.to(torch.float32)
    var = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(var + eps)).to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin for x [T, heads, hd], cos/sin [T, 1, hd]: transformers' exact ops."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LeanModel:
    """forward(input_ids [T], positions [T], step, keep) -> logits [len(keep), vocab].

    batch_invariant (asked for): every matmul on one M-invariant kernel (linear.invariant_linear on a CPU; on a GPU
    cuda/dense_gemm.cu, which also runs the RMSNorms, as torch's row reductions there are configured by the row
    count); the CPU's norms, and the adds, SiLU and rotary everywhere, are row by row already. `self.batch_invariant`
    says whether that held for every weight and norm (the kernels exist on this CPU, the float32 copies fit; CuPy on
    a GPU). dense_kernel (tests: the GPU's dense_gpu.CupyDenseKernel on the host shim) is that GPU kernel, used
    wherever the weights are (batch_invariant only)."""

    def __init__(self, model: torch.nn.Module, batch_invariant: bool = False,
                 quantized: dict[str, QuantWeight] | None = None, int8_activations: bool = False,
                 quant_kernel=None, dense_kernel=None) -> None:
        cfg = model.config
        self.model = model
        inner = model.model
        self.final_norm = inner.norm.weight
        self.dtype, device = self.final_norm.dtype, self.final_norm.device
        # quantised weights (by parameter name; their modules hold meta tensors): the quantised kernel runs them
        self._quant = quantized or {}
        self._int8_activations = int8_activations  # their matmuls' kernel (quant/kernel.py)
        # NOTE: quant_kernel (tests: the GPU kernel on the host shim) else by device: cuda/quant_gemm.cu on a GPU
        self._quant_kernel = quant_kernel
        if quant_kernel is None and self._quant and device.type == "cuda":
            self._quant_kernel = shared_gpu_kernel(device)
        if dense_kernel is not None and not batch_invariant:
            raise ValueError("dense_kernel: the batch-invariant matmul and norm, for batch_invariant=True only")
        # NOTE: the GPU's invariant matmuls and norms (None elsewhere, or without CuPy: torch's, not invariant)
        self._dense = dense_kernel if dense_kernel is not None else \
            gpu_dense_kernel(device) if batch_invariant else None
        self._names = {id(m): name for name, m in model.named_modules()}
        embed_name = self._names[id(inner.embed_tokens)] + ".weight"
        self.embed = QuantEmbedding(self._quant[embed_name], self.dtype) if embed_name in self._quant else \
            inner.embed_tokens.weight
        # float32 weights on the CPU: the panel kernel's copies (else oneDNN's for small calls) where they fit
        f32 = [m.weight for layer in inner.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)
               and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"]
        head = model.lm_head.weight
        head_f32 = head.dtype == torch.float32 and head.device.type == "cpu"
        f32_copy = bool(f32 or head_f32) and f32_copies_fit(sum(w.numel() * 4 for w in f32) +
                                                             head_f32 * head.numel() * 4)
        inv = batch_invariant
        head_name = self._names[id(model.lm_head)] + ".weight"
        if head_name not in self._quant and getattr(cfg, "tie_word_embeddings", False) and embed_name in self._quant:
            head_name = embed_name  # NOTE: tied: the lm_head multiplies by the embedding's blocks
        self.lm_head = self._quant_linear([head_name], None) if head_name in self._quant else \
            make_linear(head, None, vocab=True, f32_copy=f32_copy, invariant=inv, dense_kernel=self._dense)
        self.rotary = inner.rotary_emb
        self.eps = float(cfg.rms_norm_eps)
        first = inner.layers[0].self_attn
        self.head_dim = int(first.head_dim)
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(cfg.num_key_value_heads)
        self.scaling = float(first.scaling)
        cpu_ops = self.dtype in FUSED_DTYPES and device.type == "cpu" and self._dense is None
        self.ops = shared_ops() if cpu_ops else None
        if self.ops is not None and self.dtype == torch.float32 and not self.ops.vector_f32():
            self.ops = None  # a build without AVX2: its scalar SiLU is slower than torch's
        self.layers: list[LeanLayer] = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            self.layers.append(LeanLayer(
                self._linear([attn.q_proj, attn.k_proj, attn.v_proj], f32_copy, inv),
                self._linear([attn.o_proj], f32_copy, inv),
                self._linear([mlp.gate_proj, mlp.up_proj], f32_copy, inv),
                self._linear([mlp.down_proj], f32_copy, inv),
                layer.input_layernorm.weight.detach(),
                layer.post_attention_layernorm.weight.detach(),
                None if q_norm is None else q_norm.weight.detach(), None if k_norm is None else k_norm.weight.detach()))
        linears = [self.lm_head, *(lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up,
                                                                              layer.down))]
        norms_invariant = device.type == "cpu" or self._dense is not None
        self.batch_invariant = batch_invariant and norms_invariant and all(lin.invariant for lin in linears)
        self._quant = {}  # NOTE: packed into the kernels' panels: the blocks go (lean_build releases its own refs)
        # the layer loop in one C++ call where every matmul runs on the kernel library (None: the Python loop)
        self.stack = LeanStack.build(self) if device.type == "cpu" else None

    def _linear(self, modules: list[torch.nn.Linear], f32_copy: bool, invariant: bool) -> Linear | QuantLinear:
        """One matmul for `modules` side by side (a fused QKV or gate/up): on the quantised kernel where their weights
        are kept quantised, else over float weights laid out by linear.py (the modules keep views of them)."""
        names = [self._names[id(m)] + ".weight" for m in modules]
        kept = [name in self._quant for name in names]
        if all(kept):
            return self._quant_linear(names, _cat_bias(modules))
        if any(kept):  # NOTE: a checkpoint that stores some of a fused matmul's weights as floats: all as floats
            for m, name in zip(modules, names):
                if name in self._quant:
                    m.weight = torch.nn.Parameter(self._quant[name].dequantize().to(self.dtype), requires_grad=False)
        if len(modules) == 1:
            return _own(modules[0], f32_copy, invariant, self._dense)
        weight, bias = _fuse(modules, self._dense is None)
        return make_linear(weight, bias, f32_copy=f32_copy, invariant=invariant, dense_kernel=self._dense)

    def _quant_linear(self, names: list[str], bias: torch.Tensor | None) -> QuantLinear:
        kernel = self._quant_kernel or shared_kernel(self._int8_activations)
        if kernel is None:  # NOTE: models.load_model keeps weights quantised only where the kernel runs
            raise RuntimeError("quantised weights, and no quantised kernel on this CPU")
        return quant_linear([self._quant[name] for name in names], bias, kernel)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step, keep: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[0]
        nh, nkv, hd, eps = self.num_heads, self.num_kv_heads, self.head_dim, self.eps
        nq = nh * hd
        qk_v, q_k = (nh + nkv, nkv), (nh, nkv)
        x = self.embed(input_ids) if isinstance(self.embed, QuantEmbedding) else F.embedding(input_ids, self.embed)
        cos, sin = self.rotary(x[None], positions[None])
        ops = self.ops if x.dtype in FUSED_DTYPES and x.device.type == "cpu" else None
        if ops is not None:  # the CPU path: fused norms, residual adds, SiLU product and rotary
            cos2, sin2 = cos[0].contiguous(), sin[0].contiguous()  # [T, hd]
            h = ops.rms_norm(x, self.layers[0].input_norm, eps)
            down = None if self.stack is None else self.stack.run(x, h, cos2, sin2, step)
            if down is not None:  # NOTE: the loop below, op for op, in C++ (x updated in place)
                return self._head(x + down, keep)
        cos, sin = cos[0][:, None, :], sin[0][:, None, :]  # [T, 1, hd]: broadcast over heads
        kv, scales, meta, backend = step.kv, step.kv_scales, step.meta, step.backend
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            if ops is None:
                h = self._norm(x, layer.input_norm)
            # NOTE: [T, heads, hd] views split off one view of the QKV rows (view ops cost ~1 us each a layer)
            qk, v = layer.qkv(h).view(t, nh + 2 * nkv, hd).split_with_sizes(qk_v, 1)
            if ops is not None and layer.q_norm is None:
                ops.rope_(qk, cos2, sin2)  # q and k heads side by side
                q, k = qk.split_with_sizes(q_k, 1)
            else:
                q, k = qk.split_with_sizes(q_k, 1)
                if layer.q_norm is not None:
                    q, k = self._norm(q, layer.q_norm), self._norm(k, layer.k_norm)
                q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            layer_scales = None if scales is None else scales[i]
            backend.write_kv(kv[i], k, v, meta.slot_mapping, layer_scales)
            o = layer.o(backend.forward(q, kv[i], meta, self.scaling, layer_scales).reshape(t, nq))
            if ops is not None:
                h = ops.add_rms_norm(x, o, layer.post_norm, eps)  # NOTE: x += o in place
                down = layer.down(ops.silu_mul(layer.gate_up(h)))
                if i < last:
                    h = ops.add_rms_norm(x, down, self.layers[i + 1].input_norm, eps)
                else:
                    x = x + down
                continue
            x = x + o
            h = self._norm(x, layer.post_norm)
            gu = layer.gate_up(h)
            inter = gu.shape[1] // 2
            x = x + layer.down(F.silu(gu[:, :inter]) * gu[:, inter:])
        return self._head(x, keep)

    def _head(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = self._norm(x.index_select(0, keep), self.final_norm)  # NOTE: rows are independent past here
        return self.lm_head(x)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """LlamaRMSNorm of x's rows: on the GPU's invariant kernel where there is one, else torch's ops."""
        return _norm(x, weight, self.eps) if self._dense is None else self._dense.rms_norm(x, weight, self.eps)


def _bias(linear: torch.nn.Linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach()


def _cat_bias(modules: list[torch.nn.Linear]) -> torch.Tensor | None:
    """The biases of `modules` side by side (None where none has one)."""
    biases = [_bias(m) for m in modules]
    if all(b is None for b in biases):
        return None
    if any(b is None for b in biases):
        raise ValueError("mixed biases")
    return torch.cat(biases)
