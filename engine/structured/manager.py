"""The engine's structured-output manager: compile (cached), per-sample matchers, step masks.

Role: `LLMEngine.add_request` asks `matcher_for` for a constrained request's matcher (the
compile happens there, in the engine thread before the request enters the scheduler, so a
compile error fails that request alone with INVALID_ARGUMENT); the runner asks `allowed_masks`
for the sampled rows' allowed-token masks each step. It keeps the figures metrics read
(requests, compile times, mask time per step).

Invariants:
- The backend is built on first use (an llguidance tokenizer takes 0.2 s for SmolLM2's 49k
  vocabulary): engines that never see a constrained request never pay for it.
- Compiled grammars are cached by the constraint's key (LRU, `CACHE_SIZE` entries), so the
  n samples of a request, and repeated schemas, compile once.
- Unconstrained rows never reach this module.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence

import torch

from engine.structured import bitmask
from engine.structured.backend import CompiledGrammar, GrammarBackend, GrammarMatcher
from engine.structured.reasoning_gate import ReasoningGate, markers_for
from kvfleet.contracts.structured_outputs import StructuredOutputsParams

CACHE_SIZE = 256


class StructuredOutputManager:
    def __init__(self, make_backend: Callable[[], GrammarBackend]) -> None:
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._cache: collections.OrderedDict[str, CompiledGrammar] = collections.OrderedDict()
        self.num_requests = 0
        # Observations not yet taken by metrics (engine thread only, like the step itself);
        # bounded, for engines whose metrics never take them (the offline LLM).
        self.pending_compile_seconds: collections.deque[float] = collections.deque(maxlen=4096)
        self.pending_mask_seconds: collections.deque[float] = collections.deque(maxlen=4096)

    @property
    def backend(self) -> GrammarBackend:
        if self._backend is None:
            self._backend = self._make_backend()
        return self._backend

    def matcher_for(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher for one sample; InvalidFieldError if the constraint cannot compile."""
        key = params.key
        compiled = self._cache.get(key)
        if compiled is None:
            backend = self.backend  # built outside the timing: it is not a compile
            start = time.perf_counter()
            try:
                compiled = backend.compile(params)
            finally:  # a failed compile took time too
                self.pending_compile_seconds.append(time.perf_counter() - start)
            self._cache[key] = compiled
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        self.num_requests += 1
        matcher = compiled.new_matcher()
        if params.reasoning_end is None:
            return matcher
        backend = self.backend
        markers = markers_for(params.reasoning_start, params.reasoning_end, backend.tokenize)
        return ReasoningGate(matcher, markers, backend.token_bytes)

    def allowed_masks(self, matchers: Sequence[GrammarMatcher], vocab_size: int) -> torch.Tensor:
        """bool [len(matchers), vocab_size]: the tokens each matcher allows next."""
        start = time.perf_counter()
        packed = bitmask.allocate(len(matchers), self.backend.vocab_size)
        for row, matcher in enumerate(matchers):
            matcher.fill_bitmask(packed, row)
        return self._unpacked(packed, vocab_size, start)

    def draft_masks(
        self, matcher: GrammarMatcher, drafts: Sequence[int], vocab_size: int
    ) -> torch.Tensor:
        """bool [len(drafts) + 1, vocab_size]: row j allows what may follow drafts[:j].

        The matcher consumes the drafts the grammar accepts (checked first: a refused token
        would leave it in its error state for good) to fill the rows, and is rolled back
        after, so it still matches only the committed tokens. Rows past the first refused
        draft stay all allowed: verification rejects that draft on its own row, so they are
        never used.
        """
        start = time.perf_counter()
        packed = bitmask.allocate(len(drafts) + 1, self.backend.vocab_size)
        valid = matcher.validate_tokens(drafts)
        for row in range(valid + 1):
            matcher.fill_bitmask(packed, row)
            if row < valid:
                matcher.accept_token(drafts[row])
        matcher.rollback(valid)
        return self._unpacked(packed, vocab_size, start)

    def _unpacked(self, packed: torch.Tensor, vocab_size: int, start: float) -> torch.Tensor:
        allowed = bitmask.unpack(packed, vocab_size)
        self.pending_mask_seconds.append(time.perf_counter() - start)
        return allowed

    def take_observations(self) -> tuple[list[float], list[float]]:
        """(seconds of each compile, seconds of each mask fill) since the last call."""
        compile_s, mask_s = list(self.pending_compile_seconds), list(self.pending_mask_seconds)
        self.pending_compile_seconds.clear()
        self.pending_mask_seconds.clear()
        return compile_s, mask_s
