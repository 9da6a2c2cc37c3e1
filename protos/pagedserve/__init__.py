"""Generated protobuf modules of the pagedserve.v1 API (import as pagedserve.v1)."""
