"""Snapshots the engine thread hands to the event loop: per-request outputs, load, progress.

Role: immutable values built on the engine thread (where `Request` and `LLMEngine` keep
changing) and read anywhere else without a lock. `GenerateOutput` is one step's delta for one
request; `EngineLoad` is the load and KV occupancy at one instant; `StepProgress` is the step
loop's heartbeat, which the watchdog reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.core.llm_engine import LLMEngine
from engine.core.request import Request, RequestTiming
from engine.logprobs import TokenLogprobs
from engine.service.prefill_work import StepRates, decoding_requests, queued_prefill_tokens


@dataclass(frozen=True)
class GenerateOutput:
    """One step's new tokens for one request; the last one has finished=True and the totals."""

    request_id: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop", "length" or "abort" on the last item
    stop_reason: int | str | None = None  # the stop_token_ids entry that matched, if any
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # cumulative
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # On the last item only: when the request was queued / first scheduled / preempted
    # (time.monotonic(), for tracing).
    timing: RequestTiming | None = None
    # Parallel to token_ids when the request asked for logprobs.
    logprobs: Sequence[TokenLogprobs] | None = None
    # On the first item only, when the request asked for prompt_logprobs: one entry per prompt
    # token after the first.
    prompt_logprobs: Sequence[TokenLogprobs] | None = None
    # On the last item of a prefill-only request that handed off (finish_reason "handoff"):
    # its KV (engine.disagg.kv_payload.KVExport), for the connector to send.
    kv_export: object = None

    @classmethod
    def of(
        cls,
        request: Request,
        new_token_ids: Sequence[int],
        finished: bool,
        logprobs: Sequence[TokenLogprobs] | None = None,
        prompt_logprobs: Sequence[TokenLogprobs | None] | None = None,
    ) -> GenerateOutput:
        # Built on the engine thread: a snapshot, since the Request keeps changing there.
        return cls(
            request_id=request.request_id,
            token_ids=list(new_token_ids),
            logprobs=logprobs,
            prompt_logprobs=(
                None if prompt_logprobs is None
                else [lp for lp in prompt_logprobs if lp is not None]
            ),
            finished=finished,
            finish_reason=request.status.finish_reason if finished else None,
            stop_reason=request.stop_reason if finished else None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens or 0,
            timing=RequestTiming.of(request) if finished else None,
            kv_export=request.exported_kv if finished else None,
        )


@dataclass(frozen=True)
class EngineLoad:
    """Load and KV occupancy at one instant (cached free blocks count as free)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    kv_blocks_free: int
    kv_blocks_total: int
    # Names of the LoRA adapters served, in load order (published with the load).
    lora_adapters: tuple[str, ...] = ()
    # Their directories, in the same order (routers load an adapter on another engine from it).
    lora_paths: tuple[str, ...] = ()
    # For the routers' cost model (engine.service.prefill_work): prompt tokens still to
    # compute, requests past their prompt, and the measured rates (0.0: not measured yet).
    queued_prefill_tokens: int = 0
    num_decoding: int = 0
    prefill_tokens_per_s: float = 0.0
    decode_s_per_seq: float = 0.0

    @classmethod
    def of(cls, engine: LLMEngine, rates: StepRates | None = None) -> EngineLoad:
        stats = engine.get_stats()
        loras = engine.list_loras()
        return cls(
            queued_prefill_tokens=queued_prefill_tokens(engine),
            num_decoding=decoding_requests(engine),
            prefill_tokens_per_s=rates.prefill_tokens_per_s if rates is not None else 0.0,
            decode_s_per_seq=rates.decode_s_per_seq if rates is not None else 0.0,
            num_running=int(stats["num_requests_running"]),
            num_waiting=int(stats["num_requests_waiting"]),
            kv_cache_usage=float(stats["kv_cache_usage"]),
            kv_blocks_free=int(stats["kv_blocks_free"]),
            kv_blocks_total=int(stats["kv_blocks_total"]),
            lora_adapters=tuple(lora.lora_name for lora in loras),
            lora_paths=tuple(lora.lora_path for lora in loras),
        )


@dataclass(frozen=True)
class StepProgress:
    """The engine loop's heartbeat, replaced (never mutated) by the engine thread."""

    iterations: int  # loop iterations that began (running commands and/or one step)
    at: float  # time.monotonic() when the current iteration began, or the loop went idle
    idle: bool  # waiting for work: nothing is due, so however old `at` is, all is well
    failure: str | None = None  # set once the engine thread died; final
