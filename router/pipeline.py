"""GenerationPipeline: one generation request end to end, shared by both front doors.

Stages, each one method, called in this order by `GenerationPipeline.generate`:

1. admit     `_admit`: the engine's sampling rules (`kvfleet.contracts.sampling_proto`), the
             router's request limits (`router.request_limits`) and the tenant's rules
             (`router.tenancy.request_rules`: model, priority, max_tokens, choices).
2. tokenize  `_tokenize`: text / chat -> token ids (`router.tokenizer_client`, once per
             request), then `--max-input-tokens`. `_rate_limit` then admits the tenant on the
             prompt's token count (`router.tenancy.rate_limit`): the last admission check,
             after tokenizing because it counts the prompt's tokens.
3. route     `_route`: engines ranked for the prompt (`router.routing.decision`), the prompt
             checked against the context window (`router.engines.context_window`), one engine
             request per sample (`router.engine_requests`).
4. stream    `_stream`: the best engine, others retried before the first token
             (`router.engines.dispatch`); n > 1 fanned out to that engine; each engine stream
             relayed (`router.engines.stream_relay`) and merged (`router.engines.merge`).
5. charge    `_charge`: the generated tokens against the tenant's rate limits, however the
             stream ended.

Parse and render belong to the front doors: `router.servicer` (gRPC: protobuf in and out)
and `router.http.app` with `router.openai` (JSON bodies in, JSON or SSE chunks out). Both
authenticate, then call `generate`. Besides it, the HTTP API asks the pipeline only through
the narrow methods at the end of the class (`check_requests`, `request_limits`,
`served_models`, `tokenize_for_endpoint`, `call_live_engines`, ...).

Invariants:
- Nothing is tokenized or routed before the request passed every check that needs no
  tokens, so a bad request costs no compute anywhere. After tokenizing, the prompt must fit
  `--max-input-tokens` and, once an engine is chosen, that engine's max_model_len with
  max_tokens; max_tokens unset stays unset: the engine generates up to its max_model_len -
  prompt tokens (vLLM's rule).
- n > 1 becomes n engine requests (`kvfleet.contracts.parallel_sampling`: seed + i per
  sample) on the engine chosen for the first one. The siblings are sent once the first has
  produced its first token, so the prompt's full blocks are in that engine's prefix cache and
  they share them; each sample streams with its `index` and ends with its own final message.
- Spans name the tenant, never its key, and carry no prompt text unless the operator asks
  (`trace_prompts`, the router's --trace-prompts: `gen_ai.prompt` on the request's span).
- The tenant is every engine request's `cache_salt`, so tenants never share cached blocks,
  and its `tenant` with its fair-share weight. Over a rate limit raises `RateLimitedError`
  (429 / RESOURCE_EXHAUSTED) before routing.
- An engine's silence is bounded (`router.engines.dispatch.StreamDeadlines`): a stall before
  the first token moves the request to the next engine, after it ends the stream with
  UNAVAILABLE.
- Whatever way the stream ends (finished, stop string, client cancel, error), every engine
  call still open is cancelled: a cancelled client request frees its engine blocks at once.
- The tokenizer service is called once per request (tokenize), never per token: engines
  stream their text already detokenized.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace

from kvfleet.contracts.sampling_params import SamplingParams
from kvfleet.runtime.logs import set_request_id
from kvfleet.runtime.tracing import tracer
from kvfleet.text.stop_strings import StopStringMatcher
from kvfleet.v1 import engine_pb2_grpc, router_pb2, tokenizer_pb2
from router.engine_requests import (
    EngineFields,
    Sample,
    engine_samples,
    prompt_param,
    request_ids,
    traced_prompt,
    validate_request,
)
from router.engines.context_window import ContextWindows, check_fits
from router.engines.disagg import DisaggConfig, first_engine, open_request_stream
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
from router.tenancy.request_rules import TenantRules, check_choices
from router.tenancy.tenant_policy import Tenant
from router.tokenizer_client import TokenizerClient

logger = logging.getLogger(__name__)

# Engines tried per request (the first choice plus retries before the first token).
DEFAULT_MAX_ATTEMPTS = 3

GenerateResponse = router_pb2.RouterGenerateResponse
# One call on one engine: (its stub, the router credential metadata) -> the call's result.
EngineCall = Callable[[engine_pb2_grpc.EngineStub, tuple[tuple[str, str], ...]], Awaitable[Any]]


@dataclass(frozen=True)
class _Admitted:
    """An admitted request: its sampling parameters and what the tenant's policy settled."""

    params: SamplingParams
    rules: TenantRules


@dataclass(frozen=True)
class _Plan:
    """A routed request: the engines ranked for it and the engine request of each sample."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    decision: Decision
    samples: list[Sample]


@dataclass
class _Usage:
    """Completion tokens generated so far, over every sample (what the tenant is charged)."""

    completion_tokens: int = 0


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
        trace_prompts: bool = False,
        disagg: DisaggConfig | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        # Prefill/decode disaggregation; it applies only to fleets with both roles.
        self._disagg = disagg if disagg is not None else DisaggConfig()
        # The operator's opt-in (--trace-prompts): prompts are tenant data, kept out of spans.
        self._trace_prompts = trace_prompts
        self._rate_limiter = rate_limiter
        self._selector = selector
        self._limits = limits if limits is not None else RequestLimits()
        self._pool = pool
        self._metrics = metrics
        self._max_attempts = max_attempts
        self._deadlines = deadlines if deadlines is not None else StreamDeadlines()
        self._windows = ContextWindows(pool)

    async def generate(
        self, request: router_pb2.RouterGenerateRequest, tenant: Tenant,
        on_admitted: Callable[[Admission], None] | None = None,
    ) -> AsyncGenerator[GenerateResponse, None]:
        """Stream the response messages of every sample; raises for a bad request.

        `on_admitted` receives the rate-limit verdict of an admitted request (its headers).
        """
        admitted = self._admit(request, tenant)
        prompt_ids = await self._tokenize(request, tenant.name)
        admission = await self._rate_limit(tenant, len(prompt_ids))
        if on_admitted is not None:
            on_admitted(admission)
        usage = _Usage()
        try:
            plan = await self._route(request, tenant, admitted, prompt_ids)
            async with contextlib.aclosing(self._stream(plan, usage)) as stream:
                async for response in stream:
                    yield response
        finally:
            self._charge(tenant, admission, usage.completion_tokens)

    # Stage 1: admit (every check that needs no tokens).

    def _admit(self, request: router_pb2.RouterGenerateRequest, tenant: Tenant) -> _Admitted:
        params = self._check(request)
        return _Admitted(params, TenantRules.of(request, tenant, params))

    def _check(self, request: router_pb2.RouterGenerateRequest) -> SamplingParams:
        """Sampling rules and request limits; ValueError naming the field."""
        params = validate_request(request)
        self._limits.check_request(request)
        return params

    # Stage 2: tokenize, then the tenant's rate limits on the prompt's tokens.

    async def _tokenize(self, request: router_pb2.RouterGenerateRequest, tenant: str) -> list[int]:
        span = trace.get_current_span()
        span.set_attribute("kvfleet.tenant", tenant)
        if self._trace_prompts:
            span.set_attribute("gen_ai.prompt", traced_prompt(request))
        with tracer().start_as_current_span("tokenize"):
            prompt_ids = await self._prompt_ids(request)
        self._limits.check_prompt_tokens(len(prompt_ids), prompt_param(request))
        return prompt_ids

    async def _prompt_ids(self, request: router_pb2.RouterGenerateRequest) -> list[int]:
        if request.WhichOneof("input") == "prompt_token_ids":
            ids = list(request.prompt_token_ids.ids)
            if not ids:
                raise ValueError("prompt_token_ids must not be empty")
            return ids
        return await self._tokenizer.tokenize(request)

    async def _rate_limit(self, tenant: Tenant, num_prompt_tokens: int) -> Admission:
        if self._rate_limiter is None:
            return Admission(True)
        admission = await self._rate_limiter.admit(tenant, num_prompt_tokens)
        if not admission.allowed:
            raise RateLimitedError(tenant.name, admission)
        return admission

    # Stage 3: route.

    async def _route(
        self, request: router_pb2.RouterGenerateRequest, tenant: Tenant, admitted: _Admitted,
        prompt_ids: list[int],
    ) -> _Plan:
        """The engines ranked for the prompt, which must fit their context window."""
        request_id, engine_request_id = request_ids(request)
        set_request_id(request_id)
        trace.get_current_span().set_attribute("gen_ai.request.id", request_id)
        params, rules = admitted.params, admitted.rules
        field = prompt_param(request)
        largest = self._windows.largest_known()  # before hashing a prompt that cannot fit
        if largest is not None:
            check_fits(len(prompt_ids), params.max_tokens, largest, field)
        decision = await self._decide(prompt_ids, tenant.name, rules.model, request_id,
                                      params.n)
        try:
            max_model_len = await self._max_model_len(decision.ranking[0])
            if max_model_len is not None:
                check_fits(len(prompt_ids), params.max_tokens, max_model_len, field)
            max_tokens = rules.max_tokens(params.max_tokens, len(prompt_ids), max_model_len)
            fields = EngineFields(rules.priority, max_tokens, tenant.limits.weight,
                                  decision.lora_id)
            samples = engine_samples(request, prompt_ids, params, engine_request_id,
                                     tenant.name, fields)
        except BaseException:
            if decision.claims is not None:
                decision.claims.cancel()  # never sent: the engine it held is free again
            raise
        return _Plan(request_id, prompt_ids, params, decision, samples)

    async def _max_model_len(self, engine: EngineView) -> int | None:
        """The chosen engine's context length: the one it published (no wait while the
        decision holds the engine), else its GetLoad answer (an engine that publishes none)."""
        published = self._windows.published(engine)
        if published is not None:
            return published
        return await self._windows.fetch(engine)

    async def _decide(
        self, prompt_ids: Sequence[int], tenant: str, model: str, request_id: str,
        num_samples: int,
    ) -> Decision:
        def first(ranking: Sequence[EngineView], lora_id: str) -> EngineView | None:
            # The engine `_open_first` will send to (a prefill engine in a disaggregated
            # fleet): the decision holds it until the send.
            return first_engine(ranking, len(prompt_ids), self._disagg,
                                num_samples=num_samples, lora_id=lora_id)

        with tracer().start_as_current_span("route") as route_span:
            decision = await self._selector.decide(prompt_ids, tenant, model, first)
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

    # Stage 4: stream (dispatch, n > 1 fan-out, relay).

    async def _stream(self, plan: _Plan, usage: _Usage) -> AsyncGenerator[GenerateResponse, None]:
        """Every sample's messages, tagged with its index; engine calls closed at the end."""
        span = trace.get_current_span()
        streams: list[EngineStream] = []
        try:
            streams.append(await self._open_first(plan))
            chosen = streams[0].engine
            predicted = self._record_choice(span, plan, chosen)
            streams.extend(
                await _open_siblings(chosen, self._pool, plan.samples[1:], self._deadlines)
            )
            merged = merge_tagged([relay.responses() for relay in _relays(plan, streams)])
            async with contextlib.aclosing(merged):
                async for index, response in merged:
                    response.index = index
                    if response.HasField("finish_reason"):
                        usage.completion_tokens += response.usage.completion_tokens
                        self._on_finished(span, chosen.engine_id, predicted, response)
                    yield response
        finally:
            for stream in streams:
                stream.close()

    async def _open_first(self, plan: _Plan) -> EngineStream:
        """Sample 0's stream: prefill then decode engine, or whole (router.engines.disagg)."""
        return await open_request_stream(
            plan.decision.ranking, self._pool, plan.samples[0].engine_request,
            len(plan.samples), self._max_attempts, self._deadlines, self._disagg,
            on_retry=self._metrics.record_retry, claims=plan.decision.claims,
        )

    def _record_choice(self, span: trace.Span, plan: _Plan, chosen: EngineView) -> int:
        """Metrics and span attributes of the engine the request went to; its predicted
        cached prompt tokens."""
        # Held on the device, in the host tier (engines count reloads as cached) or pending.
        predicted = plan.decision.predicted_cached_tokens(chosen)
        reason = plan.decision.reason_for(chosen.engine_id)
        policy = plan.decision.policy.value
        self._metrics.record_decision(policy, chosen.engine_id, predicted, reason)
        claims = plan.decision.claims
        if claims is not None and claims.held_s is not None:
            self._metrics.decision_hold.observe(claims.held_s)
        span.set_attribute("kvfleet.routing.reason", reason)
        span.set_attribute("kvfleet.routing.policy", policy)
        span.set_attribute("kvfleet.routing.engine_id", chosen.engine_id)
        span.set_attribute("kvfleet.routing.predicted_cached_tokens", predicted)
        span.set_attribute("gen_ai.usage.prompt_tokens", len(plan.prompt_ids))
        return predicted

    def _on_finished(
        self, span: trace.Span, engine_id: str, predicted: int, response: GenerateResponse
    ) -> None:
        self._metrics.record_cached(engine_id, predicted, response.num_cached_tokens)
        if response.index == 0:
            span.set_attribute("kvfleet.cached_tokens", response.num_cached_tokens)
            span.set_attribute("kvfleet.routing.prediction_error_tokens",
                               predicted - response.num_cached_tokens)
            span.set_attribute("gen_ai.usage.completion_tokens", response.usage.completion_tokens)
            span.set_attribute("gen_ai.response.finish_reasons", [response.finish_reason])

    # Stage 5: charge.

    def _charge(self, tenant: Tenant, admission: Admission, completion_tokens: int) -> None:
        if self._rate_limiter is not None and admission.backend != "none":
            # A task: the charge must happen even when the stream is being cancelled.
            _spawn(self._rate_limiter.finish(tenant, admission, completion_tokens))

    # What the front doors ask besides `generate` (the HTTP API's other endpoints).

    @property
    def request_limits(self) -> RequestLimits:
        """The router's request limits (frozen): HTTP bodies are read and parsed under them."""
        return self._limits

    def check_requests(
        self, requests: Sequence[router_pb2.RouterGenerateRequest], tenant: Tenant, n: int
    ) -> None:
        """The prompts of one client request (n samples each), every one checked before any
        is started: the choices (the router's and the tenant's cap), then each prompt's
        checks that need no tokens; ValueError naming the field."""
        self._limits.check_choices(n, len(requests))
        check_choices(tenant, n, len(requests))
        for request in requests:
            self._check(request)

    async def served_models(self) -> list[str]:
        """Model names of the live engines (empty: none)."""
        return await self._selector.served_models()

    async def served_adapters(self) -> dict[str, str]:
        """{LoRA adapter name: its base model} over the live engines."""
        return await self._selector.served_adapters()

    async def served_context_lens(self) -> dict[str, int]:
        """{model name: the largest max_model_len its live engines report (0: unknown)}."""
        return await self._selector.served_context_lens()

    async def tokenize_for_endpoint(
        self, request: tokenizer_pb2.TokenizeRequest
    ) -> tokenizer_pb2.TokenizeResponse:
        """The tokenizer service's own Tokenize (HTTP /tokenize), as generation tokenizes."""
        return await self._tokenizer.tokenize_raw(request)

    async def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool) -> str:
        """The text of `token_ids` (HTTP /detokenize, and echo of a token-id prompt)."""
        return await self._tokenizer.detokenize(token_ids, skip_special_tokens)

    async def call_live_engines(self, call: EngineCall) -> list[tuple[str, object]]:
        """`call` on every live engine at once, with the router credential: (engine id, its
        result or the exception it raised) each; empty when no engine is live."""
        engines = await self._selector.live_engines()
        pool = self._pool
        results = await asyncio.gather(
            *(call(pool.stub(e.engine_id, e.address), pool.credential) for e in engines),
            return_exceptions=True,
        )
        return [(e.engine_id, r) for e, r in zip(engines, results, strict=True)]

    def forget_adapter(self, name: str) -> None:
        """A LoRA adapter was unloaded through the API: the loads this replica made of it
        (`router.routing.lora_placement`) no longer count as serving it."""
        placer = self._selector.placer
        if placer is not None:
            placer.forget(name)


_BACKGROUND: set[asyncio.Task[None]] = set()


def _spawn(work: Coroutine[Any, Any, None]) -> None:
    """Run `work` to completion in the background (kept referenced until it is done)."""
    task = asyncio.ensure_future(work)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


async def _open_siblings(
    engine: EngineView, pool: EnginePool, samples: Sequence[Sample], deadlines: StreamDeadlines
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


def _relays(plan: _Plan, streams: Sequence[EngineStream]) -> list[ResponseRelay]:
    """One relay per sample: its engine stream -> client messages, stop strings applied."""
    params = plan.params
    return [
        ResponseRelay(
            plan.request_id, sample.engine_request.request_id, plan.prompt_ids,
            params.min_tokens, stream,
            StopStringMatcher(params.stop, params.include_stop_str_in_output),
        )
        for sample, stream in zip(plan.samples, streams, strict=True)
    ]
