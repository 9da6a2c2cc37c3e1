"""Paged attention for the worker: per-step metadata, the backend interface, a torch backend and a reference."""

from worker_svc.attention.backend import AttentionBackend
from worker_svc.attention.metadata import AttentionMetadata
from worker_svc.attention.reference import reference_attention
from worker_svc.attention.torch_backend import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "reference_attention"]
