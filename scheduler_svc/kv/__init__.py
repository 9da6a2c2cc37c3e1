"""The KV block manager: block pool, prefix cache and per-request block tables (pure Python)."""
