"""Screened greedy argmax over a float32 LM head: the same token as the full float32 logits'
argmax, for about half the LM head's cost.

Why: at a decode step the LM head is the largest single GEMM ([rows, hidden] x [vocab,
hidden]; ~12% of a 64-row float32 step for SmolLM2, more for one row), and a greedy row only
needs the index of its largest logit. The bfloat16 panel GEMM (AVX512-BF16) computes all logits
approximately at twice the float32 rate on half the bytes; a rigorous bound on its error then
leaves a handful of tokens that could be the maximum, and only those are computed exactly, with
the same float32 kernel as the full LM head.

The bound: with h' = bf16(h) and w' = bf16(w) (round to nearest, relative error <= 2^-8 each),
|h.w - h'.w'| <= (2 * 2^-8 + 2^-16) * sum_i |h_i| |w_i| <= ~2^-7 * ||h|| * ||w|| (Cauchy-Schwarz);
both dot products' float32 accumulation over K terms adds <= 2 * K * 2^-24 * the same sum.
`c` below covers both, with a margin. Measured on SmolLM2, one row in a few hundred keeps more
than a handful of candidates.

Both GEMMs the screen may use, the VDPBF16PS panel kernel and the AMX tile kernel
(kernels/cpu/amx_linear.cpp, used where the CPU has AMX), multiply bfloat16 pairs exactly and
sum in float32, in some order: the bound holds for either (the accumulation term covers any
order of K sums; both flush denormal bfloat16 inputs to zero, below any bound that matters).

Whether it pays is measured at start-up (`measure_rows_limit`): without bfloat16 dot products
faster than float32 FMAs (an Intel Xeon without AMX issues one VDPBF16PS where it issues two
FMAs) the screen only halves the bytes, and from some row count the full float32 head is
faster: 64 rows took 26.3 ms screened against 20.4 ms in full there, one row 3.3 against 4.3.

With a final logit soft-cap (Gemma 2) the argmax is over cap * tanh(logit / cap): tanh is
monotonic, but float32 capping can round a smaller logit onto the maximum's value, and the
first of the tied tokens wins. The candidates then also hold every token close enough below
the bound to tie once capped (`screen_candidates`' tie margin, about 1e-3 for logits near
the cap), and only those are capped, by the same ATen ops as `compute_logits`
(`capped_argmax`). The same op screens full logits (no error bound) so that a capped greedy
batch on the full head caps a handful of values per row instead of the whole vocabulary.

Invariants: used only where the LM head's float32 backend is the panel kernel, whose output
column v is one fixed chain of FMAs over x and w_v alone, so recomputing a subset of columns
reproduces the full GEMM's values bit for bit; the argmax over candidates sorted by id takes
the first maximum, as `max(dim).indices` over the full vocabulary does; capped candidates are
padded to whole vectors, so ATen caps every one in its vector loop, as it does a full row of
a vocabulary that is a multiple of 32.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping

import torch

from engine.models.linear import amx_linear, amx_supported, pack_amx, pack_panels, panel_linear


def screen_supported(weight: torch.Tensor, backend: str) -> bool:
    """True where the screen can stand in for the float32 LM head's argmax."""
    from kernels.cpu import load as load_cpu_kernels

    return (
        backend == "panel"
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and load_cpu_kernels()
        and hasattr(torch.ops.kvfleet_cpu, "panel_linear_bf16_f32")
    )


# Row counts measured at start-up, and the best-of repeats per count.
MEASURED_ROWS = (1, 4, 16, 64)
REPEATS = 5
UNLIMITED = 1 << 30
# ATen's vectorised unary loop takes 2 x 16 floats a step (AVX-512); the rest of a tensor goes
# through its scalar loop, whose tanh may round differently.
CAP_PAD = 64
# Beyond this share of the vocabulary as candidates (a saturated cap), screening saves nothing.
MAX_CANDIDATE_SHARE = 8


def capped_argmax(exact: torch.Tensor, candidates: torch.Tensor, cap: float | None) -> list[int]:
    """Per row of `exact` ([M, n] float32 logits of the `candidates`, sorted ids), the id
    of the first maximum after the soft-cap (none: of `exact` itself)."""
    if cap is not None:
        rows, n = exact.shape
        padded = exact.new_zeros(rows, -(-n // CAP_PAD) * CAP_PAD)
        padded[:, :n] = exact
        # compute_logits' ops and order (Gemma's final cap), in place.
        exact = padded.div_(cap).tanh_().mul_(cap)[:, :n]
    return candidates[exact.max(dim=-1).indices].tolist()


def capped_greedy(logits: torch.Tensor, cap: float) -> list[int] | None:
    """argmax of cap * tanh(logits / cap) per row of uncapped float32 `logits` [M, V],
    capping only each row's near-maximal logits; None where a logit is not finite or the cap
    saturates (the caller then caps everything)."""
    logits = logits.contiguous()
    zeros_m = logits.new_zeros(logits.shape[0])
    zeros_v = logits.new_zeros(logits.shape[1])
    if not bool(torch.isfinite(logits.amax(dim=-1)).all()):
        return None  # amax propagates NaN; -inf rows would have no finite maximum
    candidates = torch.ops.kvfleet_cpu.screen_candidates(logits, zeros_m, zeros_v, 0.0, cap)
    if len(candidates) * MAX_CANDIDATE_SHARE > logits.shape[1]:
        return None
    return capped_argmax(logits[:, candidates], candidates, cap)


class GreedyScreen:
    def __init__(self, weight: torch.Tensor, use_amx: bool | None = None) -> None:
        # Batches of more rows than this take the full float32 LM head (measure_rows_limit).
        self.max_rows = UNLIMITED
        w = weight.detach()
        self.weight = w
        self.vocab, k = w.shape
        # AMX tiles where the CPU has them (8x the float32 FMA rate: the screen then costs
        # about what reading the bfloat16 head from memory does), else the VDPBF16PS panels.
        self.amx = amx_supported() if use_amx is None else use_amx
        w_bf16 = w.to(torch.bfloat16)
        self.packed_bf16 = pack_amx(w_bf16) if self.amx else pack_panels(w_bf16)
        # Norms in float64, rounded up a little, so float32 storage never understates them.
        self.w_norm = (w.double().norm(dim=1) * (1 + 1e-6)).float().contiguous()
        accumulation = 2 * k * 2.0**-24
        self.c = 1.05 * (2 * 2.0**-8 + 2.0**-16 + accumulation)

    def argmax(self, hidden: torch.Tensor, cap: float | None = None) -> list[int] | None:
        """Greedy token ids of `hidden`'s rows ([M, hidden] float32), with the final logits
        soft-capped by `cap` if given, or None where the screen does not apply (non-finite
        input, a saturated cap): the caller then takes the full logits."""
        h = hidden.contiguous()
        h_norm = (h.double().norm(dim=1) * (1 + 1e-6)).float()
        if not bool(torch.isfinite(h_norm).all()):
            return None
        approx = self.approx_logits(h)
        candidates = torch.ops.kvfleet_cpu.screen_candidates(
            approx, h_norm.contiguous(), self.w_norm, self.c, cap or 0.0)
        if cap is not None and len(candidates) * MAX_CANDIDATE_SHARE > self.vocab:
            return None
        exact = panel_linear(h, pack_panels(self.weight[candidates]), len(candidates), None)
        return capped_argmax(exact, candidates, cap)

    def approx_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 sums of bfloat16(hidden) x bfloat16(head) products, [M, vocab]."""
        h = hidden.to(torch.bfloat16)
        if self.amx:
            return amx_linear(h, self.packed_bf16, self.vocab, None, out_dtype=torch.float32)
        approx = torch.empty(h.shape[0], self.vocab, dtype=torch.float32)
        torch.ops.kvfleet_cpu.panel_linear_bf16_f32(approx, h, self.packed_bf16, self.vocab)
        return approx


def rows_limit(times: Mapping[int, tuple[float, float]]) -> int:
    """From (screened, full) seconds per measured row count: the largest count up to which
    the screen was faster at every measured count (0: it never was)."""
    limit = 0
    for rows in sorted(times):
        screened, full = times[rows]
        if screened >= full:
            break
        limit = rows
    return limit


def measure_rows_limit(
    screen: GreedyScreen, full_argmax: Callable[[torch.Tensor], object], repeats: int = REPEATS
) -> int:
    """`rows_limit` of the screen against `full_argmax` (the float32 LM head and its argmax)
    on this machine, interleaved, best of `repeats`."""
    hidden_size = screen.weight.shape[1]
    times: dict[int, tuple[float, float]] = {}
    gen = torch.Generator().manual_seed(0)  # leaves the global RNG stream alone
    with torch.inference_mode():
        for rows in MEASURED_ROWS:
            hidden = torch.randn(rows, hidden_size, generator=gen)
            best = [float("inf"), float("inf")]
            calls: list[Callable[[], object]] = [
                functools.partial(screen.argmax, hidden), functools.partial(full_argmax, hidden)]
            for warm in calls:
                warm()
            for _ in range(repeats):
                for i, call in enumerate(calls):
                    start = time.perf_counter()
                    call()
                    best[i] = min(best[i], time.perf_counter() - start)
            times[rows] = (best[0], best[1])
    return rows_limit(times)
