"""Chooses the CPU linear backend (engine.models.linear) by timing the candidates on this
machine, on the model's own weight shapes, at start-up.

Measured: one decoder layer's projections and the LM head at a decode-sized batch
(`DECODE_ROWS`), and the projections at a prefill-sized batch (`PREFILL_ROWS`). Each candidate's
score is the sum over shapes of its best time over `REPEATS` interleaved rounds (the minimum
resists a shared machine's noise better than the mean); the lowest score wins. The whole
measurement takes about a second for a small model, once per engine start.

Invariant: the decision depends on measured speed only, never on the CPU's vendor string.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.models.linear import BACKENDS, apply_linear, backend_supported, pack_weight

logger = logging.getLogger("kvfleet.engine")

DECODE_ROWS = 32
PREFILL_ROWS = 512
REPEATS = 5


@dataclass(frozen=True)
class GemmChoice:
    backend: str
    # Seconds per candidate (sum of best-of-REPEATS over the measured shapes).
    scores: dict[str, float]


def _cases(
    backend: str, layer_weights: Sequence[torch.Tensor], lm_head: torch.Tensor
) -> list[Callable[[], object]]:
    shapes = [(w, DECODE_ROWS) for w in (*layer_weights, lm_head)]
    shapes += [(w, PREFILL_ROWS) for w in layer_weights]
    calls: list[Callable[[], object]] = []
    for weight, rows in shapes:
        packed = pack_weight(weight, backend)
        x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
        calls.append(functools.partial(apply_linear, x, weight, None, backend, packed))
    return calls


def _scores(
    candidates: Sequence[str],
    layer_weights: Sequence[torch.Tensor],
    lm_head: torch.Tensor,
    repeats: int,
) -> dict[str, float]:
    """Per candidate, the sum over shapes of the best time seen. Rounds interleave the
    candidates, so a burst of load from a neighbour (services starting beside the engine)
    slows every candidate's round alike instead of deciding the choice."""
    calls = {b: _cases(b, layer_weights, lm_head) for b in candidates}
    best = {b: [float("inf")] * len(c) for b, c in calls.items()}
    for b in candidates:
        for call in calls[b]:
            call()  # warm-up: primitive creation, caches
    for _ in range(repeats):
        for b in candidates:
            for i, call in enumerate(calls[b]):
                start = time.perf_counter()
                call()
                best[b][i] = min(best[b][i], time.perf_counter() - start)
    return {b: sum(times) for b, times in best.items()}


def choose_backend(
    layer_weights: Sequence[torch.Tensor],
    lm_head: torch.Tensor,
    requested: str = "auto",
    repeats: int = REPEATS,
) -> GemmChoice:
    """The backend to use: `requested` when it is not "auto" (refused when unsupported),
    else the fastest supported candidate measured on these weights."""
    dtype = lm_head.dtype
    if requested != "auto":
        if not backend_supported(requested, dtype):
            raise ValueError(f"linear backend {requested!r} is not available for {dtype}")
        return GemmChoice(requested, {})
    if lm_head.device.type != "cpu":
        return GemmChoice("dense", {})
    candidates = [b for b in BACKENDS if backend_supported(b, dtype)]
    with torch.inference_mode():
        scores = _scores(candidates, layer_weights, lm_head, repeats)
    best = min(scores, key=lambda b: scores[b])
    logger.info(
        "linear backend %s (measured ms: %s)",
        best,
        ", ".join(f"{b} {s * 1e3:.1f}" for b, s in scores.items()),
    )
    return GemmChoice(best, scores)
