"""Regenerate the Python gRPC code in specdec/v1/ from protos/specdec/v1/*.proto.

Usage: python scripts/gen_protos.py [--out DIR]
The generated files are committed; tests/test_protos.py fails when they are stale.
"""

import argparse
import pathlib
import sys

import grpc_tools
from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"


def generate(out_dir: pathlib.Path) -> None:
    """Runs protoc on every .proto under protos/ and writes the modules to out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        sys.exit("protoc failed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT)
    generate(parser.parse_args().out)


if __name__ == "__main__":
    main()
