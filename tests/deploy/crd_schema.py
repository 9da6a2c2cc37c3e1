"""A CustomResourceDefinition's published schema as a strict JSON-schema validator, and its CEL rules evaluated."""

import copy
import functools
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass

import celpy
import jsonschema
import yaml

CRDS = pathlib.Path(__file__).resolve().parent / "crds"

# NOTE: ObjectMeta is not in a CRD's schema (the API server checks it itself); these are the fields a manifest sets.
METADATA = {"type": "object", "additionalProperties": False, "required": ["name"], "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 253},
    "namespace": {"type": "string", "minLength": 1, "maxLength": 63},
    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
    "annotations": {"type": "object", "additionalProperties": {"type": "string"}}}}


@dataclass(slots=True, frozen=True)
class Rule:
    """An x-kubernetes-validations rule and the path of the value it is evaluated on."""
    path: str
    rule: str
    message: str


@functools.cache
def load(file: str) -> dict:
    """NOTE: shared between callers: read it, never change it."""
    return yaml.safe_load((CRDS / file).read_text())


def header(file: str) -> dict:
    """The vendoring comment: {'Source': URL, 'Version': ..., 'License': ...}."""
    lines = (CRDS / file).read_text().splitlines()
    return dict(line[2:].split(": ", 1) for line in lines if line.startswith("# ") and ": " in line)


def version_schema(crd: dict, api_version: str, kind: str) -> dict:
    group, version = api_version.split("/")
    assert (crd["spec"]["group"], crd["spec"]["names"]["kind"]) == (group, kind), "not this kind's CRD"
    [served] = [v for v in crd["spec"]["versions"] if v["name"] == version]
    assert served["served"], f"{api_version} is not served"
    return served["schema"]["openAPIV3Schema"]


def strict(schema: dict) -> dict:
    """NOTE: the API server's strict field validation (kubectl's default) rejects a field the structural schema does
    not name, unless x-kubernetes-preserve-unknown-fields says otherwise: additionalProperties: false says the same
    to jsonschema. CEL rules and formats are left to rules()."""
    out = copy.copy(schema)
    if "properties" in out:
        out["properties"] = {k: strict(v) for k, v in out["properties"].items()}
        if "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = strict(out["additionalProperties"])
    if "items" in out:
        out["items"] = strict(out["items"])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in out:
            out[key] = [strict(s) for s in out[key]]
    return out


def validator(crd: dict, api_version: str, kind: str) -> jsonschema.Draft7Validator:
    schema = strict(version_schema(crd, api_version, kind))
    schema["properties"] = {**schema["properties"], "metadata": METADATA,
                            "apiVersion": {"const": api_version}, "kind": {"const": kind}}
    schema["required"] = sorted({*schema.get("required", ()), "apiVersion", "kind", "metadata"})
    schema["properties"].pop("status", None)  # a manifest has no status: the controllers write it
    return jsonschema.Draft7Validator(schema)


def errors(crd: dict, doc: dict) -> list[str]:
    found = validator(crd, doc["apiVersion"], doc["kind"]).iter_errors(doc)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in found]


def rules(schema: dict, value, path: str = "") -> Iterator[Rule]:
    """The CEL rules that apply to `value` (present fields only, as the API server evaluates them)."""
    for r in schema.get("x-kubernetes-validations", ()):
        yield Rule(path or "/", r["rule"], r.get("message", ""))
    if isinstance(value, dict):
        for key, sub in value.items():
            if key in schema.get("properties", {}):
                yield from rules(schema["properties"][key], sub, f"{path}/{key}")
            elif isinstance(schema.get("additionalProperties"), dict):
                yield from rules(schema["additionalProperties"], sub, f"{path}/{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            yield from rules(schema["items"], item, f"{path}/{i}")


def defaulted(schema: dict, value):
    """`value` with the schema's defaults filled in, as the API server does before it evaluates CEL rules."""
    if isinstance(value, dict):
        props = schema.get("properties", {})
        out = {k: defaulted(props.get(k, schema.get("additionalProperties") or {}), v) for k, v in value.items()}
        for key, sub in props.items():
            if key not in out and "default" in sub:
                out[key] = defaulted(sub, copy.deepcopy(sub["default"]))
        return out
    if isinstance(value, list):
        return [defaulted(schema.get("items", {}), v) for v in value]
    return value


# NOTE: Kubernetes' escaping of property names in CEL (KEP-2876): reserved words become __word__, and _ . - / in a
# name become __underscores__, __dot__, __dash__, __slash__.
_RESERVED = {"true", "false", "null", "in", "as", "break", "const", "continue", "else", "for", "function", "if",
             "import", "let", "loop", "package", "namespace", "return", "var", "void", "while"}
_ESCAPES = {"__": "__underscores__", ".": "__dot__", "-": "__dash__", "/": "__slash__"}


def cel_name(key: str) -> str:
    if key in _RESERVED:
        return f"__{key}__"
    for raw, escaped in _ESCAPES.items():
        key = key.replace(raw, escaped)
    return key


def cel_value(value):
    if isinstance(value, dict):
        return {cel_name(k): cel_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [cel_value(v) for v in value]
    return value


def _at(value, path: str):
    for key in filter(None, path.split("/")):
        value = value[int(key)] if isinstance(value, list) else value[key]
    return value


@functools.cache
def _program(rule: str):
    env = celpy.Environment()
    return env.program(env.compile(rule))


def cel_failures(crd: dict, doc: dict) -> list[str]:
    """Every CEL rule on a field `doc` sets that does not evaluate to true on create (an evaluation error included).
    NOTE: transition rules (oldSelf) run on update only."""
    schema = version_schema(crd, doc["apiVersion"], doc["kind"])
    full = defaulted(schema, doc)
    failures = []
    for r in rules(schema, full):
        if "oldSelf" in r.rule:
            continue
        try:
            value = celpy.json_to_cel(cel_value(_at(full, r.path)))
            result = _program(r.rule).evaluate({"self": value})
        except Exception as e:  # NOTE: a rule CEL cannot evaluate here is reported, never passed
            result = e
        if not isinstance(result, celpy.celtypes.BoolType) or not result:
            failures.append(f"{r.path}: {r.message or r.rule} ({result!r})")
    return failures
