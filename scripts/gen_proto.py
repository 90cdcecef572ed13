"""Generate the committed Python gRPC stubs from proto/ (`make proto`), or check they are fresh.

Role: the only way stubs under kvfleet/ are produced. Every `proto/kvfleet/**/*.proto` is
compiled with grpc_tools.protoc (`-Iproto --python_out --pyi_out --grpc_python_out`), so the
stubs land next to their package path (kvfleet/v1/x_pb2.py) and import each other as
`kvfleet.v1.x_pb2`.

Invariants:
- Deterministic: the same protos and the same grpcio-tools version produce byte-identical
  files (inputs are sorted; protoc itself is deterministic).
- `--check` writes nothing into the tree: it regenerates into a temporary directory and
  fails (exit 1), listing every stale, missing or orphaned stub file.
- Orphans (stubs whose .proto was deleted) are removed on regeneration.

Usage: python scripts/gen_proto.py [--check] [--root DIR]
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.resources
import sys
import tempfile
from pathlib import Path

# The stub suffixes protoc writes for each foo.proto.
STUB_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
PROTO_DIR = "proto"
# Top-level directories under proto/ whose protos we own (and whose stubs we manage).
PROTO_PACKAGES = ("kvfleet",)


def find_protos(root: Path) -> list[Path]:
    """Proto files relative to root/proto, sorted so protoc sees them in a fixed order."""
    proto_root = root / PROTO_DIR
    found: list[Path] = []
    for package in PROTO_PACKAGES:
        found.extend(p.relative_to(proto_root) for p in (proto_root / package).rglob("*.proto"))
    return sorted(found)


def expected_stubs(protos: list[Path]) -> list[Path]:
    """Stub paths (relative to the output root) that protoc produces for `protos`."""
    stem_paths = [p.with_suffix("") for p in protos]
    return sorted(Path(f"{s}{suffix}") for s in stem_paths for suffix in STUB_SUFFIXES)


def existing_stubs(out_root: Path) -> list[Path]:
    """Stub files currently present under the managed packages (relative to out_root)."""
    stubs: list[Path] = []
    for package in PROTO_PACKAGES:
        for suffix in STUB_SUFFIXES:
            stubs.extend(p.relative_to(out_root) for p in (out_root / package).rglob(f"*{suffix}"))
    return sorted(stubs)


def run_protoc(root: Path, protos: list[Path], out_dir: Path) -> None:
    """Compile `protos` into out_dir; raises RuntimeError with protoc's exit status."""
    from grpc_tools import protoc  # imported here so `--help` works without grpcio-tools

    # Well-known types (google/protobuf/*.proto) ship inside grpc_tools.
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{root / PROTO_DIR}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(root / PROTO_DIR / p) for p in protos),
    ]
    status = protoc.main(args)
    if status != 0:
        raise RuntimeError(f"protoc failed with exit status {status}")


def stale_files(generated_root: Path, tree_root: Path, protos: list[Path]) -> list[str]:
    """Human-readable problems: stubs that differ, are missing, or have no .proto."""
    expected = expected_stubs(protos)
    problems: list[str] = []
    for rel in expected:
        ours = tree_root / rel
        if not ours.exists():
            problems.append(f"missing: {rel}")
        elif not filecmp.cmp(generated_root / rel, ours, shallow=False):
            problems.append(f"stale: {rel}")
    orphans = set(existing_stubs(tree_root)) - set(expected)
    problems.extend(f"orphaned (no .proto): {rel}" for rel in sorted(orphans))
    return problems


def generate(root: Path) -> list[Path]:
    """Regenerate all stubs in place, deleting orphans; returns the written files."""
    protos = find_protos(root)
    if not protos:
        raise RuntimeError(f"no .proto files under {root / PROTO_DIR}")
    expected = set(expected_stubs(protos))
    for orphan in set(existing_stubs(root)) - expected:
        (root / orphan).unlink()
    run_protoc(root, protos, root)
    return sorted(expected)


def check(root: Path) -> list[str]:
    """Regenerate into a temp dir and compare with the tree; returns the problems found."""
    protos = find_protos(root)
    if not protos:
        return [f"no .proto files under {root / PROTO_DIR}"]
    with tempfile.TemporaryDirectory(prefix="kvfleet-proto-") as tmp:
        run_protoc(root, protos, Path(tmp))
        return stale_files(Path(tmp), root, protos)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="fail if the committed stubs are out of date"
    )
    parser.add_argument(
        "--root",
        type=Path,
        default=Path(__file__).resolve().parent.parent,
        help="repository root (default: this script's parent directory)",
    )
    args = parser.parse_args(argv)
    root: Path = args.root.resolve()
    if args.check:
        problems = check(root)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            print("stubs are out of date: run `make proto`", file=sys.stderr)
            return 1
        print("proto stubs are up to date")
        return 0
    for path in generate(root):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
