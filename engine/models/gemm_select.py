"""Chooses the CPU linear backend (engine.models.linear) by timing the candidates on this
machine, on the model's own weight shapes, at start-up.

Measured: one decoder layer's projections and the LM head at decode-sized batches
(`DECODE_ROWS`), and the projections at a prefill-sized batch (`PREFILL_ROWS`). Each candidate's
scores are sums over shapes of its best time over `REPEATS` interleaved rounds (the minimum
resists a shared machine's noise better than the mean). The lowest decode score picks the
backend; where plain F.linear on the dense weight beats it on the prefill shapes (by
`DENSE_MARGIN`), batches of more than `DENSE_ABOVE_ROWS` rows run F.linear instead (no second
packed copy of the weights). Why two sizes: a GEMM's best blocking depends on its row count;
on an Intel Xeon (Emerald Rapids, no AMX) the panel kernel ran a SmolLM2 layer at 64 rows in
1.9 ms against MKL's 2.4, while at 512 rows F.linear took 14.4 ms against its 17.3. The whole
measurement takes about a second for a small model, once per engine start.

Invariant: the decision depends on measured speed only, never on the CPU's vendor string.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from engine.models.linear import BACKENDS, apply_linear, backend_supported, pack_weight

logger = logging.getLogger("kvfleet.engine")

DECODE_ROWS = (32,)
PREFILL_ROWS = 512
REPEATS = 5
DENSE_ABOVE_ROWS = 128
# F.linear must beat the backend on the prefill shapes by this fraction to take those batches
# (a near tie is noise: keep one GEMM path).
DENSE_MARGIN = 0.05


@dataclass(frozen=True)
class GemmChoice:
    backend: str
    # Seconds per candidate (sum of best-of-REPEATS over the measured shapes): decode-sized
    # shapes (with the LM head), then prefill-sized ones.
    scores: dict[str, float]
    prefill_scores: dict[str, float] = field(default_factory=dict)
    # Batches of more rows than this use F.linear on the dense weight; None: `backend` always.
    dense_above: int | None = None


def _cases(
    backend: str, layer_weights: Sequence[torch.Tensor], lm_head: torch.Tensor
) -> list[Callable[[], object]]:
    """The decode-sized calls (the layer's projections, then the LM head), then the
    prefill-sized ones (`len(layer_weights)` of them, last)."""
    shapes = [(w, rows) for rows in DECODE_ROWS for w in (*layer_weights, lm_head)]
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
) -> dict[str, list[float]]:
    """Per candidate, the best time seen for each shape (in `_cases` order). Rounds interleave the
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
    return best


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
        times = _scores(candidates, layer_weights, lm_head, repeats)
    split = len(times[candidates[0]]) - len(layer_weights)
    decode = {b: sum(t[:split]) for b, t in times.items()}
    prefill = {b: sum(t[split:]) for b, t in times.items()}
    best = min(decode, key=lambda b: decode[b])
    dense_above = (
        DENSE_ABOVE_ROWS
        if best != "dense" and prefill["dense"] < (1 - DENSE_MARGIN) * prefill[best] else None
    )
    logger.info(
        "linear backend %s%s (measured ms, decode / prefill shapes: %s)",
        best,
        f", F.linear above {dense_above} rows" if dense_above else "",
        ", ".join(f"{b} {decode[b] * 1e3:.1f} / {prefill[b] * 1e3:.1f}" for b in candidates),
    )
    return GemmChoice(best, decode, prefill, dense_above)
