"""Chooses, at start, up to how many rows a quantized projection runs the C++ kernel
(dequantizing inside the GEMM) before dequantize-then-BLAS wins.

Measured on the model's own first layer: for each candidate row count, the layer's
projections by the kernel and by dequantize + F.linear, best of `REPEATS`; the limit is the
largest candidate where the kernel was faster, and every larger batch takes the dense path.
Decode batches are memory-bound (the kernel reads 4-8 bits a weight instead of 32) and
prefill batches compute-bound (BLAS's blocking wins), so one crossover suffices.

`requested`: "auto" measures; "dense" (or no kernel on this machine) gives 0, never the
kernel; any other backend name keeps the default limit without measuring (tests).

Invariant: the choice depends on measured speed only.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

from engine.quant.qlinear import QuantLinear

logger = logging.getLogger("kvfleet.engine")

ROWS = (1, 8, 32, 64, 128, 256)
REPEATS = 3


def _best(call: object, repeats: int = REPEATS) -> float:
    assert callable(call)
    call()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def choose_kernel_rows(model: nn.Module, requested: str = "auto") -> int:
    from kernels.cpu.quant import load

    linears = [m for m in model.modules() if isinstance(m, QuantLinear) and m.use_kernel]
    if requested == "dense" or not linears or not load():
        return 0
    if requested != "auto":
        return QuantLinear.kernel_max_rows
    first = linears[:4]  # one layer's projections: qkv, o, gate_up, down
    gen = torch.Generator().manual_seed(0)
    limit = 0
    timings = []
    with torch.inference_mode():
        for rows in ROWS:
            xs = [torch.randn(rows, m.in_features, generator=gen) for m in first]
            kernel = sum(_best(lambda m=m, x=x: [m._kernel(x, s) for s in m.segments])
                         for m, x in zip(first, xs, strict=True))
            dense = sum(_best(lambda m=m, x=x: F.linear(x, m.dequantized_weight()))
                        for m, x in zip(first, xs, strict=True))
            timings.append(f"{rows}: {kernel * 1e3:.2f} / {dense * 1e3:.2f}")
            if kernel >= dense:
                break
            limit = rows
    logger.info("quantized GEMM: kernel up to %d rows, dequantize + F.linear above "
                "(ms per layer, kernel / dequantize: %s)", limit, ", ".join(timings))
    return limit
