"""Per-format micro-benchmark of the quantized GEMM kernels (kernels/cpu/quant/): GB/s of
quantized weight streamed and GFLOP/s, at a few row counts, against float32 F.linear on the
same shape, weights larger than the last-level cache (what a decode step reads).

`python -m benchmarks.quant_kernel_bench [--n 4096 --k 4096 --rows 1 8 --repeats 5]
[--dtype bfloat16]`; one line per format and row count, and a JSON file. With `--dtype
bfloat16` the activations (and F.linear's weight) are bfloat16: a bfloat16 model's register
kernel, whose one-row Q4_0/Q4_1 case is the factored kernel (quant_gemv_bf16.h).
`--paths kernel panel panel-q4 panel-q4p` times those QuantLinear paths too (panel-q4 and
panel-q4p: bfloat16 Q4_0/Q4_1 only; panel-q4p over the panel-ordered copy, GB/s counted on
the quantized bytes once).
Threads: torch's setting (OMP_NUM_THREADS).
Weights are random valid blocks (the kernel's speed does not depend on their values).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from engine.quant import formats
from engine.quant.qlinear import KERNEL, PANEL, PANEL_Q4, PANEL_Q4P, QuantLinear, QuantTensor
from kernels.cpu.quant import load

FORMATS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K"]
# Byte offsets of each format's fp16 scales in a block (overwritten with small finite values).
_HALVES = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q4_K": (0, 2),
           "Q5_K": (0, 2), "Q6_K": (208,)}


def random_weight(name: str, n: int, k: int, seed: int = 0) -> QuantTensor:
    qtype = int(getattr(formats, name))
    rng = np.random.default_rng(seed)
    nb, size = k // formats.block_size(qtype), formats.type_size(qtype)
    blocks = rng.integers(0, 256, size=(n, nb, size), dtype=np.uint8)
    for offset in _HALVES[name]:
        blocks[..., offset:offset + 2] = (
            rng.uniform(1e-4, 1e-2, size=(n, nb)).astype(np.float16).view(np.uint8)
            .reshape(n, nb, 2))
    return QuantTensor(torch.from_numpy(blocks.reshape(n, -1)), qtype, k)


def best_seconds(call: object, repeats: int) -> float:
    assert callable(call)
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--formats", nargs="+", default=FORMATS)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--paths", nargs="+", default=[KERNEL],
                        choices=[KERNEL, PANEL, PANEL_Q4, PANEL_Q4P])
    parser.add_argument("--out", type=Path, default=Path("bench_results/quant_kernels.json"))
    args = parser.parse_args(argv)
    if not load():
        raise SystemExit("the quantized GEMM kernel did not build on this machine")
    dtype = getattr(torch, args.dtype)
    dense = torch.randn(args.n, args.k).to(dtype)
    results = []
    with torch.inference_mode():
        for rows in args.rows:
            x = torch.randn(rows, args.k).to(dtype)
            t = best_seconds(lambda x=x: F.linear(x, dense), args.repeats)
            label = "F32 F.linear" if dtype == torch.float32 else "BF16 F.linear"
            results.append(_row(label, rows, dense.numel() * dense.element_size(), args, t))
            for name in args.formats:
                layer = QuantLinear([random_weight(name, args.n, args.k)])
                raw_bytes = layer.segments[0].raw.numel()
                for path in args.paths:
                    if path in (PANEL_Q4, PANEL_Q4P) and not _q4_bf16(name, dtype):
                        continue
                    if path == PANEL_Q4P and not layer.pack_panels():
                        continue
                    t = best_seconds(lambda layer=layer, x=x, p=path: layer.run(x, p),
                                     args.repeats)
                    label = name if path == KERNEL else f"{name} {path}"
                    results.append(_row(label, rows, raw_bytes, args, t))
    load_avg = os.getloadavg()[0]
    print(f"threads {torch.get_num_threads()}, {args.dtype}, load average {load_avg:.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(
        {"load_average": load_avg, "dtype": args.dtype, "results": results}, indent=2))


def _q4_bf16(name: str, dtype: torch.dtype) -> bool:
    return name in ("Q4_0", "Q4_1") and dtype == torch.bfloat16


def _row(name: str, rows: int, weight_bytes: int, args: argparse.Namespace,
         seconds: float) -> dict[str, object]:
    gbs = weight_bytes / seconds / 1e9
    gflops = 2 * rows * args.n * args.k / seconds / 1e9
    print(f"{name:>18} rows {rows:>3}: {seconds * 1e3:8.3f} ms  {gbs:6.1f} GB/s weights  "
          f"{gflops:6.1f} GFLOP/s", flush=True)
    return {"format": name, "rows": rows, "ms": seconds * 1e3, "weight_gb_s": gbs,
            "gflop_s": gflops}


if __name__ == "__main__":
    main()
