"""The HTTP spellings of structured output (OpenAI's response_format, vLLM's guided_* and structured_outputs)."""

from __future__ import annotations

import json
from typing import Any

from pagedserve_common.sampling import StructuredOutput
from scheduler_svc.frontend.api import invalid

# vLLM's structured_outputs keys -> StructuredOutput kinds
_STRUCTURED_OUTPUTS_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                            "json_object": "json_object"}


def structured_output(body) -> tuple[StructuredOutput | None, str | None]:
    """(the body's structured output, the name of the field that set it), or (None, None). At most one spelling may
    be set: a second is a 400 naming it. Raises EngineError(INVALID_ARGUMENT) naming the field at fault."""
    found: list[tuple[str, StructuredOutput]] = []
    if body.response_format is not None and (so := _response_format(body.response_format)) is not None:
        found.append(("response_format", so))
    if body.guided_json is not None:
        found.append(("guided_json", StructuredOutput("json_schema", _schema_text(body.guided_json, "guided_json"))))
    if body.guided_regex is not None:
        found.append(("guided_regex", StructuredOutput("regex", body.guided_regex)))
    if body.guided_choice is not None:
        found.append(("guided_choice", StructuredOutput("choice", choices=tuple(body.guided_choice))))
    if body.guided_grammar is not None:
        found.append(("guided_grammar", StructuredOutput("grammar", body.guided_grammar)))
    if body.structured_outputs is not None and (so := _structured_outputs(body.structured_outputs)) is not None:
        found.append(("structured_outputs", so))
    if not found:
        return None, None
    if len(found) > 1:
        raise invalid(found[1][0], f"{found[1][0]}: {found[0][0]} already sets the structured output; set one of "
                                   "response_format, guided_json, guided_regex, guided_choice, guided_grammar and "
                                   "structured_outputs")
    param, so = found[0]
    return so, param


def _schema_text(schema: Any, name: str) -> str:
    if isinstance(schema, str):
        return schema  # NOTE: parsed (and refused naming the field) by the compiler
    if not isinstance(schema, dict):
        raise invalid(name, f"{name} must be a JSON schema (an object, or its JSON text)")
    return json.dumps(schema)


def _response_format(rf: dict) -> StructuredOutput | None:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind != "json_schema":
        raise invalid("response_format", f"response_format.type must be text, json_object or json_schema, got "
                                         f"{str(kind)[:40]!r}")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise invalid("response_format", "response_format.json_schema must be an object: {\"name\", \"schema\", "
                                         "\"strict\"}")
    if not isinstance(js.get("strict", False), bool | None):
        raise invalid("response_format", "response_format.json_schema.strict must be a boolean")
    # NOTE: strict or not, the output always matches the schema (the mask enforces it)
    schema = js.get("schema", {"type": "object"})
    return StructuredOutput("json_schema", _schema_text(schema, "response_format"))


def _structured_outputs(so: dict) -> StructuredOutput | None:
    given = [k for k, v in so.items() if v is not None and v is not False]
    unknown = [k for k in given if k not in _STRUCTURED_OUTPUTS_KEYS]
    if unknown:
        raise invalid("structured_outputs", f"structured_outputs.{str(unknown[0])[:40]} is not supported (one of "
                                            f"{', '.join(_STRUCTURED_OUTPUTS_KEYS)})")
    if len(given) > 1:
        raise invalid("structured_outputs", f"structured_outputs: set one of {', '.join(_STRUCTURED_OUTPUTS_KEYS)} "
                                            f"(got {' and '.join(given)})")
    if not given:
        return None
    key = given[0]
    value = so[key]
    kind = _STRUCTURED_OUTPUTS_KEYS[key]
    if kind == "json_schema":
        return StructuredOutput(kind, _schema_text(value, "structured_outputs"))
    if kind == "json_object":
        return StructuredOutput(kind)
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise invalid("structured_outputs", "structured_outputs.choice must be a list of strings")
        return StructuredOutput(kind, choices=tuple(value))
    if not isinstance(value, str):
        raise invalid("structured_outputs", f"structured_outputs.{key} must be a string")
    return StructuredOutput(kind, value)
