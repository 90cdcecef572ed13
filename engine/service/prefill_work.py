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
  with prompt tokens give a point (p, t - d x decode_s_per_seq), and the prefill rate is
  1 / the slope of an exponentially weighted least-squares line through them,
  t = a + p / rate: a step's fixed cost (scheduling, the sampler, a layer pass whatever its
  width: tens of ms on CPU) is the intercept, not a per-token cost. A ratio of averages
  charged it to the tokens: after a warm-up of a few tiny prompts (p ~ 5, t ~ 65 ms) it read
  ~75 tok/s on an engine computing well over 1,000, and routers overvalued a prefill ~13x
  until real traffic moved it. The slope is trusted once p has spread (`MIN_FIT_SPREAD_TOKENS`);
  before that, steps averaging `MIN_RATIO_TOKENS` prompt tokens or more give the ratio of
  averages (steady large chunks: the fixed cost is a minor share), smaller ones give 0.0.
  Until a kind of step has been measured its figure is 0.0, which routers read as "unknown"
  (their default rate, router.routing.ttft_cost).

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
# The affine fit's slope is trusted once the steps' prompt tokens have this standard
# deviation: at ~1,000 tok/s that is ~64 ms of signal against a few ms of step jitter.
MIN_FIT_SPREAD_TOKENS = 64.0
# The fit removes a fixed cost from the ratio of averages, so it can only raise the rate; by
# at most this factor (the fixed cost at most 7/8 of the average step), so that jitter that
# flattens the line cannot publish a near-infinite rate (queued prompts then cost nothing).
MAX_FIT_GAIN = 8.0
# Without that spread, steps averaging this many prompt tokens give the ratio of averages
# (a fixed cost of tens of ms is a minor share of them); smaller ones give "unknown".
MIN_RATIO_TOKENS = 256.0


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


class _AffineFit:
    """Exponentially weighted least squares of y = a + b x (each sample's weight decays by
    1 - EWMA_ALPHA per newer sample): the moments are EWMA'd sums, so the fit follows the
    engine as the EWMAs do, and data lying exactly on a line gives that line exactly."""

    def __init__(self) -> None:
        self.weight = 0.0
        self._x = self._y = self._xx = self._xy = 0.0

    def add(self, x: float, y: float) -> None:
        keep = 1.0 - EWMA_ALPHA
        self.weight = keep * self.weight + 1.0
        self._x = keep * self._x + x
        self._y = keep * self._y + y
        self._xx = keep * self._xx + x * x
        self._xy = keep * self._xy + x * y

    def mean_x(self) -> float:
        return self._x / self.weight if self.weight else 0.0

    def mean_y(self) -> float:
        return self._y / self.weight if self.weight else 0.0

    def var_x(self) -> float:
        return max(self._xx / self.weight - self.mean_x() ** 2, 0.0) if self.weight else 0.0

    def slope(self) -> float:
        """b, or 0.0 while x has not varied."""
        var = self.var_x()
        if var <= 0.0:
            return 0.0
        return (self._xy / self.weight - self.mean_x() * self.mean_y()) / var


class StepRates:
    """The engine's measured prefill rate and decode step time (module docstring)."""

    def __init__(self) -> None:
        # Prompt tokens of a step -> the prompt share of its time (seconds).
        self._prefill = _AffineFit()
        self._decode_s_per_seq = 0.0
        self._started = 0.0
        self._decoding = 0

    @property
    def prefill_tokens_per_s(self) -> float:
        """1 / the fitted seconds per prompt token once the steps' sizes spread enough to
        tell a token's cost from the step's fixed cost; before that, the ratio of averages
        when steps are large (the fixed cost is then a small share), else 0.0 (unknown)."""
        fit = self._prefill
        if fit.var_x() >= MIN_FIT_SPREAD_TOKENS ** 2:
            per_token = fit.slope()
            if per_token > 0.0 and fit.mean_y() > 0.0:
                return min(1.0 / per_token, MAX_FIT_GAIN * fit.mean_x() / fit.mean_y())
        if fit.mean_x() >= MIN_RATIO_TOKENS and fit.mean_y() > 0.0:
            return fit.mean_x() / fit.mean_y()
        return 0.0

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
        self._prefill.add(prompt_tokens, prompt_s)


def _ewma(average: float, sample: float) -> float:
    return sample if average <= 0 else average + EWMA_ALPHA * (sample - average)
