"""Scheduler core: requests, per-step plans and the continuous-batching scheduler (no torch, no grpc)."""
