"""`EngineServicer`: the kvfleet.v1.Engine gRPC service over an `AsyncEngine`.

Role: a thin adapter. It converts protos to engine types and back; every problem with a
request is raised as ValueError naming the field, and `kvfleet.runtime.interceptors` maps it to
INVALID_ARGUMENT (UnavailableError -> UNAVAILABLE, anything else -> INTERNAL).

Invariants:
- proto3 `optional` presence is respected: an unset field takes the default documented in
  common.proto (which may differ from the engine's offline defaults, e.g. max_tokens unset
  means "up to the remaining context"), an explicit zero stays zero.
- Fields the engine cannot honour are refused rather than silently ignored: n > 1 (the
  router fans a request out into n engine requests) and an adapter (`lora_id`) the engine
  does not serve. Stop strings are the router's job (on this text), as the engine proto
  specifies: `stop` only turns on token_text_ends for several-token messages, and
  `include_stop_str_in_output` only decides whether the ending EOS / stop token adds text.
- Cancelling a Generate call closes the `AsyncEngine.generate` iterator, which aborts the
  request and frees its KV blocks (the interceptor closes handler generators promptly).
- Every Generate message carries engine_id and its text_delta (`output_text`: the engine
  detokenizes its own output, so no token waits on the tokenizer service); the last one
  carries finish_reason, stop_reason, usage and num_cached_tokens. Logprob entries carry
  their decoded_token. With `kvfleet-keepalive-s` metadata, empty keep-alive messages come
  between them while the engine progresses (`keepalive`).
- While `health_problem()` names a problem (the step watchdog: stalled or dead engine),
  Generate is refused with UNAVAILABLE and that message, so the caller goes elsewhere; once
  the engine thread died, GetLoad is refused too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc.aio
from opentelemetry import trace

from engine.core.request import TenantShare
from engine.disagg.grpc_connector import GrpcKVConnector
from engine.disagg.kv_imports import ImportedStart
from engine.disagg.metrics import TransferMetrics
from engine.disagg.prefill import prefill_responses
from engine.disagg.receiver import ShmAccess, receive_kv
from engine.disagg.transfer import KVConnector
from engine.logprobs import Logprob, TokenLogprobs
from engine.lora.request import LoRARequest
from engine.service.async_engine import AsyncEngine
from engine.service.engine_state import GenerateOutput
from engine.service.output_text import StreamText, TokenTexts
from kvfleet.contracts import keepalive
from kvfleet.contracts.adapter_paths import AdapterRoots
from kvfleet.contracts.errors import UnavailableError
from kvfleet.contracts.sampling_params import SamplingParams
from kvfleet.contracts.sampling_proto import to_sampling_params
from kvfleet.runtime.grpc_server import Service
from kvfleet.runtime.logs import request_context
from kvfleet.runtime.tracing import wall_time_ns
from kvfleet.text.output_rules import TextDelta
from kvfleet.v1 import common_pb2, engine_pb2, engine_pb2_grpc

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name
MAX_REQUEST_ID_LEN = 256


@dataclass(frozen=True)
class EngineIdentity:
    """What GetLoad reports besides load: fixed for the life of the process."""

    engine_id: str
    model_name: str
    block_size: int
    max_model_len: int
    epoch: str


class EngineServicer(engine_pb2_grpc.EngineServicer):
    def __init__(
        self,
        engine: AsyncEngine,
        identity: EngineIdentity,
        health_problem: Callable[[], str | None] = lambda: None,
        adapter_roots: AdapterRoots | None = None,
        connector: KVConnector | None = None,
        transfer_metrics: TransferMetrics | None = None,
    ) -> None:
        self._engine = engine
        # Pushes a prefill's KV to decode engines (engine.disagg); gRPC streaming by default.
        self._connector: KVConnector = connector or GrpcKVConnector()
        self._transfer_metrics = transfer_metrics
        # Where same-host KV transfers' segments are found (engine.disagg.shm).
        self._shm_access = ShmAccess()
        self._adapter_roots = adapter_roots or AdapterRoots()
        self._identity = identity
        self._health_problem = health_problem
        # Immutable once loaded (decode never mutates it): safe to use on the event loop.
        self._tokenizer = engine.engine.tokenizer
        self._token_texts = TokenTexts(self._tokenizer)

    def as_service(self) -> Service:
        return Service(
            SERVICE_NAME, lambda server: engine_pb2_grpc.add_EngineServicer_to_server(self, server)
        )

    async def Generate(
        self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        keepalive_s, params = self._admit(request, context)
        outputs = self._engine.generate(
            request.request_id,
            request.prompt_token_ids,
            params,
            priority=request.priority,
            cache_salt=request.cache_salt or None,
            keepalive_s=keepalive_s,
            share=_share(request),
            lora_name=_lora_name(request.lora_id),
        )
        text = StreamText(self._tokenizer, request.prompt_token_ids, params)
        async for response in self._stream(request, params, outputs, text):
            yield response

    def _admit(
        self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> tuple[float | None, SamplingParams]:
        """The checks every request-running RPC makes first: keep-alive interval, params."""
        _check_request_id(request.request_id)
        keepalive_s = keepalive.parse_interval(context.invocation_metadata())
        if (problem := self._health_problem()) is not None:
            raise UnavailableError(problem)
        params = to_sampling_params(request.sampling_params)
        if params.n != 1:
            raise ValueError(
                f"n must be 1 on an engine (the router fans n > 1 out), got {params.n}"
            )
        return keepalive_s, params

    async def _stream(
        self, request: engine_pb2.GenerateRequest, params: SamplingParams,
        outputs: AsyncIterator[GenerateOutput], text: StreamText,
    ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        span = trace.get_current_span()  # the RPC's server span (kvfleet.runtime.tracing)
        traced = span.is_recording()
        if traced:
            _start_span(span, request, params)
        first_token_time: float | None = None
        first = True
        with request_context(request.request_id, request.cache_salt or None):
            async for output in outputs:
                if traced:
                    now = time.monotonic()
                    if first_token_time is None and output.token_ids:
                        first_token_time = now
                        span.add_event("first_token")
                    if output.finished:
                        _finish_span(span, output, first_token_time, now)
                response = self._response(output, text.delta(output))
                if first and output.prompt_logprobs:
                    response.first_prompt_token_text = self._token_texts(
                        request.prompt_token_ids[0]
                    )
                first = False
                yield response

    # -- prefill/decode disaggregation (engine.disagg, docs/disaggregation.md) -------------

    async def Prefill(
        self, request: engine_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.PrefillResponse]:
        gen = request.request
        keepalive_s, params = self._admit(gen, context)
        if gen.lora_id:
            raise ValueError("lora_id: LoRA requests are not disaggregated (send them whole)")
        if not request.decode_address or not request.transfer_id:
            raise ValueError("decode_address and transfer_id are required")
        outputs = self._engine.generate(
            gen.request_id, gen.prompt_token_ids, params, priority=gen.priority,
            cache_salt=gen.cache_salt or None, keepalive_s=keepalive_s, share=_share(gen),
            prefill_only=True,
        )
        text = StreamText(self._tokenizer, gen.prompt_token_ids, params)
        with request_context(gen.request_id, gen.cache_salt or None):
            async for response in prefill_responses(
                request, outputs, text, self._response, self._connector, self._transfer_metrics
            ):
                yield response

    async def ReceiveKV(
        self, request_iterator: AsyncIterator[engine_pb2.KVTransferChunk],
        context: grpc.aio.ServicerContext,
    ) -> engine_pb2.ReceiveKVResponse:
        if (problem := self._health_problem()) is not None:
            raise UnavailableError(problem)
        try:
            received = await receive_kv(
                self._engine, request_iterator, self._identity.block_size, self._shm_access
            )
        except BaseException:
            if self._transfer_metrics is not None:
                self._transfer_metrics.failed("receive")
            raise
        if self._transfer_metrics is not None:
            self._transfer_metrics.received(received.num_bytes)
        return engine_pb2.ReceiveKVResponse(
            num_blocks=received.num_blocks, num_bytes=received.num_bytes
        )

    async def GenerateImported(
        self, request: engine_pb2.ImportedGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        gen = request.request
        keepalive_s, params = self._admit(gen, context)
        if gen.lora_id:
            raise ValueError("lora_id: LoRA requests are not disaggregated (send them whole)")
        start = ImportedStart(request.first_token_id, request.transfer_id)
        outputs = self._engine.generate(
            gen.request_id, gen.prompt_token_ids, params, priority=gen.priority,
            cache_salt=gen.cache_salt or None, keepalive_s=keepalive_s, share=_share(gen),
            imported=start,
        )
        text = StreamText(self._tokenizer, gen.prompt_token_ids, params)
        # The prefill engine sent the first token's text (never flushed): continue after it.
        text.delta(GenerateOutput(gen.request_id, [request.first_token_id], finished=False))
        async for response in self._stream(gen, params, outputs, text):
            yield response

    async def Abort(
        self, request: engine_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.AbortResponse:
        _check_request_id(request.request_id)
        return engine_pb2.AbortResponse(found=await self._engine.abort(request.request_id))

    async def LoadLoRAAdapter(
        self, request: engine_pb2.LoadLoRAAdapterRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.LoRAAdapterResponse:
        if not request.lora_name or not request.lora_path:
            raise ValueError("lora_name and lora_path are required")
        # Before any file is opened: outside --lora-allowed-dirs, missing and unreadable are
        # one answer, so a caller learns nothing about the file system.
        path = self._adapter_roots.check_loadable(request.lora_path)
        # Index 1: vLLM's integer id has no meaning here (adapters are keyed by name).
        lora = LoRARequest(request.lora_name, 1, path)
        engine = self._engine
        # On the engine thread, between steps: the step reads the registry and the slots.
        await asyncio.wrap_future(
            engine.call_in_engine_thread(lambda: engine.engine.add_lora(lora))
        )
        return await self._adapters()

    async def UnloadLoRAAdapter(
        self, request: engine_pb2.UnloadLoRAAdapterRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.LoRAAdapterResponse:
        name = request.lora_name
        engine = self._engine
        found = await asyncio.wrap_future(
            engine.call_in_engine_thread(lambda: engine.engine.remove_lora(name))
        )
        if not found:
            raise ValueError(f"lora_name: LoRA adapter {name!r} is not loaded")
        return await self._adapters()

    async def _adapters(self) -> engine_pb2.LoRAAdapterResponse:
        engine = self._engine
        names = await asyncio.wrap_future(engine.call_in_engine_thread(
            lambda: [lora.lora_name for lora in engine.engine.list_loras()]
        ))
        return engine_pb2.LoRAAdapterResponse(lora_adapters=names)

    async def GetLoad(
        self, request: engine_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.LoadInfo:
        if (failure := self._engine.progress.failure) is not None:
            raise UnavailableError(failure)  # its load will never change again
        load, identity = self._engine.load, self._identity
        return engine_pb2.LoadInfo(
            engine_id=identity.engine_id,
            num_running=load.num_running,
            num_waiting=load.num_waiting,
            kv_cache_usage=load.kv_cache_usage,
            kv_blocks_total=load.kv_blocks_total,
            kv_blocks_free=load.kv_blocks_free,
            block_size=identity.block_size,
            epoch=identity.epoch,
            model_name=identity.model_name,
            max_model_len=identity.max_model_len,
            lora_adapters=list(load.lora_adapters),
        )

    def _response(self, output: GenerateOutput, text: TextDelta) -> engine_pb2.GenerateResponse:
        response = engine_pb2.GenerateResponse(
            token_ids=output.token_ids, engine_id=self._identity.engine_id,
            text_delta=text.text, token_text_ends=text.token_ends,
        )
        texts = self._token_texts
        if output.logprobs:
            response.logprobs.extend(_logprobs_proto(lp, texts) for lp in output.logprobs)
        if output.prompt_logprobs:
            response.prompt_logprobs.extend(
                _logprobs_proto(lp, texts) for lp in output.prompt_logprobs
            )
        if not output.finished:
            return response
        response.finish_reason = output.finish_reason or "stop"
        if isinstance(output.stop_reason, int):
            response.stop_reason.token_id = output.stop_reason
        elif isinstance(output.stop_reason, str):
            response.stop_reason.stop_string = output.stop_reason
        response.usage.prompt_tokens = output.num_prompt_tokens
        response.usage.completion_tokens = output.num_output_tokens
        response.usage.total_tokens = output.num_prompt_tokens + output.num_output_tokens
        response.num_cached_tokens = output.num_cached_tokens
        return response


def _logprobs_proto(logprobs: TokenLogprobs, texts: TokenTexts) -> common_pb2.TokenLogprobs:
    def one(lp: Logprob) -> common_pb2.Logprob:
        return common_pb2.Logprob(
            token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
            decoded_token=texts(lp.token_id),
        )

    return common_pb2.TokenLogprobs(
        sampled=one(logprobs.sampled), top=[one(lp) for lp in logprobs.top]
    )


def _start_span(
    span: trace.Span, request: engine_pb2.GenerateRequest, params: SamplingParams
) -> None:
    span.set_attribute("gen_ai.request.id", request.request_id)
    span.set_attribute("gen_ai.request.temperature", params.temperature)
    span.set_attribute("gen_ai.request.top_p", params.top_p)
    if params.max_tokens is not None:
        span.set_attribute("gen_ai.request.max_tokens", params.max_tokens)
    span.add_event("queued")


def _finish_span(
    span: trace.Span, output: GenerateOutput, first_token_time: float | None, now: float
) -> None:
    """vLLM's gen_ai.* attributes and the scheduled / preempted / finished events."""
    span.set_attribute("gen_ai.usage.prompt_tokens", output.num_prompt_tokens)
    span.set_attribute("gen_ai.usage.completion_tokens", output.num_output_tokens)
    span.set_attribute("gen_ai.usage.cached_tokens", output.num_cached_tokens)
    span.set_attribute("gen_ai.response.finish_reasons", [output.finish_reason or "stop"])
    timing = output.timing
    if timing is not None:
        arrival = timing.arrival_time
        if timing.first_scheduled_time is not None:
            span.add_event("scheduled", timestamp=wall_time_ns(timing.first_scheduled_time))
            span.set_attribute(
                "gen_ai.latency.time_in_queue", timing.first_scheduled_time - arrival
            )
        for preempted in timing.preemption_times:
            span.add_event("preempted", timestamp=wall_time_ns(preempted))
        if first_token_time is not None:
            span.set_attribute("gen_ai.latency.time_to_first_token", first_token_time - arrival)
        span.set_attribute("gen_ai.latency.e2e", now - arrival)
    span.add_event("finished", {"finish_reason": output.finish_reason or "stop"})


def _check_request_id(request_id: str) -> None:
    if not request_id:
        raise ValueError("request_id must not be empty")
    if len(request_id) > MAX_REQUEST_ID_LEN:
        raise ValueError(f"request_id must be at most {MAX_REQUEST_ID_LEN} characters")


def _lora_name(lora_id: str) -> str | None:
    if len(lora_id) > MAX_REQUEST_ID_LEN:
        raise ValueError(f"lora_id must be at most {MAX_REQUEST_ID_LEN} characters")
    return lora_id or None


def _share(request: engine_pb2.GenerateRequest) -> TenantShare | None:
    """The request's tenant for fair share; only routers can call (kvfleet.runtime.service_auth)."""
    name = request.tenant or request.cache_salt
    if not name:
        return None
    weight = request.fair_share_weight
    return TenantShare(name, weight if weight > 0 else 1.0)
