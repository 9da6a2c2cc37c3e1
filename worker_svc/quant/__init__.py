"""Weights kept block-quantised as a GGUF file stores them (GGML's formats): the formats and a reference dequantiser
(formats), a quantised weight (weight), the raw blocks taken from a GGUF file at conversion (from_gguf) and stored
beside the float weights of a converted model dir (store); Hugging Face GPTQ / AWQ / compressed-tensors checkpoints'
int weights written as those blocks, exactly (from_hf, from_compressed, int_groups)."""

from worker_svc.quant.formats import FORMATS, FORMATS_BY_GGML_TYPE, QuantFormat, dequantize
from worker_svc.quant.weight import QuantWeight

__all__ = ["FORMATS", "FORMATS_BY_GGML_TYPE", "QuantFormat", "QuantWeight", "dequantize"]
