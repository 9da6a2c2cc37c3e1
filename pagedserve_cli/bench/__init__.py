"""`pagedserve bench`: seeded workloads, streaming clients (ours over gRPC, OpenAI-compatible peers), reports."""
