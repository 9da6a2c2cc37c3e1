"""Byte sizes as people write them: 1073741824, 512MiB, 80GiB, 2GB (parsed, and spelled back)."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BINARY = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte size: {text!r} (e.g. 1073741824, 512MiB, 80GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(num_bytes: int) -> str:
    """The largest binary unit that divides `num_bytes` exactly: 4194304 -> 4MiB (parse_bytes reads it back)."""
    for name, size in _BINARY:
        if num_bytes and num_bytes % size == 0:
            return f"{num_bytes // size}{name}"
    return str(num_bytes)
