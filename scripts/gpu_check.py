"""`make gpu-check`: what a CUDA machine proves that CI (CPU only) cannot.

1. The GPU test subset, compiled for the GPU rather than interpreted: tests/kernels_triton
   (every Triton kernel against its PyTorch reference, and the engine through them) and
   tests/gpu (the engine on CUDA: exact float32 greedy tokens vs transformers with and without
   CUDA graphs, bfloat16 agreement, KV sizing from gpu_memory_utilization).
2. The offline benchmark on the GPU (benchmarks.gpu_offline).
3. One JSON report with the machine, the test counts and the benchmark figures.

Exits non-zero when there is no GPU or a test fails.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

from engine.models.default_model import default_model_dir


def run_tests(out_dir: Path, paths: list[str]) -> dict[str, object]:
    junit = out_dir / "gpu-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-s",
           f"--junitxml={junit}", *paths]
    code = subprocess.call(cmd)
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return {"command": " ".join(cmd[1:]), "exit_code": code, **counts}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out-dir", type=Path, default=Path("bench_results/gpu"))
    parser.add_argument("--model", type=Path, default=None,
                        help="converted SmolLM2 directory for the benchmark")
    parser.add_argument("--arch-from", type=Path, default=None,
                        help="config + tokenizer directory: benchmark on random weights")
    parser.add_argument("--skip-bench", action="store_true")
    args = parser.parse_args(argv)
    if args.model is None and args.arch_from is None and default_model_dir().is_dir():
        args.model = default_model_dir()  # where `make model` left the converted SmolLM2
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA GPU visible to this Python (torch "
              f"{torch.__version__}); run it on a GPU machine with a CUDA build of torch")
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, object] = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "tests": run_tests(args.out_dir, ["tests/kernels_triton", "tests/gpu"]),
    }
    if not args.skip_bench and (args.model or args.arch_from):
        bench_json = args.out_dir / "gpu-bench.json"
        bench_args = ["--out", str(bench_json)]
        bench_args += ["--model", str(args.model)] if args.model else [
            "--arch-from", str(args.arch_from)]
        code = subprocess.call([sys.executable, "-m", "benchmarks.gpu_offline", *bench_args])
        report["bench"] = json.loads(bench_json.read_text()) if code == 0 else {"exit_code": code}
    (args.out_dir / "gpu-report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report["tests"]))
    tests = report["tests"]
    assert isinstance(tests, dict)
    return 0 if tests["exit_code"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
