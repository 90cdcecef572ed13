"""Chooses, at engine start, which CPU path runs the MoE experts at which batch sizes.

For each row count of `PLAN_ROWS` (up to the engine's largest batch), one MoE layer of the
model runs on random hidden states, routed by its own router, through the PyTorch path and
through the fused C++ kernel (engine.models.moe); the faster one (best of `REPEATS`
interleaved rounds, which resists a shared machine's noise better than the mean) takes
batches of up to that many rows. The plan is the same for every MoE layer of the model (they
share one shape). A first round where one path takes over `DECISIVE` times the other's time
decides that size at once.

Why measure: the fused kernel removes the per-expert dispatch and the host sync that dominate
small batches, but its dot-product micro-kernel is not a tuned BLAS; at prefill sizes oneDNN's
GEMMs can win on some CPUs. The decision depends on measured speed only.

Invariant: without the C++ kernels (or for dtypes they lack) the plan is empty, the PyTorch
path always.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from engine.models.moe import PLAN_ROWS, MoePlan, SparseMoeBlock

logger = logging.getLogger("kvfleet.engine")

REPEATS = 3
# Rows per timed round at the small sizes (calls = CALL_ROWS // rows).
CALL_ROWS = 16
# A first round this lopsided decides without the other rounds: start-up on a loaded machine
# (where the PyTorch path's many thread barriers make it very slow) stays short.
DECISIVE = 2.0
FUSED_DTYPES = (torch.float32, torch.bfloat16)


def fused_available(dtype: torch.dtype) -> bool:
    from kernels.cpu import load

    return dtype in FUSED_DTYPES and load() and hasattr(torch.ops.kvfleet_cpu, "fused_moe")


def _seconds(path: Callable[..., torch.Tensor], calls: int, *args: torch.Tensor) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        path(*args)
    return time.perf_counter() - start


@torch.inference_mode()
def choose_plan(block: SparseMoeBlock, max_rows: int,
                rows: Sequence[int] = PLAN_ROWS) -> MoePlan:
    """Time both paths on `block` at each of `rows` up to `max_rows` (at least the first)."""
    dtype = block.gate_up.dtype
    if block.gate_up.device.type != "cpu" or not fused_available(dtype):
        return MoePlan()
    sizes = [r for r in rows if r <= max_rows] or [rows[0]]
    generator = torch.Generator().manual_seed(0)
    fused: list[bool] = []
    for size in sizes:
        x = torch.randn(size, block.gate.shape[1], generator=generator).to(dtype)
        weights, ids = block.route(x)
        paths = (block.forward_reference, block.forward_fused)
        best = [float("inf"), float("inf")]
        calls = max(1, CALL_ROWS // size)  # a single decode-sized call is too short to time
        for _ in range(REPEATS):
            for i, path in enumerate(paths):
                best[i] = min(best[i], _seconds(path, calls, x, weights, ids) / calls)
            if max(best) > DECISIVE * min(best):  # no rerun can turn this round around
                break
        fused.append(best[1] < best[0])
        logger.info("MoE experts at %d rows: PyTorch %.3f ms, fused %.3f ms", size,
                    best[0] * 1e3, best[1] * 1e3)
    return MoePlan(rows=tuple(sizes), fused=tuple(fused))


def configure_moe(layers: nn.ModuleList, enabled: bool, max_rows: int) -> MoePlan | None:
    """Set every MoE block's plan: measured when `enabled` (the fused CPU kernels are on;
    float32 blocks first get the packed copy the fused kernel runs on, so that is what is
    timed), else the PyTorch path. Returns the plan, None for a model without MoE layers."""
    blocks = [m for m in layers.modules() if isinstance(m, SparseMoeBlock)]
    if not blocks:
        return None
    start = time.perf_counter()
    if enabled and fused_available(blocks[0].gate_up.dtype):
        route_op = hasattr(torch.ops.kvfleet_cpu, "moe_route")
        for block in blocks:  # float32: the panel copy the kernel runs fastest on
            block.pack_panels()
            block.fused_route = route_op and block.gate.device.type == "cpu"
    plan = choose_plan(blocks[0], max_rows) if enabled else MoePlan()
    if enabled:
        logger.info("MoE expert paths chosen in %.1f s: %s", time.perf_counter() - start, plan)
    for block in blocks:
        block.plan = plan
    return plan
