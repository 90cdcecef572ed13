"""Chooses, at start, which path a quantized projection takes for each batch size: the
register kernel, the panel kernel, or dequantize + F.linear (engine.quant.qlinear).

Measured on the model's own first layer, in the model's dtype: for each row count of `ROWS`,
the layer's four projections by every path, best of `REPEATS`; that row count's class
(between the previous count, exclusive, and it) takes the fastest path, and batches above the
largest count take DENSE. Few rows are memory-bound (the register kernel reads 4-8 bits a
weight and nothing else), 8-64 rows are compute-bound with the weight reused (the panel
kernel dequantizes it once per call into cache), prefill is BLAS's. Adjacent classes with
the same winner are merged into one plan entry.

`requested`: "auto" measures; "dense" (or no kernel on this machine) gives (), never a
kernel; any other backend name keeps DEFAULT_PLAN without measuring (tests).

Invariant: the choice depends on measured speed only; every path computes the same product.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from engine.quant.qlinear import DEFAULT_PLAN, DENSE, KERNEL, PANEL, Plan, QuantLinear

logger = logging.getLogger("kvfleet.engine")

ROWS = (1, 4, 8, 16, 32, 64, 128, 256)
PATHS = (KERNEL, PANEL, DENSE)
REPEATS = 3


def _best(call: Callable[[], object], repeats: int = REPEATS) -> float:
    call()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def _model_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def merge_plan(winners: list[tuple[int, str]]) -> Plan:
    """(row count, fastest path) per measured count -> the plan: adjacent equal winners
    merged, trailing DENSE entries dropped (DENSE is the default above the plan)."""
    plan: list[tuple[int, str]] = []
    for rows, path in winners:
        if plan and plan[-1][1] == path:
            plan[-1] = (rows, path)
        else:
            plan.append((rows, path))
    while plan and plan[-1][1] == DENSE:
        plan.pop()
    return tuple(plan)


def choose_plan(model: nn.Module, requested: str = "auto") -> Plan:
    from kernels.cpu.quant import load

    linears = [m for m in model.modules() if isinstance(m, QuantLinear) and m.use_kernel]
    if requested == "dense" or not linears or not load():
        return ()
    if requested != "auto":
        return DEFAULT_PLAN
    first = linears[:4]  # one layer's projections: qkv, o, gate_up, down
    dtype = _model_dtype(model)
    gen = torch.Generator().manual_seed(0)
    winners: list[tuple[int, str]] = []
    timings = []
    with torch.inference_mode():
        for rows in ROWS:
            xs = [torch.randn(rows, m.in_features, generator=gen).to(dtype) for m in first]
            times = {path: sum(_best(lambda m=m, x=x, p=path: m.run(x, p))  # type: ignore[misc]
                               for m, x in zip(first, xs, strict=True))
                     for path in PATHS}
            winners.append((rows, min(times, key=lambda p: times[p])))
            timings.append(f"{rows}: " + " / ".join(f"{times[p] * 1e3:.2f}" for p in PATHS))
    plan = merge_plan(winners)
    logger.info("quantized GEMM plan (%s): %s, dense above (ms per layer, %s: %s)", dtype,
                ", ".join(f"<={rows} {path}" for rows, path in plan) or "dense always",
                " / ".join(PATHS), ", ".join(timings))
    return plan
