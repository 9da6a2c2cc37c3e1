"""Regenerates the committed Python modules from protos/pagedserve/v1/*.proto: `python protos/generate.py`."""

import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent


def generate(out_dir: Path) -> list[Path]:
    """Writes *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every proto into out_dir; returns the written paths."""
    from grpc_tools import protoc  # dev extra

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "pagedserve" / "v1").glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted(p for p in out_dir.rglob("*_pb2*.py*"))


if __name__ == "__main__":
    for path in generate(PROTO_ROOT):
        print(path.relative_to(PROTO_ROOT.parent))
    sys.exit(0)
