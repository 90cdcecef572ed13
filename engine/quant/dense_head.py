"""The dense LM head of a model whose projections are quantized at load
(`quantization="int8"`): which CPU linear backend (engine.models.linear) runs it, measured on
the head alone at decode-sized batches.

Why: the head stays in the model's dtype (engine.quant.int8), and F.linear on a bfloat16
[vocab, hidden] weight at one row read it at a third of the packed backends' speed — a third
of the int8 model's batch-1 step. The dense model picks its head's backend in
engine.models.gemm_select together with its layers'; here the layers are quantized, so only the
head is timed: row counts `ROWS`, every supported backend, best of `REPEATS` interleaved
rounds, the backend losing least against the fastest at each count (summed ratios).

Invariant: every backend computes the same GEMM; the choice depends on measured speed only.
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from engine.models.linear import BACKENDS, apply_linear, backend_supported, pack_weight

logger = logging.getLogger("kvfleet.engine")

ROWS = (1, 8, 32)
REPEATS = 3


def choose_head_backend(weight: torch.Tensor, requested: str = "auto") -> str:
    """The backend for LM head `weight` [vocab, hidden]: `requested` where it names a
    supported one, "dense" where it names none, else the fastest measured."""
    dtype = weight.dtype
    if requested != "auto":
        return requested if requested in BACKENDS and backend_supported(requested, dtype) \
            else "dense"
    if weight.device.type != "cpu":
        return "dense"
    candidates = [b for b in BACKENDS if backend_supported(b, dtype)]
    packed = {b: pack_weight(weight, b) for b in candidates}
    gen = torch.Generator().manual_seed(0)  # start-up timing leaves the global RNG alone
    loss = dict.fromkeys(candidates, 0.0)
    with torch.inference_mode():
        for rows in ROWS:
            x = torch.randn(rows, weight.shape[1], generator=gen).to(dtype)
            calls = {b: functools.partial(apply_linear, x, weight, None, b, packed[b])
                     for b in candidates}
            best = dict.fromkeys(candidates, float("inf"))
            for _ in range(REPEATS + 1):  # the first round warms up and counts like the others
                for b, call in calls.items():
                    start = time.perf_counter()
                    call()
                    best[b] = min(best[b], time.perf_counter() - start)
            fastest = min(best.values())
            for b in candidates:
                loss[b] += best[b] / fastest
    choice = min(candidates, key=loss.__getitem__)
    logger.info("dense LM head backend %s (loss vs fastest over %s rows: %s)", choice, ROWS,
                ", ".join(f"{b} {loss[b]:.2f}" for b in candidates))
    return choice
