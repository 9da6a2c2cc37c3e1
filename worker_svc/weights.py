"""Which weights a worker multiplies with (--weight-dtype): a checkpoint's quantised blocks as the file stores them
(worker_svc.quant: read by the quantised CPU kernel, never dequantised), or float weights (the checkpoint's floats,
or its blocks dequantised at conversion) in the compute dtype."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from pagedserve_common.config import ACTIVATION_DTYPES, WEIGHT_DTYPES
from pagedserve_common.startup import USAGE, StartupError
from worker_svc.quant.weight import QuantWeight


@dataclass(slots=True, frozen=True)
class WeightChoice:
    """keep_quantized: run the quantised weights as stored; dtype: the --dtype to resolve (a float --weight-dtype
    fixes it); reason: what the worker's start-up line says (weights_reason)."""

    keep_quantized: bool
    dtype: str
    reason: str


def describe(quantized: dict[str, QuantWeight], origin: str = "") -> str:
    """'210 q4_1, 1 q8_0': the quantised weights by format, most first; with an `origin` (a Hugging Face quantised
    checkpoint's): 'GPTQ 4-bit sym, group 128 as 210 q4_0'."""
    counts = Counter(w.format.name for w in quantized.values())
    formats = ", ".join(f"{n} {name}" for name, n in counts.most_common())
    return f"{origin} as {formats}" if origin else formats


def choose_weights(weight_dtype: str, dtype: str, quantized: dict[str, QuantWeight], why_not: str,
                   origin: str = "") -> WeightChoice:
    """--weight-dtype against the checkpoint's `quantized` weights; `why_not`: why the quantised kernel cannot run
    them here ('' where it can: a CPU with the kernel, the lean forward, a layout it knows); `origin`: what they
    were read from where that was not GGML blocks (from_hf.HfQuantized.origin).

    auto keeps them where it can, else dequantises (saying why); as-stored keeps them or refuses by name; bfloat16 /
    float32 dequantise into that dtype, which is then the compute dtype too (a --dtype other than it or auto is a
    usage error: the matmuls take weights and activations of one dtype). Refusals are StartupErrors naming the flag."""
    stored = describe(quantized, origin)
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"--weight-dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {weight_dtype!r}")
    if weight_dtype in ("bfloat16", "float32"):
        if dtype not in ("auto", weight_dtype):
            raise StartupError(f"--weight-dtype {weight_dtype} with --dtype {dtype}: the weights are dequantised into "
                               f"the compute dtype; pass --dtype {weight_dtype} or auto", USAGE)
        what = f"{stored} dequantised to {weight_dtype}" if quantized else "the checkpoint's floats"
        return WeightChoice(False, weight_dtype, f"--weight-dtype {weight_dtype}: {what}")
    if not quantized:
        return WeightChoice(False, dtype, "the checkpoint's floats (it stores no quantised weights)")
    if not why_not:
        return WeightChoice(True, dtype, f"{weight_dtype}: as stored ({stored})")
    if weight_dtype == "as-stored":
        raise StartupError(f"--weight-dtype as-stored: the quantised weights ({stored}) cannot run here: "
                           f"{why_not} (pass --weight-dtype auto, bfloat16 or float32 to dequantise them)")
    return WeightChoice(False, dtype, f"auto: {stored} dequantised ({why_not})")


def choose_activations(activation_dtype: str, keep_quantized: bool, why_not: str) -> tuple[bool, str]:
    """--activation-dtype against the weights chosen: (int8 activations, what the start-up line adds). `why_not`: why
    the int8-activation kernel cannot run here ('' where it can). int8 is refused by name where no weight is kept
    quantised (the float matmuls take float activations) or the kernel does not run; auto keeps float activations."""
    if activation_dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"--activation-dtype must be one of {', '.join(ACTIVATION_DTYPES)}, got {activation_dtype!r}")
    if activation_dtype == "auto":
        return False, ""
    if not keep_quantized:
        raise StartupError("--activation-dtype int8: no weight is kept quantised here, and the float matmuls take "
                           "float activations (pass --weight-dtype auto or as-stored with a quantised checkpoint)",
                           USAGE)
    if why_not:
        raise StartupError(f"--activation-dtype int8: {why_not} (pass --activation-dtype auto)")
    return True, "; activations int8 (--activation-dtype int8)"
