"""`EngineView`: what one routing decision knows about one live engine.

Role: the value the pure policies (`router.routing.ranking`, `router.routing.ttft_cost`) rank,
built by `router.routing.decision` from the engine's registry entry (Redis, or its own GetLoad
answer), the prefix index's match for the prompt and this router's own pool.

Invariants: immutable; every figure an engine may not publish (an older engine, or one in its
first seconds) has a sentinel meaning "unknown" (-1 for counts, 0.0 for rates) that the cost
model replaces with a default, never reads as a real zero.
"""

from __future__ import annotations

from dataclasses import dataclass

UNKNOWN = -1


@dataclass(frozen=True)
class EngineView:
    """What a routing decision knows about one live engine."""

    engine_id: str
    address: str
    # Leading blocks of this prompt that the engine holds in its prefix cache (on the device).
    matched_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    # This router's requests currently streaming from the engine (before or after their
    # first token).
    in_flight: int = 0
    # Blocks continuing that run which the engine holds in its host tier.
    matched_host_blocks: int = 0
    # Sequences the engine runs at once at most (0: not published); see
    # router.routing.lora_placement.
    max_num_seqs: int = 0
    # The engine's epoch (its pending entries are keyed by it; "" when unknown).
    epoch: str = ""
    # Blocks continuing that run which a router just sent there, not yet published (pending).
    matched_pending_blocks: int = 0
    # Published by the engine with its load (UNKNOWN / 0.0: not published): prompt tokens
    # still to compute in its queue, requests past their prompt, and its measured rates.
    queued_prefill_tokens: int = UNKNOWN
    num_decoding: int = UNKNOWN
    prefill_tokens_per_s: float = 0.0
    decode_s_per_seq: float = 0.0
    # This router's requests sent to the engine that have no first token yet, and the prompt
    # tokens they make it compute (their uncached part): work the published figures may not
    # show yet.
    own_prefilling: int = 0
    own_prefill_tokens: int = 0
    # prefill, decode or both (kvfleet.contracts.redis_schema.ROLES; router.engines.disagg).
    role: str = "both"
    # The engine's context length (its --max-model-len) as published with its load (0: not
    # published): the pipeline checks the prompt against it without asking the engine.
    max_model_len: int = 0

    @property
    def load(self) -> int:
        return max(self.num_running + self.num_waiting, self.in_flight)
