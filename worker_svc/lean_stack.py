"""The lean forward's decoder layers as one call into the CPU kernel library (lean_stack.cpp): for a step whose every
matmul runs on one of the library's kernels (the quantised ones, the panels, AMX), the layer loop of
lean_model.py's CPU path runs in C++, op for op, over scratch buffers allocated once a step.

Why: a lone decode step of the default model made ~300 Python -> C calls (10 a layer), each with its checks, a new
tensor and ctypes' argument conversion: ~1 ms of a ~6.5 ms step on one core (bench/lone_step.py). The output is the
Python loop's bit for bit (the same kernels, arguments and order; tests/worker/test_lean_stack.py); where a step or
a model is outside what the C++ loop covers (a matmul on torch, an 8-bit KV cache, QK norms, a long prefill chunk
that attention hands to SDPA), the Python loop runs it.
"""

from __future__ import annotations

import ctypes

import torch

from worker_svc.attention.cpu_backend import MAX_KERNEL_Q_LEN, NO_Q_LEN_LIMIT, POOL_DTYPES, Q_TILE, \
    CpuAttentionBackend
from worker_svc.cpu_build import load_library
from worker_svc.cpu_ops import FUSED_DTYPES, CpuOps
from worker_svc.linear import Linear
from worker_svc.quant.kernel import QuantKernel
from worker_svc.quant.linear import QuantLinear

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
# lean_stack.cpp's Kind: the kernel a matmul runs on
QUANT, QUANT_INT8, PANELS, AMX = 1, 2, 3, 4
UNBOUNDED = 2**62


class _Matmul(ctypes.Structure):
    _fields_ = [("kind", _i64), ("ggml_type", _i64), ("packed", _ptr), ("out_features", _i64), ("bias", _ptr)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Matmul), ("o", _Matmul), ("gate_up", _Matmul), ("down", _Matmul), ("post_norm", _ptr),
                ("next_norm", _ptr)]


class _Model(ctypes.Structure):
    _fields_ = [("bf16", _i64), ("num_layers", _i64), ("hidden", _i64), ("num_heads", _i64), ("num_kv_heads", _i64),
                ("head_dim", _i64), ("intermediate", _i64), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("layers", ctypes.POINTER(_Layer))]


class _Step(ctypes.Structure):
    _fields_ = [("num_tokens", _i64), ("kv", _ptr), ("kv_layer_bytes", _i64), ("num_blocks", _i64),
                ("block_size", _i64), ("pool_dtype", _i64), ("cos", _ptr), ("sin", _ptr), ("slots", _ptr),
                ("query_start_loc", _ptr), ("seq_lens", _ptr), ("block_tables", _ptr), ("block_table_stride", _i64),
                ("num_seqs", _i64), ("q_tile", _i64), ("max_q_len", _i64), ("batch_invariant", _i64)]


class _Scratch(ctypes.Structure):
    _fields_ = [(name, _ptr) for name in ("x", "h", "qkv", "attn", "proj", "gate_up", "act")]


_STAGES = {1: "the QKV matmul", 2: "the O matmul", 3: "the gate/up matmul", 4: "the down matmul",
           5: "the KV write (a slot outside the pool)", 6: "attention (shapes the kernel has no instance for)"}


def _matmul(lin, dtype: torch.dtype, in_features: int) -> tuple[_Matmul, int] | None:
    """lin's descriptor and the most rows it takes on that kernel, or None where it runs on torch (or a GPU) at every
    row count. NOTE: the choice linear.Linear.__call__ and QuantLinear.__call__ make, in their order (panels first,
    then AMX): a change there is a change here."""
    bias = getattr(lin, "bias", None)
    if bias is not None and (bias.dtype != dtype or not bias.is_contiguous() or bias.numel() != lin.out_features):
        return None  # NOTE: QuantLinear converts such a bias at each call: the Python loop's job
    bias_ptr = None if bias is None else bias.data_ptr()
    if isinstance(lin, QuantLinear):
        if len(lin.parts) != 1 or type(lin.kernel) is not QuantKernel:
            return None
        part = lin.parts[0]
        if part.packed.numel() != lin.kernel.packed_size(part.ggml_type, part.out_features, in_features):
            return None
        kind = QUANT_INT8 if lin.kernel.int8_activations else QUANT
        return _Matmul(kind, part.ggml_type, part.packed.data_ptr(), part.out_features, bias_ptr), UNBOUNDED
    if not isinstance(lin, Linear) or not isinstance(lin.ops, CpuOps):
        return None
    if lin.panels is not None and lin.panels.dtype == dtype and lin.panel_rows > 0 and \
            lin.panels.numel() == lin.ops.panel_size(lin.out_features, in_features):
        return _Matmul(PANELS, 0, lin.panels.data_ptr(), lin.out_features, bias_ptr), lin.panel_rows
    if lin.kind == "onednn" and lin.amx is not None and dtype == torch.bfloat16 and \
            lin.amx.numel() == lin.out_features * in_features:
        return _Matmul(AMX, 0, lin.amx.data_ptr(), lin.out_features, bias_ptr), lin.amx_rows
    return None


class LeanStack:
    """run(x, h, cos, sin, step) -> the last layer's down projection, with x updated in place (the caller adds the
    two); or None where this step is not one the C++ loop covers. Built by `build`."""

    def __init__(self, lib: ctypes.CDLL, model: _Model, layers, max_rows: int, dtype: torch.dtype,
                 sizes: tuple[int, int, int, int]) -> None:
        self._fn = lib.ps_lean_stack
        self._fn.argtypes, self._fn.restype = [ctypes.POINTER(_Model), ctypes.POINTER(_Step),
                                               ctypes.POINTER(_Scratch)], ctypes.c_int
        self._model, self._layers = model, layers  # NOTE: the structure array the model points into stays alive
        self.max_rows, self.dtype = max_rows, dtype
        self._hidden, self._qkv, self._attn, self._inter = sizes

    @classmethod
    def build(cls, lean) -> LeanStack | None:
        """The C++ loop for `lean` (a LeanModel), or None where its layers are not all on the library's kernels."""
        if lean.ops is None or lean.dtype not in FUSED_DTYPES:  # NOTE: the fused ops' dtypes, the pool's too
            return None
        if any(layer.q_norm is not None for layer in lean.layers) or not lean.layers:
            return None
        nh, nkv, hd = lean.num_heads, lean.num_kv_heads, lean.head_dim
        hidden = int(lean.layers[0].input_norm.numel())
        inter = lean.layers[0].gate_up.out_features // 2
        layers = (_Layer * len(lean.layers))()
        max_rows = UNBOUNDED
        for i, layer in enumerate(lean.layers):
            found = []
            for lin, k in ((layer.qkv, hidden), (layer.o, nh * hd), (layer.gate_up, hidden), (layer.down, inter)):
                got = _matmul(lin, lean.dtype, k)
                if got is None:
                    return None
                found.append(got[0])
                max_rows = min(max_rows, got[1])
            nxt = lean.layers[i + 1].input_norm.data_ptr() if i + 1 < len(lean.layers) else None
            layers[i] = _Layer(*found, layer.post_norm.data_ptr(), nxt)
        model = _Model(int(lean.dtype == torch.bfloat16), len(lean.layers), hidden, nh, nkv, hd, inter, lean.eps,
                       lean.scaling, layers)
        return cls(load_library(), model, layers, max_rows, lean.dtype, (hidden, (nh + 2 * nkv) * hd, nh * hd, inter))

    def run(self, x: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step) -> torch.Tensor | None:
        t = x.shape[0]
        kv, backend = step.kv, step.backend
        if t > self.max_rows or step.kv_scales is not None or step.layer_slots or type(backend) is not \
                CpuAttentionBackend or kv.dtype != self.dtype or not kv.is_contiguous() or x.dtype != self.dtype:
            return None
        if not (x.is_contiguous() and h.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()):
            return None  # NOTE: the forward makes them so; the kernels take plain rows
        args = backend.step_args(step.meta)
        max_q_len = NO_Q_LEN_LIMIT if backend.batch_invariant else MAX_KERNEL_Q_LEN
        if args.max_query_len > max_q_len or args.num_tokens != t or args.slots.shape[0] != t:
            return None
        empty = lambda n: torch.empty((t, n), dtype=self.dtype)  # noqa: E731
        qkv, attn, proj, gate_up, act = (empty(self._qkv), empty(self._attn), empty(self._hidden),
                                         empty(2 * self._inter), empty(self._inter))
        layer_bytes = kv.stride(0) * kv.element_size()
        run = _Step(t, kv.data_ptr(), layer_bytes, kv.shape[2], kv.shape[3], POOL_DTYPES[kv.dtype], cos.data_ptr(),
                    sin.data_ptr(), args.slots.data_ptr(), args.qsl_ptr, args.lens_ptr, args.bt_ptr, args.bt_stride,
                    args.num_seqs, Q_TILE, max_q_len, int(backend.batch_invariant))
        scratch = _Scratch(x.data_ptr(), h.data_ptr(), qkv.data_ptr(), attn.data_ptr(), proj.data_ptr(),
                           gate_up.data_ptr(), act.data_ptr())
        rc = self._fn(ctypes.byref(self._model), ctypes.byref(run), ctypes.byref(scratch))
        if rc != 0:
            layer, stage = divmod(rc, 100)
            error = IndexError if stage == 5 else ValueError
            raise error(f"the lean layer loop failed at layer {layer - 1}: {_STAGES.get(stage, rc)}")
        return proj
