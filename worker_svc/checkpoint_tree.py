"""A decoder's module tree built from its checkpoint alone, for the lean forward over weights kept quantised.

Why not transformers' modules: importing its modeling code (modeling_utils pulls scipy, sympy, torch._dynamo and
torch.distributed.tensor in) costs the worker ~120 MB resident for the process's life, and a model whose weights stay
quantised never runs those modules: the lean forward (lean_model.py, lean_gemma3.py) reads only the tree's
parameters by their checkpoint names, a few attention attributes, and the rotary embedding, which is computed here op
for op as transformers' (LlamaRotaryEmbedding, Gemma3RotaryEmbedding: float32 position x inverse frequency, cat,
cos/sin times the attention scaling, cast to the activations' dtype). A rope whose frequencies change with the
sequence (dynamic, longrope) has no tree here: load_model builds transformers' modules for it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from worker_svc.quant.weight import QuantWeight
from worker_svc.resolved_config import rope_parameters

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
STATIC_ROPES = ("default", "linear", "llama3", "yarn")  # inverse frequencies fixed at init


def static_rope(config) -> bool:
    """Whether every rope of `config` has fixed frequencies (RotaryEmbedding computes only those)."""
    return all((p or {}).get("rope_type", "default") in STATIC_ROPES for p in rope_parameters(config).values())


class RotaryEmbedding(nn.Module):
    """forward(x, position_ids, layer_type=None) -> (cos, sin), each [B, T, head_dim] in x's dtype."""

    def __init__(self, config) -> None:
        super().__init__()
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.tables: dict[str, tuple[torch.Tensor, float]] = {}
        for layer_type, params in rope_parameters(config).items():
            rope_type = params.get("rope_type", "default")
            if rope_type == "default":  # transformers' compute_default_rope_parameters
                inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
                scaling = 1.0
            else:
                from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # NOTE: no modeling code

                kwargs = {"layer_type": layer_type} if layer_type else {}
                inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, **kwargs)
            self.tables[layer_type] = (inv_freq, float(scaling))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None):
        inv_freq, scaling = self.tables[layer_type or ""]
        freqs = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scaling).to(dtype=x.dtype), (emb.sin() * scaling).to(dtype=x.dtype)


def checkpoint_tree(model_dir: Path, config, dtype: torch.dtype, quantized: dict[str, QuantWeight],
                    float_files: list[Path], device: str = "cpu", skip: set[str] = frozenset()) -> nn.Module:
    """The model as the lean forward reads it: `root.model.layers[i].self_attn.q_proj.weight`, ... by the checkpoint's
    names, float tensors from `float_files` (as `dtype`, on `device`) and, for the names in `quantized`, Linear
    weights on the meta device (never allocated: the quantised kernel runs them). A tied lm_head shares the
    embedding's weight. `skip`: tensors of the float files not to load (a GPTQ checkpoint's packed ones, which
    `quantized` was read from). Every weight must have the shape the config gives it (else a ValueError naming it)."""
    from safetensors import safe_open

    root = nn.Module()
    tensors: dict[str, torch.Tensor] = {}
    for path in float_files:
        with safe_open(str(path), "pt") as f:
            tensors.update({name: f.get_tensor(name).to(device=device, dtype=dtype) for name in f.keys()
                            if name not in quantized and name not in skip})
    tensors.update({name: torch.empty(w.shape, dtype=dtype, device="meta") for name, w in quantized.items()})
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    for name, tensor in sorted(tensors.items()):
        module_path, _, param = name.rpartition(".")
        _module(root, module_path, tensor if param == "weight" else None).register_parameter(
            param, nn.Parameter(tensor, requires_grad=False))
    inner = getattr(root, "model", None)
    if inner is None or len(getattr(inner, "layers", ())) != config.num_hidden_layers:
        raise ValueError(f"{model_dir}: the checkpoint's names do not hold {config.num_hidden_layers} decoder layers "
                         "under model.layers")
    if getattr(config, "tie_word_embeddings", False):
        root.lm_head = nn.Linear(1, 1, bias=False, device="meta")
        root.lm_head.weight = inner.embed_tokens.weight
    _check(model_dir, root, config)
    inner.rotary_emb = RotaryEmbedding(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    scalar = getattr(config, "query_pre_attn_scalar", None) if config.model_type == "gemma3_text" else None
    for layer in inner.layers:
        layer.self_attn.head_dim = head_dim
        layer.self_attn.scaling = (scalar or head_dim) ** -0.5
    if config.model_type == "gemma3_text":  # its embedding is scaled by sqrt(hidden_size), as transformers' buffer
        inner.embed_tokens.embed_scale = torch.tensor(config.hidden_size ** 0.5, device=device)
    root.config = config
    return root


def _module(root: nn.Module, path: str, weight: torch.Tensor | None) -> nn.Module:
    """The module at dotted `path`, made on the way: a ModuleList for a numeric part, a meta-device Linear (its
    weight replaced next) for a projection, else a plain Module."""
    module = root
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            index = int(part)
            while len(module) <= index:
                module.append(nn.Module())
            module = module[index]
            continue
        if not hasattr(module, part):
            last = i == len(parts) - 1
            if last and part in PROJECTIONS and weight is not None:
                child = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
            else:
                child = nn.ModuleList() if i + 1 < len(parts) and parts[i + 1].isdigit() else nn.Module()
            module.add_module(part, child)
        module = getattr(module, part)
    return module


def _check(model_dir: Path, root: nn.Module, config) -> None:
    """Every projection of every layer, the norms and the embedding are there, each of the shape the config gives
    it (else a ValueError naming one). NOTE: the dir may be the user's; a weight of another shape would otherwise
    surface as a kernel's error mid-step, or not at all."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, (config.num_key_value_heads or config.num_attention_heads) * head_dim
    want = {"model.embed_tokens.weight": (config.vocab_size, hidden), "model.norm.weight": (hidden,),
            "lm_head.weight": (config.vocab_size, hidden)}
    for i in range(len(root.model.layers)):
        shapes = {"self_attn.q_proj": (q, hidden), "self_attn.k_proj": (kv, hidden), "self_attn.v_proj": (kv, hidden),
                  "self_attn.o_proj": (hidden, q), "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
                  "mlp.down_proj": (hidden, inter), "input_layernorm": (hidden,), "post_attention_layernorm": (hidden,)}
        want.update({f"model.layers.{i}.{part}.weight": shape for part, shape in shapes.items()})
    have = dict(root.named_parameters(remove_duplicate=False))
    missing = [name for name in want if name not in have]
    if missing:
        raise ValueError(f"{model_dir}: no weights for {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    for name, shape in want.items():
        if tuple(have[name].shape) != shape:
            raise ValueError(f"{model_dir}: {name} is {list(have[name].shape)}; config.json makes it {list(shape)}")
