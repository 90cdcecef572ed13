"""What an engine publishes for the routers' cost model: queued prompt work and its rates.

Role: routers rank engines by an estimated time to first token (router.routing.ttft_cost),
which needs, per engine, the prompt tokens still to compute and how fast this engine computes
prompt tokens and decode steps. Both are measured here, on the engine thread, and published
with the load (`engine.service.engine_state.EngineLoad`, then Redis; field names in
kvfleet/contracts/redis_schema.py).

- `queued_prefill_tokens`: prompt tokens still to compute over the running and waiting
  requests, in scheduling order. A waiting request's leading blocks that the prefix cache
  holds (device or host tier) cost nothing, and neither do blocks an earlier request in the
  queue will compute first (it then hits them): a hot prefix queued twenty times counts
  once, as the engine will compute it once. Swapped requests resume by a copy, not a
  prefill, and are left out. Past `MAX_SCANNED` requests the rest count in full (bounded
  work per step for pathological queues).
- `StepRates`: EWMAs over the engine's own steps. A step of d decoding requests and p prompt
  tokens took t seconds: pure decode steps (p = 0) measure `decode_s_per_seq` = t / d; steps
  with prompt tokens measure the prefill rate as EWMA(p) / EWMA(t - d x decode_s_per_seq),
  a token-weighted throughput (a ratio of averages: a few small chunks with their fixed
  overhead do not drag it down as an average of ratios would). Until a kind of step has been
  seen its figure is 0.0, which routers read as "unknown".

Invariants: engine thread only (it walks the scheduler's queues and the block pool); reads,
never changes, the cache or the queues. Draft tokens of speculative decoding count as prompt
tokens of their step (a slight overestimate of the prefill rate while drafting); an urgent
step run inside a step (engine.core.urgent_step) adds its time but not its tokens to that step
(a slight underestimate). Both only shift the rate routers divide by, alike for all engines.
"""

from __future__ import annotations

import itertools
import time

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.llm_engine import LLMEngine
from engine.core.request import Request
from kvfleet.contracts.block_hash import BlockHash

# Requests whose blocks are looked up per load snapshot at most.
MAX_SCANNED = 256
# Weight of the newest step in the EWMAs: about the last ten steps count.
EWMA_ALPHA = 0.1
# The prompt part of a mixed step is at least this share of it (a stale decode estimate
# must not make the prefill rate explode).
MIN_PREFILL_SHARE = 0.25


def queued_prefill_tokens(engine: LLMEngine) -> int:
    """Prompt tokens still to compute in running and waiting requests (module docstring)."""
    scheduler, kv = engine.scheduler, engine.kv
    claimed: set[BlockHash] = set()
    total = 0
    queue = itertools.chain(scheduler.running, scheduler.waiting)
    for scanned, request in enumerate(queue):
        if scanned >= MAX_SCANNED:
            total += _left_to_compute(request)
        elif request.num_computed_tokens == 0:
            total += _uncached_tokens(request, kv, claimed)
        else:  # partly computed: the rest is its own (a later request may share it)
            total += _left_to_compute(request)
            claimed.update(request.block_hashes)
    return total


def decoding_requests(engine: LLMEngine) -> int:
    """Running requests past their prompt (each computes one token a step)."""
    return sum(1 for r in engine.scheduler.running if r.num_computed_tokens >= r.num_prompt_tokens)


def _left_to_compute(request: Request) -> int:
    # A decoding request has exactly one token uncomputed: that is decode, not prefill.
    left = request.num_tokens - request.num_computed_tokens
    return 0 if request.num_computed_tokens >= request.num_prompt_tokens else left


def _uncached_tokens(request: Request, kv: KVCacheManager, claimed: set[BlockHash]) -> int:
    """Tokens a not yet started request will compute; its blocks join `claimed`."""
    bs = kv.block_size
    # The last token is always computed (its logits are needed): no block ending there hits.
    max_blocks = (request.num_tokens - 1) // bs
    hits = 0
    for block_hash in request.block_hashes[:max_blocks]:
        if not (block_hash in claimed or _cached(kv, block_hash)):
            break
        hits += 1
    claimed.update(request.block_hashes[hits:max_blocks])
    return request.num_tokens - hits * bs


def _cached(kv: KVCacheManager, block_hash: BlockHash) -> bool:
    if not kv.enable_caching:
        return False
    if kv.pool.get_cached_block(block_hash) is not None:
        return True
    return kv.host_tier is not None and kv.host_tier.get(block_hash) is not None


class StepRates:
    """The engine's measured prefill rate and decode step time (module docstring)."""

    def __init__(self) -> None:
        self._tokens = 0.0  # EWMA of prompt tokens per prefill step
        self._seconds = 0.0  # EWMA of the prompt share of those steps' time
        self._decode_s_per_seq = 0.0
        self._started = 0.0
        self._decoding = 0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self._tokens / self._seconds if self._seconds > 0 else 0.0

    @property
    def decode_s_per_seq(self) -> float:
        return self._decode_s_per_seq

    def before_step(self, engine: LLMEngine) -> None:
        self._decoding = decoding_requests(engine)
        self._started = time.perf_counter()

    def after_step(self, engine: LLMEngine) -> None:
        self.observe(time.perf_counter() - self._started, engine.last_step_num_tokens,
                     self._decoding)

    def observe(self, seconds: float, num_tokens: int, num_decoding: int) -> None:
        """One step: its duration, the tokens it scheduled, its decoding requests."""
        if num_tokens <= 0 or seconds <= 0:
            return  # nothing scheduled: an idle or preempt-only step says nothing of speed
        prompt_tokens = max(num_tokens - num_decoding, 0)
        if prompt_tokens == 0:
            self._decode_s_per_seq = _ewma(self._decode_s_per_seq, seconds / num_decoding)
            return
        decode_s = num_decoding * self._decode_s_per_seq
        prompt_s = max(seconds - decode_s, MIN_PREFILL_SHARE * seconds)
        self._tokens = _ewma(self._tokens, prompt_tokens)
        self._seconds = _ewma(self._seconds, prompt_s)


def _ewma(average: float, sample: float) -> float:
    return sample if average <= 0 else average + EWMA_ALPHA * (sample - average)
