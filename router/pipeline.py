"""GenerationPipeline: one generation request from prompt to text stream, for any front door.

Role: validate -> tokenize (`tokenizer_client`) -> rank engines (`routing`) -> start on the
best engine, retrying others before the first token (`forward`) -> relay text (`relay`).
The gRPC servicer and the OpenAI HTTP API both call `generate` after authenticating.

Invariants:
- Sampling parameters are checked with the engine's own rules (`kvfleet.contracts.sampling_proto`),
  and the request's sizes against the router's limits (`router.request_limits`), before anything
  is tokenized or routed, so a bad request costs no compute anywhere. After tokenizing,
  the prompt must fit `--max-input-tokens` and, once an engine is chosen, that engine's
  max_model_len with max_tokens (`router.engines.context_window`); max_tokens unset stays unset:
  the engine generates up to its max_model_len - prompt tokens (vLLM's rule).
- n > 1 becomes n engine requests (`kvfleet.contracts.parallel_sampling`: seed + i per sample) on the
  engine chosen for the first one. The siblings are sent once the first has produced its
  first token, so the prompt's full blocks are in that engine's prefix cache and they share
  them; each sample streams with its `index` and ends with its own final message.
- The tenant is every engine request's `cache_salt`, so tenants never share cached blocks,
  and its `tenant` with its fair-share weight. Its policy (`router.tenancy.request_rules`) settles the
  model, priority, max_tokens and choices before tokenizing; its rate limits
  (`router.tenancy.rate_limit`) are checked once the prompt is tokenized, before routing: over a
  limit raises `RateLimitedError` (429 / RESOURCE_EXHAUSTED). The generated tokens are
  charged when the request ends, however it ends.
- An engine's silence is bounded (`forward.StreamDeadlines`): a stall before the first
  token moves the request to the next engine, after it ends the stream with UNAVAILABLE.
- Whatever way the stream ends (finished, stop string, client cancel, error), every engine
  call still open is cancelled: a cancelled client request frees its engine blocks at once.
- The tokenizer service is called once per request (tokenize), never per token: engines
  stream their text already detokenized.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace

from kvfleet.contracts.parallel_sampling import child_request_id, child_seed
from kvfleet.contracts.sampling_params import SamplingParams
from kvfleet.contracts.sampling_proto import to_sampling_params
from kvfleet.runtime.logs import set_request_id
from kvfleet.runtime.tracing import tracer
from kvfleet.text.stop_strings import StopStringMatcher
from kvfleet.v1 import common_pb2, engine_pb2, router_pb2
from router.engines.context_window import ContextWindows, check_fits
from router.engines.dispatch import EngineStream, StreamDeadlines, open_engine_stream
from router.engines.merge import merge_tagged
from router.engines.pool import EnginePool
from router.engines.stream_relay import ResponseRelay
from router.metrics import RouterMetrics
from router.request_limits import RequestLimits
from router.routing.decision import Decision, EngineSelector
from router.routing.ranking import EngineView
from router.tenancy.rate_limit import TenantRateLimiter
from router.tenancy.rate_limit_types import Admission, RateLimitedError
from router.tenancy.request_rules import TenantRules
from router.tenancy.tenant_policy import Tenant
from router.tokenizer_client import TokenizerClient

logger = logging.getLogger(__name__)

# Engines accept 256 characters; the router appends up to 18 (suffix and sample index).
MAX_REQUEST_ID_LEN = 200
# Engines tried per request (the first choice plus retries before the first token).
DEFAULT_MAX_ATTEMPTS = 3


@dataclass(frozen=True)
class _EngineFields:
    """What the tenant's policy sets in every engine request of one client request."""

    priority: int
    max_tokens: int | None
    weight: float


@dataclass(frozen=True)
class _Sample:
    index: int
    engine_request: engine_pb2.GenerateRequest


class GenerationPipeline:
    def __init__(
        self,
        tokenizer: TokenizerClient,
        selector: EngineSelector,
        pool: EnginePool,
        metrics: RouterMetrics,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        deadlines: StreamDeadlines | None = None,
        limits: RequestLimits | None = None,
        rate_limiter: TenantRateLimiter | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.rate_limiter = rate_limiter
        self.selector = selector
        self.limits = limits if limits is not None else RequestLimits()
        self._pool = pool
        self._metrics = metrics
        self._max_attempts = max_attempts
        self._deadlines = deadlines if deadlines is not None else StreamDeadlines()
        self._windows = ContextWindows(pool)

    def check(self, request: router_pb2.RouterGenerateRequest) -> SamplingParams:
        """Every check that needs no tokenizing; ValueError naming the field."""
        params = validate_request(request)
        self.limits.check_request(request)
        return params

    async def generate(
        self, request: router_pb2.RouterGenerateRequest, tenant: Tenant,
        on_admitted: Callable[[Admission], None] | None = None,
    ) -> AsyncGenerator[router_pb2.RouterGenerateResponse, None]:
        """Stream the response messages of every sample; raises for a bad request.

        `on_admitted` receives the rate-limit verdict of an admitted request (its headers).
        """
        params = self.check(request)
        rules = TenantRules.of(request, tenant, params)
        prompt_ids = await self._tokenize(request, tenant.name)
        admission = await self._admit(tenant, len(prompt_ids))
        if on_admitted is not None:
            on_admitted(admission)
        generated = [0]
        try:
            async with contextlib.aclosing(
                self._generate(request, tenant, params, rules, prompt_ids, generated)
            ) as stream:
                async for response in stream:
                    yield response
        finally:
            if self.rate_limiter is not None and admission.backend != "none":
                # A task: the charge must happen even when this generator is being cancelled.
                _spawn(self.rate_limiter.finish(tenant, admission, generated[0]))

    async def _tokenize(self, request: router_pb2.RouterGenerateRequest, tenant: str) -> list[int]:
        span = trace.get_current_span()
        span.set_attribute("kvfleet.tenant", tenant)
        with tracer().start_as_current_span("tokenize"):
            prompt_ids = await self.prompt_ids(request)
        prompt_param = "messages" if request.WhichOneof("input") == "messages" else "prompt"
        self.limits.check_prompt_tokens(len(prompt_ids), prompt_param)
        return prompt_ids

    async def _admit(self, tenant: Tenant, num_prompt_tokens: int) -> Admission:
        if self.rate_limiter is None:
            return Admission(True)
        admission = await self.rate_limiter.admit(tenant, num_prompt_tokens)
        if not admission.allowed:
            raise RateLimitedError(tenant.name, admission)
        return admission

    async def _generate(
        self, request: router_pb2.RouterGenerateRequest, tenant: Tenant, params: SamplingParams,
        rules: TenantRules, prompt_ids: list[int], generated: list[int],
    ) -> AsyncGenerator[router_pb2.RouterGenerateResponse, None]:
        span = trace.get_current_span()
        request_id = request.request_id or uuid.uuid4().hex
        set_request_id(request_id)
        # Client ids need only be unique per client; engines need them unique per engine.
        engine_request_id = (
            f"{request_id}-{uuid.uuid4().hex[:12]}" if request.request_id else request_id
        )
        span.set_attribute("gen_ai.request.id", request_id)
        prompt_param = "messages" if request.WhichOneof("input") == "messages" else "prompt"
        largest = self._windows.largest_known()  # before hashing a prompt that cannot fit
        if largest is not None:
            check_fits(len(prompt_ids), params.max_tokens, largest, prompt_param)
        decision = await self._route(prompt_ids, tenant.name, rules.model, request_id)
        max_model_len = await self._windows.max_model_len(decision.ranking[0])
        if max_model_len is not None:
            check_fits(len(prompt_ids), params.max_tokens, max_model_len, prompt_param)
        max_tokens = rules.max_tokens(params.max_tokens, len(prompt_ids), max_model_len)
        samples = _samples(request, prompt_ids, params, engine_request_id, tenant.name,
                           _EngineFields(rules.priority, max_tokens, tenant.limits.weight))
        for sample in samples:  # the model named a LoRA adapter (router.routing.lora_engines)
            sample.engine_request.lora_id = decision.lora_id
        streams: list[EngineStream] = []
        try:
            streams.append(
                await open_engine_stream(
                    decision.ranking, self._pool, samples[0].engine_request, self._max_attempts,
                    self._deadlines, on_retry=self._metrics.record_retry, claims=decision.claims,
                )
            )
            chosen = streams[0].engine
            # Held on the device, in the host tier (engines count reloads as cached) or pending.
            predicted = decision.predicted_cached_tokens(chosen)
            reason = decision.reason_for(chosen.engine_id)
            self._metrics.record_decision(decision.policy.value, chosen.engine_id, predicted,
                                          reason)
            span.set_attribute("kvfleet.routing.reason", reason)
            span.set_attribute("kvfleet.routing.policy", decision.policy.value)
            span.set_attribute("kvfleet.routing.engine_id", chosen.engine_id)
            span.set_attribute("kvfleet.routing.predicted_cached_tokens", predicted)
            span.set_attribute("gen_ai.usage.prompt_tokens", len(prompt_ids))
            streams.extend(await _open_siblings(chosen, self._pool, samples[1:], self._deadlines))
            relays = [
                ResponseRelay(
                    request_id, sample.engine_request.request_id, prompt_ids, params.min_tokens,
                    stream, StopStringMatcher(params.stop, params.include_stop_str_in_output),
                )
                for sample, stream in zip(samples, streams, strict=True)
            ]
            merged = merge_tagged([relay.responses() for relay in relays])
            async with contextlib.aclosing(merged):
                async for index, response in merged:
                    response.index = index
                    if response.HasField("finish_reason"):
                        generated[0] += response.usage.completion_tokens
                        self._on_finished(span, chosen.engine_id, predicted, response)
                    yield response
        finally:
            for stream in streams:
                stream.close()

    @property
    def pool(self) -> EnginePool:
        """This replica's engine channels (fan-out calls such as LoRA loading use them)."""
        return self._pool

    async def prompt_ids(self, request: router_pb2.RouterGenerateRequest) -> list[int]:
        if request.WhichOneof("input") == "prompt_token_ids":
            ids = list(request.prompt_token_ids.ids)
            if not ids:
                raise ValueError("prompt_token_ids must not be empty")
            return ids
        return await self.tokenizer.tokenize(request)

    async def _route(
        self, prompt_ids: Sequence[int], tenant: str, model: str, request_id: str
    ) -> Decision:
        with tracer().start_as_current_span("route") as route_span:
            decision = await self.selector.decide(prompt_ids, tenant, model)
            route_span.set_attribute("kvfleet.routing.policy", decision.policy.value)
            route_span.set_attribute("kvfleet.routing.used_index", decision.used_index)
            route_span.set_attribute(
                "kvfleet.routing.ranking", [v.engine_id for v in decision.ranking]
            )
        if logger.isEnabledFor(logging.DEBUG):
            best = decision.ranking[0]
            logger.debug("%s tenant=%s prompt=%d best=%s matched=%d load=%d index=%s",
                         request_id, tenant, len(prompt_ids), best.engine_id,
                         best.matched_blocks, best.load, decision.used_index)
        return decision

    def _on_finished(
        self,
        span: trace.Span,
        engine_id: str,
        predicted: int,
        response: router_pb2.RouterGenerateResponse,
    ) -> None:
        self._metrics.record_cached(engine_id, predicted, response.num_cached_tokens)
        if response.index == 0:
            span.set_attribute("kvfleet.cached_tokens", response.num_cached_tokens)
            span.set_attribute("kvfleet.routing.prediction_error_tokens",
                               predicted - response.num_cached_tokens)
            span.set_attribute("gen_ai.usage.completion_tokens", response.usage.completion_tokens)
            span.set_attribute("gen_ai.response.finish_reasons", [response.finish_reason])


_BACKGROUND: set[asyncio.Task[None]] = set()


def _spawn(work: Coroutine[Any, Any, None]) -> None:
    """Run `work` to completion in the background (kept referenced until it is done)."""
    task = asyncio.ensure_future(work)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


def validate_request(request: router_pb2.RouterGenerateRequest) -> SamplingParams:
    """The request's sampling parameters; ValueError naming the field for a bad request."""
    if request.WhichOneof("input") is None:
        raise ValueError("input must be set: one of prompt, messages or prompt_token_ids")
    if len(request.request_id) > MAX_REQUEST_ID_LEN:
        raise ValueError(f"request_id must be at most {MAX_REQUEST_ID_LEN} characters")
    return to_sampling_params(request.sampling_params)


def _samples(
    request: router_pb2.RouterGenerateRequest,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    engine_request_id: str,
    tenant: str,
    fields: _EngineFields,
) -> list[_Sample]:
    samples = []
    for index in range(params.n):
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(request.sampling_params)
        sampling.ClearField("n")
        if fields.max_tokens is not None:
            sampling.max_tokens = fields.max_tokens
        request_id = engine_request_id
        if params.n > 1:
            request_id = child_request_id(engine_request_id, index)
            seed = child_seed(params.seed, index)
            if seed is not None:
                sampling.seed = seed
        samples.append(_Sample(index, engine_pb2.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling_params=sampling,
            priority=fields.priority,
            cache_salt=tenant,
            tenant=tenant,
            fair_share_weight=fields.weight,
        )))
    return samples


async def _open_siblings(
    engine: EngineView, pool: EnginePool, samples: Sequence[_Sample], deadlines: StreamDeadlines
) -> list[EngineStream]:
    """Start samples 1..n-1 on the first sample's engine (no retries elsewhere)."""
    if not samples:
        return []
    results = await asyncio.gather(
        *(open_engine_stream([engine], pool, s.engine_request, 1, deadlines) for s in samples),
        return_exceptions=True,
    )
    streams = [r for r in results if isinstance(r, EngineStream)]
    failure = next((r for r in results if isinstance(r, BaseException)), None)
    if failure is not None:
        for stream in streams:
            stream.close()
        raise failure
    return streams
