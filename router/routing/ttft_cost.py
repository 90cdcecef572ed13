"""The prefix policy's cost: each engine's estimated time to first token for one request.

Role: pure arithmetic over `EngineView`s, shared by the ranking (`router.routing.ranking`),
the pending entries a decision writes (`router.routing.pending`: how long they count) and the
prediction it records (`router.routing.decision`).

The estimate for engine e, in seconds:

    queued_e   = max(queued_prefill_tokens_e, own_prefill_tokens_e)
    own_e      = prompt - (device + host + pending matched tokens) + (1 - host_hit_weight) * host
                 + duplicate_weight * (most matched tokens of any engine - matched tokens here)
    pressure_e = clamp((kv_cache_usage_e - kv_pressure_start) / (1 - kv_pressure_start), 0, 1)
    ttft_e     = (queued_e + own_e * (1 + kv_pressure_weight * pressure_e)) / prefill_rate_e
                 + decoding_e * decode_s_per_seq_e

- queued: prompt tokens the engine still has to compute before (or alongside) this request.
  The published figure includes other routers' requests but lags a step and a flush; this
  router's own requests without a first token are exact for its own traffic, so the larger
  of the two counts (as `EngineView.load` does for request counts).
- own: what this request adds. Pending matches cost nothing here: the request that claimed
  them is already in `queued`, and this one reuses its blocks once they are computed.
  A host-tier block skips the compute but costs a copy back (`host_hit_weight` of its worth).
- pressure: an engine whose KV cache is nearly full must evict (other prefixes) or preempt
  to host new blocks; its own compute is counted up to `1 + kv_pressure_weight` times.
- decoding: requests past their prompt share each step with the prefill; one decode step
  of them costs decoding x decode_s_per_seq (`max(published, this router's in-flight
  streams past their first token)`).
- duplicate: prompt tokens another engine already holds (or is computing) cost more than
  their compute time when computed here again: the duplicate takes that much capacity from
  the requests behind it, which a per-request time to first token does not see. Without this
  term, a second request of a prefix whose first is still queued would go to an idle engine
  for a one-suffix gain, and each prefix would end up computed everywhere: exactly the
  round-robin hit rate the policy exists to beat. `duplicate_weight` 1.0 charges the
  compute again; 0 ranks by time alone (spill whenever the estimate elsewhere is shorter).
  At 0.5, a follow-up whose holder was computing two new prefixes while the other engine was
  idle spilled (1,120 tokens of wait against 544 + 256), and on the 2-engine benchmark at
  2 req/s two prefixes were computed twice (hit rate 97.7% of the ceiling); at 1.0 the holder
  keeps it until about three prefixes' work is queued ahead (with the 20% tie tolerance).

Ties: estimates within `tie_rel` (20%) of the best plus `tie_abs_s` (10 ms) are equal; the
ranking then prefers, among them, the engine holding most of the prompt, then the rendezvous
hash (`router.routing.ranking`). Rates measured on alike engines differ by noise, and a new
prefix must spread over them by the hash rather than all go to whichever measured fastest.

Alike engines: a measured rate within a factor `1 + rate_alike` (1.25) of the mean of the
decision's rates is read as the mean (of two engines: up to 1.67x apart). Engines of one model
on one kind of hardware measure rates that differ by noise (steps of other sizes, neighbours on
a shared host: two engines of one CPU fleet measured rates far enough apart, under load, to
break the tie), and a noisy rate must neither pull every new prefix to one engine nor move a
hot one; a different GPU or model differs by more than that and keeps its own rate.

Defaults, for engines that publish none of this yet (older engines, the first seconds): a
missing rate is the mean of the rates the other engines of the decision publish, else the
config default; missing queued tokens are `num_waiting` prompts as long as this one; missing
decoding is `num_running`. So an all-old fleet is ranked by matched blocks and load, as
before, and a mixed one compares like with like.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from router.routing.engine_view import UNKNOWN, EngineView

# Used when no engine of a decision publishes its rates (the order of a small model on CPU;
# only the ratio of the two matters while every engine uses them).
DEFAULT_PREFILL_TOKENS_PER_S = 1000.0
DEFAULT_DECODE_S_PER_SEQ = 0.01


@dataclass(frozen=True)
class PrefixPolicyConfig:
    """The prefix policy's cost model (see the module docstring)."""

    # What a host-tier block is worth against a device block (1.0): the share of its
    # compute that a reload saves.
    host_hit_weight: float = 0.5
    default_prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    default_decode_s_per_seq: float = DEFAULT_DECODE_S_PER_SEQ
    # KV usage from which an engine is penalised for new blocks, and the penalty at 100%.
    kv_pressure_start: float = 0.9
    kv_pressure_weight: float = 2.0
    # Estimates within tie_rel of the best plus tie_abs_s are ties (`near_best`): measured
    # rates of alike engines differ by noise, which must not decide where a new prefix goes.
    tie_rel: float = 0.2
    tie_abs_s: float = 0.01
    # Extra share of the compute charged for prompt tokens another engine already holds or
    # is computing (the capacity a duplicate takes from later requests); 0: time alone.
    duplicate_weight: float = 1.0
    # Rates within a factor 1 + rate_alike of the decision's mean count as the mean.
    rate_alike: float = 0.25

    def __post_init__(self) -> None:
        if not 0.0 <= self.host_hit_weight <= 1.0:
            raise ValueError(f"host hit weight must be in [0, 1], got {self.host_hit_weight}")
        if self.default_prefill_tokens_per_s <= 0 or self.default_decode_s_per_seq < 0:
            raise ValueError("default rates must be positive")
        if not 0.0 <= self.kv_pressure_start < 1.0 or self.kv_pressure_weight < 0:
            raise ValueError("kv pressure start must be in [0, 1) and its weight >= 0")
        if self.tie_rel < 0 or self.tie_abs_s < 0:
            raise ValueError("tie tolerances must be >= 0")
        if self.duplicate_weight < 0:
            raise ValueError(f"duplicate weight must be >= 0, got {self.duplicate_weight}")
        if self.rate_alike < 0:
            raise ValueError(f"rate alike must be >= 0, got {self.rate_alike}")

    def score(self, engine: EngineView) -> float:
        """Cached-prefix score of an engine for this prompt, in device blocks."""
        return (engine.matched_blocks + self.host_hit_weight * engine.matched_host_blocks
                + engine.matched_pending_blocks)


@dataclass(frozen=True)
class RequestShape:
    """What the cost needs to know about the request: its prompt and the block size."""

    prompt_tokens: int
    block_size: int


@dataclass(frozen=True)
class Estimate:
    """One engine's cost for one request."""

    engine_id: str
    ttft_s: float
    # Prompt tokens the engine already holds or is computing for another request.
    matched_tokens: int
    # Prompt tokens this request makes it compute (its share of `queued` once sent there).
    own_tokens: int
    # Prompt tokens queued there before it (`queued_e`): work counted exactly, free of the
    # measured rates' noise (the ranking's tie-break).
    queued_tokens: int = 0


@dataclass(frozen=True)
class _FleetRates:
    prefill_tokens_per_s: float
    decode_s_per_seq: float


def infer_shape(engines: Sequence[EngineView], block_size: int = 16) -> RequestShape:
    """A shape for callers that know no prompt length: one block past the longest match."""
    longest = max((_matched_blocks(e) for e in engines), default=0)
    return RequestShape((longest + 1) * block_size, block_size)


def estimate_all(
    engines: Sequence[EngineView], shape: RequestShape, config: PrefixPolicyConfig
) -> dict[str, Estimate]:
    """{engine id: its estimate} for every engine (module docstring)."""
    rates = _fleet_rates(engines, config)
    most = max((_matched_tokens(e, shape) for e in engines), default=0)
    return {e.engine_id: _estimate(e, shape, config, rates, most) for e in engines}


def near_best(estimates: Mapping[str, Estimate], config: PrefixPolicyConfig) -> set[str]:
    """Engines whose estimate is within the tie tolerance of the best one."""
    if not estimates:
        return set()
    best = min(e.ttft_s for e in estimates.values())
    limit = best * (1.0 + config.tie_rel) + config.tie_abs_s
    return {i for i, e in estimates.items() if e.ttft_s <= limit}


def _estimate(
    e: EngineView, shape: RequestShape, config: PrefixPolicyConfig, fleet: _FleetRates,
    most_matched: int,
) -> Estimate:
    rate = _own_or_fleet(e.prefill_tokens_per_s, fleet.prefill_tokens_per_s, config)
    step = _own_or_fleet(e.decode_s_per_seq, fleet.decode_s_per_seq, config)
    published_queue = (e.queued_prefill_tokens if e.queued_prefill_tokens != UNKNOWN
                       else e.num_waiting * shape.prompt_tokens)
    queued = max(published_queue, e.own_prefill_tokens)
    published_decoding = e.num_decoding if e.num_decoding != UNKNOWN else e.num_running
    decoding = max(published_decoding, e.in_flight - e.own_prefilling)
    matched = _matched_tokens(e, shape)
    host = min(e.matched_host_blocks * shape.block_size, matched)
    own = shape.prompt_tokens - matched
    duplicate = most_matched - matched
    work = own + (1.0 - config.host_hit_weight) * host + config.duplicate_weight * duplicate
    pressure = (e.kv_cache_usage - config.kv_pressure_start) / (1.0 - config.kv_pressure_start)
    work *= 1.0 + config.kv_pressure_weight * min(max(pressure, 0.0), 1.0)
    ttft = (queued + work) / rate + decoding * step
    return Estimate(e.engine_id, ttft, matched, own, queued)


def _own_or_fleet(measured: float, mean: float, config: PrefixPolicyConfig) -> float:
    """The engine's rate, or the fleet's mean when unknown or alike (module docstring)."""
    if measured <= 0:
        return mean
    alike = 1.0 + config.rate_alike
    return mean if mean / alike <= measured <= mean * alike else measured


def _matched_tokens(e: EngineView, shape: RequestShape) -> int:
    # The engine always computes the last prompt token, so at most prompt - 1 are matched.
    return min(_matched_blocks(e) * shape.block_size, max(shape.prompt_tokens - 1, 0))


def _matched_blocks(e: EngineView) -> int:
    return e.matched_blocks + e.matched_host_blocks + e.matched_pending_blocks


def _fleet_rates(engines: Sequence[EngineView], config: PrefixPolicyConfig) -> _FleetRates:
    prefill = [e.prefill_tokens_per_s for e in engines if e.prefill_tokens_per_s > 0]
    decode = [e.decode_s_per_seq for e in engines if e.decode_s_per_seq > 0]
    return _FleetRates(
        sum(prefill) / len(prefill) if prefill else config.default_prefill_tokens_per_s,
        sum(decode) / len(decode) if decode else config.default_decode_s_per_seq,
    )
