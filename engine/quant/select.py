"""Chooses, at start, which path a quantized projection takes for each batch size: the
register kernel, the panel kernel, or dequantize + F.linear (engine.quant.qlinear).

Measured on the model's own layers, in the model's dtype: for each row count of `ROWS`, one
layer's projections by every path, best of interleaved rounds. Up to `SWEEP_MAX_ROWS` rows a
round sweeps enough layers to overflow the last-level cache (gemm_select.sweep_layers), so the
weights come from DRAM as in a decode step: there the register kernel streams the blocks
while the panel kernel decodes them into a buffer first, and timing one layer in cache made
the panel kernel look faster at 2-4 rows where, from DRAM, it was up to 2x slower. Above
that the GEMMs are compute-bound and the first layer alone is timed (`REPEATS` rounds). Few rows
are memory-bound (the register kernel reads 4-8 bits a weight and nothing else), 8-64 rows
compute-bound with the weight reused (the panel kernel dequantizes it once per call into
cache), prefill is BLAS's: so the plan has that shape, KERNEL up to one row count, PANEL up
to a second, DENSE above, with the two crossovers that lose least time against the fastest
path at every measured count (fit_plan).

`requested`: "auto" measures; "dense" (or no kernel on this machine) gives (), never a
kernel; any other backend name keeps DEFAULT_PLAN without measuring (tests).

A bfloat16 model's Q4_0/Q4_1 layers have two panel kernels: PANEL (weights rounded to bfloat16)
and PANEL_Q4 (the factored panel, exact 128 + q with the block affine in float32). Both are
timed at every count; the fitted plan may give each a range (PANEL_Q4 the lower one). Where
the loader made the panel-ordered copies (QuantLinear.pack_panels), PANEL_Q4P (the same
product bit for bit, decoded without a transpose) is timed too and ranks before PANEL_Q4; a
plan without it frees the copies (QuantLinear.drop_panels), so they cost memory only where
they win.

Invariant: the choice depends on measured speed only; every path computes the same product
(up to rounding: in bfloat16 PANEL and the dense path multiply the weights rounded to
bfloat16, the register kernel and PANEL_Q4 the exact ones).
"""

from __future__ import annotations

import itertools
import logging
import time

import torch
from torch import nn

from engine.models.gemm_select import sweep_layers
from engine.quant import formats
from engine.quant.qlinear import (
    DEFAULT_PLAN,
    DENSE,
    KERNEL,
    PANEL,
    PANEL_Q4,
    PANEL_Q4P,
    Plan,
    QuantLinear,
)

logger = logging.getLogger("kvfleet.engine")

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SWEEP_MAX_ROWS = 16
SWEEP_REPEATS = 2
PATHS = (KERNEL, PANEL, DENSE)
REPEATS = 4
# The register kernel re-dequantizes the weight every 8 rows: never timed above this.
KERNEL_MAX_ROWS = 64


def _model_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def fit_plan(times: dict[int, dict[str, float]]) -> Plan:
    """The plan KERNEL up to t1 rows, PANEL_Q4P up to t2, PANEL_Q4 up to t3, PANEL up to t4,
    DENSE above (t1 <= .. <= t4 among the measured row counts; any range may be empty, an
    optional path's always is where a count lacks its timing) that loses least against the
    fastest path at each row count, summed as ratios. Contiguous ranges in that order, not
    each count's own winner: on a shared machine a single descheduled timing must not flip
    one class. PANEL_Q4 comes before PANEL because its advantage is at few rows (cheaper
    decoding, which few rows amortize least); with many rows its 7-row passes lose to PANEL's
    12-row ones. PANEL_Q4P (the same product, cheaper decoding still) comes before PANEL_Q4."""
    rows = sorted(times)
    optional = [p for p in (PANEL_Q4P, PANEL_Q4) if all(p in times[r] for r in rows)]
    order = [KERNEL, *optional, PANEL, DENSE]
    best_loss = float("inf")
    best: list[str] = []
    for cuts in itertools.combinations_with_replacement(range(len(rows) + 1), len(order) - 1):
        paths: list[str] = []
        for path, lo, hi in zip(order, (0, *cuts), (*cuts, len(rows)), strict=True):
            paths += [path] * (hi - lo)
        loss = sum(times[r][p] / min(times[r].values()) for r, p in zip(rows, paths, strict=True))
        if loss < best_loss:
            best_loss, best = loss, paths
    return _merge(tuple((r, p) for r, p in zip(rows, best, strict=True) if p != DENSE))


def _merge(entries: tuple[tuple[int, str], ...]) -> Plan:
    plan: list[tuple[int, str]] = []
    for rows, path in entries:
        if plan and plan[-1][1] == path:
            plan[-1] = (rows, path)
        else:
            plan.append((rows, path))
    return tuple(plan)


def _measure(layers: list[list[QuantLinear]], rows: int,
             dtype: torch.dtype) -> dict[str, float]:
    """Seconds per layer of the projections per path at `rows` rows, each the best of the
    rounds, which interleave the paths (a slow phase of the machine hits all of them); a round
    runs every layer of `layers` in turn."""
    gen = torch.Generator().manual_seed(rows)
    xs = {k: torch.randn(rows, k, generator=gen).to(dtype)
          for k in sorted({m.in_features for m in layers[0]})}
    paths = [p for p in PATHS if p != KERNEL or rows <= KERNEL_MAX_ROWS]
    if _factored_applies(layers, dtype):
        paths.append(PANEL_Q4)
        if any(s.packed is not None for layer in layers for m in layer for s in m.segments):
            paths.append(PANEL_Q4P)
    best = dict.fromkeys(paths, float("inf"))
    rounds = SWEEP_REPEATS if len(layers) > 1 else REPEATS
    for _ in range(rounds + 1):  # the first round warms up and counts like the others
        for p in paths:
            start = time.perf_counter()
            for layer in layers:
                for m in layer:
                    m.run(xs[m.in_features], p)
            best[p] = min(best[p], (time.perf_counter() - start) / len(layers))
    return {p: best.get(p, float("inf")) for p in (*PATHS, *best)}


def _factored_applies(layers: list[list[QuantLinear]], dtype: torch.dtype) -> bool:
    """Whether PANEL_Q4 differs from PANEL here: a bfloat16 model with Q4_0/Q4_1 segments and
    the factored panel compiled in (AVX512_BF16 and AVX512_VBMI)."""
    if dtype != torch.bfloat16 or not torch.ops.kvfleet_quant.quant_has_q4_panel_factored():
        return False
    return any(s.qtype in (formats.Q4_0, formats.Q4_1)
               for layer in layers for m in layer for s in m.segments)


def choose_plan(model: nn.Module, requested: str = "auto") -> Plan:
    from kernels.cpu.quant import load

    linears = [m for m in model.modules() if isinstance(m, QuantLinear) and m.use_kernel]
    if requested == "dense" or not linears or not load():
        _keep_panels(model, ())
        _set_unpacked(model, ())
        return ()
    if requested != "auto":
        _keep_panels(model, DEFAULT_PLAN)
        _set_unpacked(model, DEFAULT_PLAN)
        return DEFAULT_PLAN
    # Each layer's projections (qkv, o, gate_up, down): four consecutive QuantLinears.
    layers = [linears[i:i + 4] for i in range(0, len(linears) - 3, 4)] or [linears]
    swept = layers[:sweep_layers([[s.raw for m in layer for s in m.segments]
                                  for layer in layers])]
    dtype = _model_dtype(model)
    with torch.inference_mode():
        times = {rows: _measure(swept if rows <= SWEEP_MAX_ROWS else layers[:1], rows, dtype)
                 for rows in ROWS}
    plan = fit_plan(times)
    _keep_panels(model, plan)
    unpacked = fit_plan({r: {p: t for p, t in ts.items() if p != PANEL_Q4P}
                         for r, ts in times.items()})
    _set_unpacked(model, unpacked)
    if unpacked != plan:
        logger.info("quantized GEMM plan for layers without a panel-ordered copy: %s",
                    ", ".join(f"<={rows} {path}" for rows, path in unpacked) or "dense always")
    timed = list(times[ROWS[0]])
    logger.info("quantized GEMM plan (%s): %s, dense above (ms per layer, %s: %s)", dtype,
                ", ".join(f"<={rows} {path}" for rows, path in plan) or "dense always",
                " / ".join(timed), ", ".join(
                    f"{r}: " + " / ".join(f"{t[p] * 1e3:.2f}" for p in timed)
                    for r, t in times.items()))
    return plan


def _keep_panels(model: nn.Module, plan: Plan) -> None:
    """Free the panel-ordered copies unless `plan` takes PANEL_Q4P somewhere."""
    if all(path != PANEL_Q4P for _, path in plan):
        for m in model.modules():
            if isinstance(m, QuantLinear):
                m.drop_panels()


def _set_unpacked(model: nn.Module, plan: Plan) -> None:
    """Every layer's plan_unpacked (its plan where it holds no panel-ordered copy)."""
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.plan_unpacked = plan
