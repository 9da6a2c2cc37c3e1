"""Loads HuggingFace causal LMs with transformers and routes their attention to the paged KV pool."""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedserve_common.kv_geometry import KVGeometry
from worker_svc.checkpoint_tree import checkpoint_tree, static_rope
from worker_svc.cpu_features import NATIVE_BF16_FLAGS, cpu_flags, native_bf16_flags
from worker_svc.kv_pool import DTYPES
from worker_svc.quant.from_hf import load_hf_quantized
from worker_svc.quant.store import QUANTIZED_FILE, load_quantized
from worker_svc.quant.weight import QuantWeight
from worker_svc.resolved_config import ResolvedConfig, resolved_config
from worker_svc.weights import choose_activations, choose_weights

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
ATTN_IMPLEMENTATION = "pagedserve"
# NOTE: auto keeps blocks as stored on the CPU only, until cuda/quant_gemm.cu is measured on a GPU against the float
# matmuls it would replace (bench/gpu_quant_gemm.py); as-stored runs it there
GPU_AUTO_DEQUANTISES = "on a GPU auto dequantises: --weight-dtype as-stored runs the CUDA quantised kernel"


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *,
                            paged_step=None, sliding_window=None, **kwargs):
    """transformers' attention hook: write this layer's new K/V into the pool, attend through block tables.

    query is [1, heads, T, head_dim] over ALL sequences of the step packed together; key/value are
    [1, kv_heads, T, head_dim]. NOTE: transformers does not know the tokens belong to different sequences:
    the sequence boundaries come only from paged_step.meta (query_start_loc, seq_lens, block_tables), and its
    attention_mask (over the packed tokens as if one sequence) is ignored.
    sliding_window: what the layer passes its attention function (Gemma 3's sliding layers: config.sliding_window,
    its full ones and models without a window: None), the backend's window with transformers' meaning (the query
    at p sees keys p - window < q <= p).
    """
    if paged_step is None:
        raise RuntimeError("the pagedserve attention needs paged_step=StepContext(...) in the forward call")
    kv_layer, kv_scales, meta = paged_step.layer(module.layer_idx)
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    paged_step.backend.write_kv(kv_layer, k, v, meta.slot_mapping, kv_scales)
    out = paged_step.backend.forward(q, kv_layer, meta, scaling, kv_scales,
                                     window=int(sliding_window or 0))
    return out.unsqueeze(0), None


def use_paged_attention(model: torch.nn.Module) -> None:
    """Route a transformers model's attention to the paged KV pool (paged_attention_forward).

    NOTE: registered here, at the first transformers model, not at import: AttentionInterface is in transformers'
    modeling code, which a model kept quantised never loads (checkpoint_tree.py says what that saves)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)


@dataclass(slots=True)
class LoadedModel:
    model: torch.nn.Module
    model_id: str
    model_type: str
    dtype: torch.dtype
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    dtype_reason: str = ""  # why `dtype` (DtypeChoice.reason): "--dtype float32", "auto: the CPU has amx_bf16", ...
    # The weights kept quantised, by parameter name (their modules' parameters are on the meta device: only the lean
    # forward runs such a model); {} where every weight is a float tensor of the model. NOTE: build_lean releases the
    # ones it packs for the kernel (weights_reason keeps their count).
    quantized: dict[str, QuantWeight] = field(default_factory=dict)
    weights_reason: str = ""  # what runs and why (weights.WeightChoice.reason)
    runs_quantized: bool = False  # weights kept quantised at load: only the lean forward runs this model
    int8_activations: bool = False  # --activation-dtype int8: the quantised matmuls quantise their activations
    # The lean forwards built over this model, by batch_invariant (lean_build.build_lean): runners over one model share
    # them. NOTE: for a model kept quantised this is not only a saving: building one releases the blocks it packs.
    lean_models: dict = field(default_factory=dict)

    def kv_geometry(self, block_size: int, kv_cache_dtype: str = "auto") -> KVGeometry:
        """The pool's shape; kv_cache_dtype "auto" is the model's dtype."""
        dtype = str(self.dtype).removeprefix("torch.") if kv_cache_dtype == "auto" else kv_cache_dtype
        return KVGeometry.from_config(self.model.config.to_dict(), dtype, block_size)


@dataclass(slots=True, frozen=True)
class DtypeChoice:
    """The weights' dtype and why it was chosen (the worker's start-up line says both)."""

    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def checkpoint_dtype(config: dict) -> str:
    """The dtype config.json says the weights are stored in ("" where it says none)."""
    return str(config.get("dtype") or config.get("torch_dtype") or "").removeprefix("torch.")


def auto_cpu_dtype(flags: Collection[str], checkpoint: str) -> tuple[str, str]:
    """`--dtype auto` on the CPU, from its /proc/cpuinfo flags: (dtype, why). bfloat16 where the CPU computes it
    natively (AVX512-BF16 or AMX; its speed and accuracy against float32: docs/performance-history.md, "Which
    dtype `auto` picks"), else float32, whatever the checkpoint's dtype: an emulated 16-bit GEMM is slower than
    float32's."""
    native = native_bf16_flags(flags)
    if native:
        cast = f" (the {checkpoint} checkpoint cast to bfloat16)" if checkpoint in ("float16", "float64") else ""
        return "bfloat16", f"auto: the CPU has {' and '.join(native)}{cast}"
    why = f"the CPU has no {' or '.join(NATIVE_BF16_FLAGS)}, so 16-bit floats would be emulated"
    if checkpoint in ("float16", "bfloat16"):
        return "float32", f"auto: the checkpoint is {checkpoint}, but {why}"
    return "float32", f"auto: {why}"


def resolve_dtype(dtype: str, device: str, config: dict, flags: Collection[str] | None = None) -> DtypeChoice:
    """--dtype: as given; auto is the checkpoint's dtype on a GPU and auto_cpu_dtype(flags: this CPU's by default)
    on the CPU."""
    if dtype == "auto":
        if str(device).startswith("cuda"):
            dtype, reason = checkpoint_dtype(config) or "float16", "auto: the checkpoint's dtype on a GPU"
        else:
            dtype, reason = auto_cpu_dtype(cpu_flags() if flags is None else flags, checkpoint_dtype(config))
    else:
        reason = f"--dtype {dtype}"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {dtype!r}")
    return DtypeChoice(DTYPES[dtype], reason)


def gemma3_unsupported(cfg) -> str:
    """Why LeanGemma3 (lean_gemma3.py) cannot run a gemma3_text config ('' where it can)."""
    if getattr(cfg, "hidden_activation", None) != "gelu_pytorch_tanh":
        return f"hidden_activation {getattr(cfg, 'hidden_activation', None)!r} (lean Gemma 3: gelu_pytorch_tanh only)"
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        return "attention logit softcapping"
    if getattr(cfg, "use_bidirectional_attention", False):
        return "bidirectional attention"
    if any(t not in ("sliding_attention", "full_attention") for t in cfg.layer_types):
        return f"layer types {sorted(set(cfg.layer_types))}"
    if any((cfg.rope_parameters.get(t) or {}).get("rope_type", "default") != "default" for t in set(cfg.layer_types)):
        return "a rope scaling (lean Gemma 3: default rope only)"
    return ""


def lean_unsupported(cfg) -> str:
    """Why the lean forward (lean_model.py) cannot run a model of this transformers config ('' where it can)."""
    if getattr(cfg, "model_type", None) == "gemma3_text":  # its own lean forward, sliding layers included
        return gemma3_unsupported(cfg)
    if getattr(cfg, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(cfg, 'hidden_act', None)!r} (lean path: silu only)"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True) and \
            any(t == "sliding_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return "sliding-window layers"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    return ""


def _why_not_quantized(device: str, lean: bool, cfg) -> str:
    """Why the quantised kernel cannot run this model's quantised weights here ('' where it can)."""
    if device != "cpu" and not device.startswith("cuda"):
        return f"the quantised kernels run on the CPU or a CUDA GPU, not {device}"
    if not lean:
        return "--transformers-forward runs the transformers modules, which take float weights"
    unsupported = lean_unsupported(cfg)
    if unsupported:
        return f"the lean forward does not run this model ({unsupported})"
    if device.startswith("cuda"):  # cuda/quant_gemm.cu through CuPy (worker_svc/quant/cupy_kernel.py)
        import importlib.util

        return "" if importlib.util.find_spec("cupy") else "the GPU's quantised kernel runs through CuPy: not installed"
    from worker_svc.quant.kernel import shared_kernel  # NOTE: here: it builds the CPU kernel library

    if shared_kernel() is None:
        return "this CPU (or --cpu-path) has no quantised kernel: it needs AVX2, FMA and F16C"
    return ""


def _why_not_int8(device: str) -> str:
    """Why the int8-activation kernel cannot run here ('' where it can)."""
    if device != "cpu":
        return "the int8-activation kernel runs on the CPU (the GPU's quantised kernel takes float activations)"
    from worker_svc.quant.kernel import shared_kernel

    if shared_kernel(int8_activations=True) is None:
        return "this CPU (or --cpu-path) has no int8-activation kernel: it needs AVX2"
    return ""


def load_model(model_dir: str | Path, dtype: str = "auto", device: str = "cpu", model_id: str | None = None,
               weight_dtype: str = "auto", lean: bool = True, activation_dtype: str = "auto") -> LoadedModel:
    """The model of `model_dir` for `device`. lean: the lean forward will run it (else the transformers modules);
    weight_dtype, activation_dtype: --weight-dtype, --activation-dtype (worker_svc.weights)."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r} in {model_dir}/config.json; "
                         f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    hf_quantized = load_hf_quantized(model_dir, config)  # GPTQ / AWQ / compressed-tensors, read into GGML blocks
    quantized = hf_quantized.weights or load_quantized(model_dir)
    hf_config = resolved_config(model_dir) or _auto_config(model_dir)
    why_not = _why_not_quantized(device, lean, hf_config) if quantized else ""
    if quantized and not why_not and device.startswith("cuda") and weight_dtype == "auto":
        why_not = GPU_AUTO_DEQUANTISES
    weights = choose_weights(weight_dtype, dtype, quantized, why_not, hf_quantized.origin)
    int8_activations, activations_reason = choose_activations(activation_dtype, weights.keep_quantized,
                                                              _why_not_int8(device) if weights.keep_quantized else "")
    choice = resolve_dtype(weights.dtype, device, config)
    model, quantized = _build_model(model_dir, hf_config, choice.dtype, device, weights.keep_quantized, quantized,
                                    hf_quantized.tensor_names)
    model.eval()
    cfg = model.config
    eos_ids = _eos_token_ids(model_dir, cfg)
    return LoadedModel(model=model, model_id=model_id or str(model_dir), model_type=model_type,
                       dtype=choice.dtype, max_model_len=int(getattr(cfg, "max_position_embeddings", 2048)),
                       vocab_size=int(cfg.vocab_size), eos_token_ids=eos_ids, dtype_reason=choice.reason,
                       quantized=quantized, weights_reason=weights.reason + activations_reason,
                       runs_quantized=bool(quantized), int8_activations=int8_activations)


def _build_model(model_dir: Path, hf_config, dtype: torch.dtype, device: str, keep_quantized: bool,
                 quantized: dict[str, QuantWeight], packed_names: set[str]) -> tuple[torch.nn.Module, dict]:
    """(the model, the weights it keeps quantised). packed_names: a Hugging Face quantised checkpoint's tensors its
    quantised weights were read from (from_hf), never loaded as floats; where those are not kept, transformers
    would need the formats' own kernels, so they are dequantised here (exactly: QuantWeight.dequantize). A model kept
    quantised is the checkpoint's own module tree (checkpoint_tree.py) where its rope allows, else transformers'."""
    skip = set(quantized) | packed_names
    if keep_quantized and static_rope(hf_config):
        model = checkpoint_tree(model_dir, hf_config, dtype, quantized, _float_files(model_dir), device, packed_names)
        return model, quantized
    if isinstance(hf_config, ResolvedConfig):  # NOTE: transformers' modules take its own config class
        hf_config = _auto_config(model_dir)
    if keep_quantized:
        model = _model_without(model_dir, hf_config, dtype, skip, quantized, device)
    elif packed_names:
        model = _model_without(model_dir, hf_config, dtype, skip, quantized, device)
        for name, w in quantized.items():
            module_name, _, param = name.rpartition(".")
            setattr(model.get_submodule(module_name), param,
                    torch.nn.Parameter(w.dequantize().to(device=device, dtype=dtype), requires_grad=False))
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    use_paged_attention(model)
    return model, quantized if keep_quantized else {}


def _model_without(model_dir: Path, config, dtype: torch.dtype, skip: set[str],
                   quantized: dict[str, QuantWeight], device: str = "cpu") -> torch.nn.Module:
    """The model with every float tensor of `model_dir` but those named in `skip` (the quantised weights, which stay
    on the meta device: never allocated, never read, and the checkpoint's packed tensors they were read from) on
    `device`; each of `quantized` must be a parameter of the model's shape (ValueError naming it). NOTE: built on the
    meta device, so non-persistent buffers (the rotary embedding's inverse frequencies) are made again on `device`;
    anything else left unloaded is an error. (model.to(device) cannot run: a meta tensor has no data to copy.)"""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = {}
    for path in _float_files(model_dir):
        with safe_open(str(path), "pt") as f:
            state.update({name: f.get_tensor(name).to(device=device, dtype=dtype) for name in f.keys()
                          if name not in skip})
    model.load_state_dict(state, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):  # NOTE: assign=True replaced the embedding lm_head shares
        model.tie_weights()
    inner = model.model
    inner.rotary_emb = type(inner.rotary_emb)(config=model.config).to(device)  # NOTE: made outside the meta device
    embed = inner.embed_tokens
    if hasattr(embed, "scalar_embed_scale"):  # Gemma's scaled embedding: its scale is a non-persistent buffer too
        embed.embed_scale = torch.tensor(embed.scalar_embed_scale, device=device)
    params = dict(model.named_parameters())
    for name, w in quantized.items():
        if name not in params or tuple(params[name].shape) != w.shape:
            raise ValueError(f"{model_dir}: quantised weight {name} {list(w.shape)} is no parameter of that shape "
                             "of the model config.json describes")
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta and name not in skip]
    if left:
        raise ValueError(f"{model_dir}: no weights for {', '.join(left[:5])}{' ...' if len(left) > 5 else ''}")
    return model


def _float_files(model_dir: Path) -> list[Path]:
    return [path for path in sorted(model_dir.glob("*.safetensors")) if path.name != QUANTIZED_FILE]


def _auto_config(model_dir: Path):
    """transformers' config of `model_dir`. NOTE: imported here: `import transformers` alone holds ~22 MB of a worker
    that serves a converted model's blocks (resolved_config.py), which never needs it."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def _eos_token_ids(model_dir: Path, cfg) -> tuple[int, ...]:
    """What a sample stops at: generation_config.json's eos_token_id where the dir has one naming any (what
    transformers' generate stops at), else the config's; () where neither names one."""
    eos = cfg.eos_token_id
    path = model_dir / "generation_config.json"
    if path.is_file():
        try:
            named = json.loads(path.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError):
            raise ValueError(f"{path}: not a JSON object") from None
        eos = eos if named is None else named
    ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    if not all(type(i) is int and i >= 0 for i in ids):
        raise ValueError(f"{model_dir}: eos_token_id {eos!r} is not token ids")
    return ids
