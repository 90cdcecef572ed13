"""The dense LM head of a model whose projections are quantized at load
(`quantization="int8"`): which CPU linear backend (engine.models.linear) runs it, measured on
the head alone at decode-sized batches.

Why: the head stays in the model's dtype (engine.quant.int8), and F.linear on a bfloat16
[vocab, hidden] weight at one row read it at a third of the packed backends' speed — a third
of the int8 model's batch-1 step. The dense model picks its head's backend in
engine.models.gemm_select together with its layers'; here the layers are quantized, so only the
head is timed, by the same function (gemm_select.time_head: every supported backend, best of
`REPEATS` interleaved rounds at each of the row counts `ROWS`; gemm_select.fastest: the one
losing least against the fastest at each count, summed ratios).

Invariant: every backend computes the same GEMM; the choice depends on measured speed only.
"""

from __future__ import annotations

import logging

import torch

from engine.models.gemm_select import fastest, time_head
from engine.models.linear import BACKENDS, backend_supported

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
    with torch.inference_mode():
        times = time_head(weight, candidates, ROWS, REPEATS)
    choice = fastest(times)
    logger.info("dense LM head backend %s (ms at %s rows: %s)", choice, ROWS,
                ", ".join(f"{b} " + "/".join(f"{t * 1e3:.2f}" for t in times[b])
                          for b in candidates))
    return choice
