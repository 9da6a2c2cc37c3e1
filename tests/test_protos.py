"""The committed protobuf modules are fresh, and the .proto contract is documented and well-formed."""

import re
from pathlib import Path

import pytest

PROTO_ROOT = Path(__file__).resolve().parents[1] / "protos"
PROTOS = sorted((PROTO_ROOT / "pagedserve" / "v1").glob("*.proto"))


def test_generated_modules_are_not_stale(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen", PROTO_ROOT / "generate.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    fresh = gen.generate(tmp_path)
    assert fresh, "protoc generated nothing"
    for path in fresh:
        committed = PROTO_ROOT / path.relative_to(tmp_path)
        assert committed.exists(), f"{committed} is missing: run `python protos/generate.py`"
        assert committed.read_bytes() == path.read_bytes(), f"{committed} is stale: run `python protos/generate.py`"
    names = {p.relative_to(tmp_path) for p in fresh}
    extra = {p.relative_to(PROTO_ROOT) for p in (PROTO_ROOT / "pagedserve").rglob("*_pb2*.py*")} - names
    assert not extra, f"generated files without a .proto: {extra}"


@pytest.mark.parametrize("proto", PROTOS, ids=lambda p: p.name)
def test_every_message_field_and_enum_value_has_a_comment(proto):
    lines = proto.read_text().splitlines()
    decl = re.compile(r"^\s*(message|enum|service|rpc|oneof|(optional |repeated )?[\w.]+ \w+ = \d+;|\w+ = \d+;)")
    for i, line in enumerate(lines):
        if decl.match(line) and not line.strip().startswith("oneof"):
            assert lines[i - 1].strip().startswith("//"), f"{proto.name}:{i + 1} has no comment: {line.strip()}"


@pytest.mark.parametrize("proto", PROTOS, ids=lambda p: p.name)
def test_enums_start_with_unspecified_zero(proto):
    text = proto.read_text()
    for name, body in re.findall(r"enum (\w+) \{(.*?)\}", text, re.S):
        first = re.search(r"(\w+) = (\d+);", body)
        assert first.group(2) == "0" and first.group(1).endswith("_UNSPECIFIED"), name


def test_package_is_pagedserve_v1():
    from pagedserve.v1 import generate_pb2, worker_pb2

    assert generate_pb2.DESCRIPTOR.package == "pagedserve.v1"
    assert worker_pb2.DESCRIPTOR.package == "pagedserve.v1"
    assert "Generation" in generate_pb2.DESCRIPTOR.services_by_name
