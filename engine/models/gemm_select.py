"""Chooses the CPU linear backends (engine.models.linear) by timing the candidates on this
machine, on the model's own weights, at start-up.

Measured, per candidate, as the engine runs them: at decode-sized batches (`DECODE_ROWS`) a
sweep over the decoder layers' projections (enough layers to overflow the last-level cache, so
the weights come from DRAM as in a decode step) followed by the LM head; and the first layer's
projections at the engine's prefill batch (its step token budget, at most `MAX_PREFILL_ROWS`;
compute-bound, so cache does not matter). A score sums the best time over `REPEATS`
interleaved rounds (the minimum resists a shared machine's noise better than the mean). The
decoder layers and the LM head each take their own lowest decode score (each weight keeps one
packed copy, so this costs no memory); where plain F.linear on the dense weight beats the
layers' backend on the prefill shapes (by `DENSE_MARGIN`), batches of more than
`DENSE_ABOVE_ROWS` rows run F.linear instead.

Why measure this way: a GEMM's best blocking depends on its shape, its row count and where
its weight comes from. On an Intel Xeon (Emerald Rapids, no AMX), 30 SmolLM2 layers at 64 rows:
the panel kernel 49.8 ms with the weights in cache, 59.9 from DRAM; MKL 60.5 and 73.0. Timing
one layer over and over (in cache) made the two look level and MKL was chosen; in the engine
the panel kernel's decode step was 6% faster. MKL's packed GEMM is tuned for 32 rows: there it
ran the LM head in 9.4 ms against the panel kernel's 11.2, so one score over layers and head
let the head (one GEMM a step) decide for the 30 layers. At 2,048 rows F.linear beat both by
7%. The measurement takes a few seconds for a small model, once per engine start; it holds
every candidate's packed copy of the swept layers meanwhile.

The LM head's timing (`time_head`, `fastest`) is shared with the int8 model's dense head
(engine.quant.dense_head), whose layers are quantized and timed elsewhere.

Invariant: the decision depends on measured speed only, never on the CPU's vendor string.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.models.linear import BACKENDS, apply_linear, backend_supported, pack_weight

logger = logging.getLogger("kvfleet.engine")

DECODE_ROWS = (16, 32, 64)
MAX_PREFILL_ROWS = 2048
REPEATS = 3
# Rounds of the decode sweep (each is already hundreds of calls).
SWEEP_REPEATS = 2
DENSE_ABOVE_ROWS = 128
# F.linear must beat the backend on the prefill shapes by this fraction to take those batches
# (a near tie is noise: keep one GEMM path).
DENSE_MARGIN = 0.05
GROUPS = ("decode", "head", "prefill")
# Per candidate and group: the best time of each shape measured.
Times = dict[str, dict[str, list[float]]]


@dataclass(frozen=True)
class GemmChoice:
    backend: str  # the decoder layers' projections
    # Seconds per candidate (sum of best-of-REPEATS over the measured shapes): the layer's
    # decode-sized shapes, its prefill-sized ones, and the LM head's decode-sized ones.
    scores: dict[str, float]
    prefill_scores: dict[str, float] = field(default_factory=dict)
    # Batches of more rows than this use F.linear on the dense weight; None: `backend` always.
    dense_above: int | None = None
    head_scores: dict[str, float] = field(default_factory=dict)
    # The LM head's backend; None: `backend`.
    head_backend: str | None = None

    @property
    def lm_head(self) -> str:
        return self.head_backend or self.backend


def _cache_bytes() -> int:
    """The last-level cache's size (Linux sysfs), or 64 MiB where it cannot be read."""
    try:
        index = sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"))[-1]
        text = (index / "size").read_text().strip()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        return int(text.rstrip("KMG")) * scale
    except (OSError, ValueError, IndexError):
        return 64 << 20


def sweep_layers(layers: Sequence[Sequence[torch.Tensor]]) -> int:
    """How many layers a decode sweep covers: enough weight bytes to overflow the last-level
    cache twice (a decode step's weights come from DRAM), at most all of them."""
    per_layer = max(1, sum(w.numel() * w.element_size() for w in layers[0]))
    return min(len(layers), max(1, -(-2 * _cache_bytes() // per_layer)))


def _call(backend: str, weight: torch.Tensor, x: torch.Tensor) -> Callable[[], object]:
    return functools.partial(apply_linear, x, weight, None, backend, pack_weight(weight, backend))


def _inputs(weights: Sequence[torch.Tensor], rows: int) -> dict[int, torch.Tensor]:
    # A local generator: start-up timing must not move the global RNG that seeded sampling uses.
    gen = torch.Generator().manual_seed(rows)
    return {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype, generator=gen)
            for w in weights}


def _time(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _sweep(b: str, swept: Sequence[Sequence[torch.Tensor]],
           packed: Sequence[Sequence[torch.Tensor | None]], xs: dict[int, torch.Tensor]) -> float:
    """One decode-sized pass over the swept layers' projections: seconds per layer (mean)."""
    layer_time = 0.0
    for layer, layer_packed in zip(swept, packed, strict=True):
        for w, p in zip(layer, layer_packed, strict=True):
            layer_time += _time(functools.partial(apply_linear, xs[w.shape[1]], w, None, b, p))
    return layer_time / len(swept)


def _record_sweep(layer_best: dict[str, float], swept: Sequence[Sequence[torch.Tensor]],
                  packed: dict[str, list[list[torch.Tensor | None]]],
                  xs: dict[int, torch.Tensor], b: str) -> None:
    layer_best[b] = min(layer_best[b], _sweep(b, swept, packed[b], xs))


def time_head(
    weight: torch.Tensor,
    candidates: Sequence[str],
    rows: Sequence[int],
    rounds: int,
    packed: dict[str, torch.Tensor | None] | None = None,
    before: Callable[[str], object] | None = None,
) -> dict[str, list[float]]:
    """The LM head `weight` [vocab, hidden] per candidate backend: its best seconds at each row
    count of `rows`, over `rounds` rounds that interleave the candidates (after one untimed
    warm-up call each: primitive creation). `before(b)` runs ahead of each timed call of
    candidate b (the dense model's decode sweep of its layers, so the head's weight comes from
    DRAM as in a step). Shared by the dense model's choice (choose_backend) and the int8
    model's (engine.quant.dense_head)."""
    if packed is None:
        packed = {b: pack_weight(weight, b) for b in candidates}
    best: dict[str, list[float]] = {b: [] for b in candidates}
    for n in rows:
        x = _inputs([weight], n)[weight.shape[1]]
        calls = {b: functools.partial(apply_linear, x, weight, None, b, packed[b])
                 for b in candidates}
        for call in calls.values():
            call()
        times = dict.fromkeys(candidates, float("inf"))
        for _ in range(rounds):
            for b, call in calls.items():
                if before is not None:
                    before(b)
                times[b] = min(times[b], _time(call))
        for b in candidates:
            best[b].append(times[b])
    return best


def fastest(times: dict[str, list[float]]) -> str:
    """The candidate losing least against the fastest at each measured shape, summed as
    ratios: every shape counts alike, not only the slowest one."""
    n = len(next(iter(times.values())))
    fastest_at = [min(t[i] for t in times.values()) for i in range(n)]
    return min(times, key=lambda b: sum(t / f for t, f in zip(times[b], fastest_at, strict=True)))


def _decode_times(candidates: Sequence[str], layers: Sequence[Sequence[torch.Tensor]],
                  lm_head: torch.Tensor, best: Times) -> None:
    """Per decode row count, a sweep over the layers' projections then the LM head, as a
    decode step runs them: the weights come from memory, not cache."""
    swept = [list(layer) for layer in layers[:sweep_layers(layers)]]
    # Packed copies of every candidate at once (freed on return), so rounds can interleave.
    packed = {b: [[pack_weight(w, b) for w in layer] for layer in swept] for b in candidates}
    head_packed = {b: pack_weight(lm_head, b) for b in candidates}
    for rows in DECODE_ROWS:
        xs = _inputs(swept[0], rows)
        for b in candidates:  # warm-up: primitive creation for these shapes
            for w, p in zip(swept[0], packed[b][0], strict=True):
                apply_linear(xs[w.shape[1]], w, None, b, p)
        layer_best = {b: float("inf") for b in candidates}
        sweep = functools.partial(_record_sweep, layer_best, swept, packed, xs)
        head = time_head(lm_head, candidates, (rows,), SWEEP_REPEATS, head_packed, sweep)
        for b in candidates:
            best[b]["decode"].append(layer_best[b])
            best[b]["head"].extend(head[b])


def _scores(
    candidates: Sequence[str],
    layers: Sequence[Sequence[torch.Tensor]],
    lm_head: torch.Tensor,
    repeats: int,
    prefill_rows: int,
) -> Times:
    """Per candidate and group, the best time seen for each measurement: the decode sweeps
    (`_decode_times`), then each of the first layer's projections at `prefill_rows`
    (compute-bound: cache does not matter). Rounds interleave the candidates, so a burst of
    load from a neighbour (services starting beside the engine) slows every candidate's round
    alike instead of deciding the choice."""
    best: Times = {b: {g: [] for g in GROUPS} for b in candidates}
    _decode_times(candidates, layers, lm_head, best)
    xs = _inputs(layers[0], prefill_rows)
    prefill = {b: [_call(b, w, xs[w.shape[1]]) for w in layers[0]] for b in candidates}
    for b in candidates:
        best[b]["prefill"] = [float("inf")] * len(layers[0])
        for call in prefill[b]:
            call()  # warm-up
    for _ in range(repeats):
        for b in candidates:
            for i, call in enumerate(prefill[b]):
                best[b]["prefill"][i] = min(best[b]["prefill"][i], _time(call))
    return best


def choose_backend(
    layers: Sequence[Sequence[torch.Tensor]],
    lm_head: torch.Tensor,
    requested: str = "auto",
    repeats: int = REPEATS,
    prefill_rows: int = MAX_PREFILL_ROWS,
) -> GemmChoice:
    """The backends to use: `requested` everywhere when it is not "auto" (refused when
    unsupported), else the fastest supported candidates measured on these weights.
    `layers`: each decoder layer's projection weights; `prefill_rows`: the largest batch the
    engine runs (its step token budget)."""
    dtype = lm_head.dtype
    if requested != "auto":
        if not backend_supported(requested, dtype):
            raise ValueError(f"linear backend {requested!r} is not available for {dtype}")
        return GemmChoice(requested, {})
    if lm_head.device.type != "cpu":
        return GemmChoice("dense", {})
    candidates = [b for b in BACKENDS if backend_supported(b, dtype)]
    rows = max(DENSE_ABOVE_ROWS + 1, min(prefill_rows, MAX_PREFILL_ROWS))
    with torch.inference_mode():
        times = _scores(candidates, layers, lm_head, repeats, rows)
    score = {g: {b: sum(times[b][g]) for b in candidates} for g in GROUPS}
    best = min(candidates, key=lambda b: score["decode"][b])
    head = fastest({b: times[b]["head"] for b in candidates})
    prefill = score["prefill"]
    dense_above = (
        DENSE_ABOVE_ROWS
        if best != "dense" and prefill["dense"] < (1 - DENSE_MARGIN) * prefill[best] else None
    )
    logger.info(
        "linear backend %s%s, LM head %s (measured ms, layer decode / layer prefill at %d "
        "rows / LM head: %s)",
        best, f", F.linear above {dense_above} rows" if dense_above else "", head, rows,
        ", ".join(f"{b} {score['decode'][b] * 1e3:.1f} / {prefill[b] * 1e3:.1f} / "
                  f"{score['head'][b] * 1e3:.1f}" for b in candidates),
    )
    return GemmChoice(best, score["decode"], prefill, dense_above, score["head"], head)
