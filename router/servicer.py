"""RouterServicer: the kvfleet.v1.Router gRPC service (Generate).

Role: a thin pipeline, one step per collaborator:
authenticate (`auth`) -> validate -> tokenize (`tokenizer_client`) -> rank engines
(`routing`) -> start on the best engine, retrying others before the first token (`forward`)
-> relay text (`relay`).

Invariants:
- Errors are raised, not set: ValueError -> INVALID_ARGUMENT, UnavailableError ->
  UNAVAILABLE, downstream statuses relayed (kvfleet.errors); only UNAUTHENTICATED is set
  here with `context.abort`, as kvfleet.errors has no exception for it.
- The tenant is the engine request's `cache_salt`, so tenants never share cached blocks.
- Whatever way the stream ends (finished, stop string, client cancel, error), the engine call
  is cancelled if still open and the detokenize stream closed: a cancelled client request
  frees its engine blocks at once.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator

import grpc
import grpc.aio
from opentelemetry import trace

from kvfleet.grpc_server import Service
from kvfleet.logs import set_request_id, set_tenant
from kvfleet.metrics import status_label
from kvfleet.stop_strings import StopStringMatcher
from kvfleet.tracing import tracer
from kvfleet.v1 import common_pb2, engine_pb2, router_pb2, router_pb2_grpc
from router.auth import AuthenticationError, Authenticator
from router.engine_pool import EnginePool
from router.forward import open_engine_stream
from router.metrics import RouterMetrics
from router.relay import ResponseRelay
from router.routing import EngineSelector
from router.tokenizer_client import TokenizerClient

logger = logging.getLogger(__name__)

SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
# Engines accept 256 characters; the router appends a 13-character suffix.
MAX_REQUEST_ID_LEN = 200
# Engines tried per request (the first choice plus retries before the first token).
DEFAULT_MAX_ATTEMPTS = 3


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(
        self,
        auth: Authenticator,
        tokenizer: TokenizerClient,
        selector: EngineSelector,
        pool: EnginePool,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self._metrics = metrics if metrics is not None else selector.metrics
        self._auth = auth
        self._tokenizer = tokenizer
        self._selector = selector
        self._pool = pool
        self._max_attempts = max_attempts

    def as_service(self) -> Service:
        return Service(
            SERVICE_NAME, lambda server: router_pb2_grpc.add_RouterServicer_to_server(self, server)
        )

    async def Generate(
        self, request: router_pb2.RouterGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.RouterGenerateResponse]:
        tenant = ["unknown"]  # known after authentication
        error: BaseException | None = None
        try:
            # aclosing: a client that goes away closes the pipeline now (engine call cancelled).
            async with contextlib.aclosing(self._generate(request, context, tenant)) as stream:
                async for response in stream:
                    yield response
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._metrics.requests.labels(tenant[0], status_label(error, context)).inc()

    async def _generate(
        self,
        request: router_pb2.RouterGenerateRequest,
        context: grpc.aio.ServicerContext,
        tenant_out: list[str],
    ) -> AsyncGenerator[router_pb2.RouterGenerateResponse, None]:
        tenant = await self._authenticate(context)
        tenant_out[0] = tenant
        set_tenant(tenant)
        span = trace.get_current_span()  # the RPC's server span (kvfleet.tracing)
        params = request.sampling_params
        validate_request(request)
        matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        request_id = request.request_id or uuid.uuid4().hex
        set_request_id(request_id)
        # Client ids need only be unique per client; engines need them unique per engine.
        engine_request_id = (
            f"{request_id}-{uuid.uuid4().hex[:12]}" if request.request_id else request_id
        )
        span.set_attribute("kvfleet.tenant", tenant)
        span.set_attribute("gen_ai.request.id", request_id)
        with tracer().start_as_current_span("tokenize"):
            prompt_ids = await self._prompt_ids(request)
        with tracer().start_as_current_span("route") as route_span:
            decision = await self._selector.decide(prompt_ids, tenant, request.model)
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
        engine_request = engine_pb2.GenerateRequest(
            request_id=engine_request_id,
            prompt_token_ids=prompt_ids,
            sampling_params=params,
            priority=request.priority,
            cache_salt=tenant,
        )
        stream = await open_engine_stream(
            decision.ranking, self._pool, engine_request, self._max_attempts
        )
        chosen = stream.engine.engine_id
        predicted = min(stream.engine.matched_blocks * decision.block_size, len(prompt_ids) - 1)
        self._metrics.record_decision(decision.policy.value, chosen, predicted)
        span.set_attribute("kvfleet.routing.policy", decision.policy.value)
        span.set_attribute("kvfleet.routing.engine_id", chosen)
        span.set_attribute("kvfleet.routing.predicted_cached_tokens", predicted)
        span.set_attribute("gen_ai.usage.prompt_tokens", len(prompt_ids))
        skip_special = (
            params.skip_special_tokens if params.HasField("skip_special_tokens") else True
        )
        detokenizer = self._tokenizer.detokenizer(prompt_ids, skip_special)
        relay = ResponseRelay(
            request_id, engine_request_id, prompt_ids, params.min_tokens, stream, detokenizer,
            matcher,
        )
        try:
            async for response in relay.responses():
                if response.HasField("finish_reason"):
                    self._metrics.record_cached(chosen, predicted, response.num_cached_tokens)
                    span.set_attribute("kvfleet.cached_tokens", response.num_cached_tokens)
                    span.set_attribute(
                        "gen_ai.usage.completion_tokens", response.usage.completion_tokens
                    )
                    span.set_attribute("gen_ai.response.finish_reasons", [response.finish_reason])
                yield response
        finally:
            stream.close()
            detokenizer.cancel()

    async def _authenticate(self, context: grpc.aio.ServicerContext) -> str:
        try:
            return self._auth.tenant_for(context.invocation_metadata())
        except AuthenticationError as e:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))
            raise  # unreachable: abort raises

    async def _prompt_ids(self, request: router_pb2.RouterGenerateRequest) -> list[int]:
        if request.WhichOneof("input") == "prompt_token_ids":
            ids = list(request.prompt_token_ids.ids)
            if not ids:
                raise ValueError("prompt_token_ids must not be empty")
            return ids
        return await self._tokenizer.tokenize(request)


def validate_request(request: router_pb2.RouterGenerateRequest) -> None:
    """ValueError naming the field for what the router itself cannot serve.

    Sampling values are the engine's to check (it answers INVALID_ARGUMENT, relayed as is).
    """
    if request.WhichOneof("input") is None:
        raise ValueError("input must be set: one of prompt, messages or prompt_token_ids")
    if len(request.request_id) > MAX_REQUEST_ID_LEN:
        raise ValueError(f"request_id must be at most {MAX_REQUEST_ID_LEN} characters")
    params: common_pb2.SamplingParams = request.sampling_params
    if params.HasField("n") and params.n != 1:
        raise ValueError(f"sampling_params.n must be 1 (one completion per call); got {params.n}")
