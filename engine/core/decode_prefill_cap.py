"""Caps the prompt tokens a step computes while it also decodes (a decode-role engine's policy).

Why: on a CPU a prompt token costs about what a whole decode row's share of the weights
does not: measured on SmolLM2-135M, one thread, a step of 4 decode rows took 1.05x its
decode-only time with 4 prompt tokens beside them, 1.31x with 8, 3.0x with 32 and 8.0x with
96. A decode engine (engine.disagg) still computes the short prompts the router does not
send to a prefill engine, and a 32-token chat prompt joining a decode step stretches every
decoding stream's gap by 2-3x. With a cap, a prompt beside decodes is chunked over several
steps of near-decode size; a step with nothing to decode computes prompts at full budget.

Invariants:
- Only tokens of requests that are prefilling (no token sampled yet, or more than one left to
  compute; not an imported request, whose prompt KV is already there) count against the
  cap; decode rows, draft verification and imported requests are never held back by it.
- The cap holds only in steps that decode (some running request is not prefilling) and
  only with chunked prefill (without it a prompt is scheduled whole or not at all, and a cap
  would starve it); 0 or None means no cap.
- Prompts keep their order: a prompt the step has no room for keeps its place for the next.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.core.request import Request


def is_prefilling(request: Request) -> bool:
    """Computing prompt tokens: none sampled yet, or more than one token left (a recompute
    after preemption), and not KV a prefill engine computed."""
    if request.kv_imported:
        return False
    return request.num_output_tokens == 0 or request.num_tokens - request.num_computed_tokens > 1


class PrefillCap:
    """One step's allowance of prompt tokens beside its decodes (None: unlimited)."""

    def __init__(self, left: int | None) -> None:
        self.left = left

    @classmethod
    def for_step(cls, cap: int | None, chunked_prefill: bool,
                 running: Iterable[Request]) -> PrefillCap:
        if not cap or not chunked_prefill:
            return cls(None)
        decodes = any(not is_prefilling(request) for request in running)
        return cls(cap if decodes else None)

    def limit(self, request: Request, budget: int) -> int:
        """The tokens `request` may take out of `budget` this step (0: none, keep waiting)."""
        if self.left is None or not is_prefilling(request):
            return budget
        return min(budget, self.left)

    def take(self, request: Request, num_new_tokens: int, prefilling: bool) -> None:
        """Charge a scheduled chunk; `prefilling` as `is_prefilling` said before it."""
        if self.left is not None and prefilling:
            self.left = max(0, self.left - num_new_tokens)
