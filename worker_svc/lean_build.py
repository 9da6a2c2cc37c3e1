"""Which lean forward runs a loaded model (the Llama family's, lean_model.LeanModel, or Gemma 3's,
lean_gemma3.LeanGemma3), built once per model and batch_invariant setting and shared by the runners over it."""

from __future__ import annotations

from worker_svc.lean_gemma3 import LeanGemma3
from worker_svc.lean_model import LeanModel
from worker_svc.models import LoadedModel, lean_unsupported
from worker_svc.quant.linear import QuantEmbedding
from worker_svc.quant.store import remapped


def build_lean(loaded: LoadedModel, batch_invariant: bool = False) -> tuple[LeanModel | None, str]:
    """A LeanModel for `loaded` (batch_invariant: see LeanModel), or None and the reason the transformers path must
    run it."""
    unsupported = lean_unsupported(loaded.model.config)
    if unsupported:
        return None, unsupported
    inner = getattr(loaded.model, "model", None)
    if inner is None or not hasattr(inner, "rotary_emb") or not hasattr(loaded.model, "lm_head"):
        return None, "not a Llama-family decoder layout"
    if batch_invariant in loaded.lean_models:
        return loaded.lean_models[batch_invariant], ""
    if loaded.runs_quantized and loaded.lean_models:
        raise ValueError("this model's quantised weights were packed for a lean forward with the other batch_invariant "
                         "setting, and their blocks released: load the model again for this one")
    if loaded.model_type == "gemma3_text":
        lean = LeanGemma3(loaded.model, batch_invariant, loaded.quantized, loaded.int8_activations)
    else:
        lean = LeanModel(loaded.model, batch_invariant, loaded.quantized, loaded.int8_activations)
    loaded.lean_models[batch_invariant] = lean
    # NOTE: the blocks packed into the kernel's panels are released (the panels replace them); an embedding kept
    # quantised still reads its rows from them
    if isinstance(lean.embed, QuantEmbedding):
        embedding = lean.embed.weight
        lean.embed.weight = remapped(embedding)  # NOTE: its rows' pages only, not the whole file's
        loaded.quantized = {name: lean.embed.weight for name, w in loaded.quantized.items() if w is embedding}
    else:
        loaded.quantized = {}
    return lean, ""
