"""Records vLLM's request fields into vllm_request_fields.json (run with a vLLM install; CI has none)."""

# Usage: /path/to/vllm/python tests/service/record_vllm_fields.py

from __future__ import annotations

import json
import typing
from pathlib import Path

import vllm

try:  # NOTE: the module path moved between vLLM versions
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
except ImportError:
    from vllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest


def _fields_of(annotation) -> set[str]:
    """The field names of a pydantic model or TypedDict annotation (unions and Optional unwrapped)."""
    out: set[str] = set()
    for t in typing.get_args(annotation) or (annotation,):
        if hasattr(t, "model_fields"):
            out |= set(t.model_fields)
        elif isinstance(t, type) and issubclass(t, dict) and hasattr(t, "__annotations__"):
            out |= set(typing.get_type_hints(t))
    return out


def main() -> None:
    chat = ChatCompletionRequest.model_fields
    (message,) = typing.get_args(chat["messages"].annotation)
    record = {
        "vllm_version": vllm.__version__,
        "completions": sorted(CompletionRequest.model_fields),
        "chat": sorted(chat),
        "messages": sorted(_fields_of(message)),
        "stream_options": sorted(_fields_of(chat["stream_options"].annotation)),
    }
    path = Path(__file__).with_name("vllm_request_fields.json")
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path} (vLLM {vllm.__version__})")


if __name__ == "__main__":
    main()
