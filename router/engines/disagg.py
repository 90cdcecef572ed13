"""Prefill/decode disaggregation on the router: one request, a prefill engine then a decode
engine, relayed as one engine stream (docs/disaggregation.md).

Role: `plan_disagg` decides whether a request goes through the two stages (the fleet has
prefill-role and decode-role engines, the prompt reaches `--disagg-prefill-threshold`
tokens, one sample, no LoRA adapter) and which engines: the prefill engines in the
decision's ranking order (prefix-aware: the same selector as colocated routing) and the
least loaded decode engine (fewest requests, then lowest KV usage); the prompt blocks the
index says that engine caches are not sent. `open_disagg_stream`
opens the prefill engine's Prefill stream, which names that decode engine, and returns a
`DisaggStream` as soon as the first token is in; the relay reads it like any EngineStream.

Invariants:
- The first token goes to the client as the prefill engine sends it (before the transfer).
- Before the first token, a failing prefill engine is replaced by the next one (like any
  engine); if none answers, the request goes whole to a decode engine.
- After it, a failed transfer (prefill engine died, decode engine refused, timeout) never
  fails the request: the decode engine recomputes the prompt and first token
  (GenerateImported without a transfer), exactly. A decode engine failing after the
  handoff ends the stream with its error (the request is committed to it), as colocated.
- Both calls are cancelled on close, so each engine frees the request's blocks; the decode
  engine also frees KV it received and nobody claimed (engine.disagg.kv_imports).
- Routing-wise the request counts in flight on the decode engine while its stream is open.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
import grpc.aio
from opentelemetry import trace

from kvfleet.contracts import keepalive
from kvfleet.contracts.errors import UnavailableError
from kvfleet.contracts.redis_schema import ROLE_DECODE, ROLE_PREFILL
from kvfleet.runtime.tracing import tracer
from kvfleet.v1 import engine_pb2
from router.engines.dispatch import (
    RETRYABLE_CODES,
    EngineStream,
    StreamDeadlines,
    open_engine_stream,
)
from router.engines.pool import EnginePool
from router.routing.pending import PendingClaims
from router.routing.ranking import EngineView

logger = logging.getLogger(__name__)

DEFAULT_PREFILL_THRESHOLD = 256
DEFAULT_TRANSFER_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class DisaggConfig:
    """Prompts of at least `prefill_threshold` tokens go through a prefill engine first."""

    prefill_threshold: int = DEFAULT_PREFILL_THRESHOLD
    transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S


@dataclass(frozen=True)
class DisaggPlan:
    prefill: list[EngineView]  # the decision's order
    decode: EngineView
    # The other decode engines, least loaded first: where the request is recomputed when
    # `decode` fails before its first message.
    spare_decode: tuple[EngineView, ...] = ()


def without_prefill_engines(ranking: Sequence[EngineView]) -> list[EngineView]:
    """The engines that take whole requests (prefill-only engines last, as a last resort)."""
    whole = [v for v in ranking if v.role != ROLE_PREFILL]
    return whole + [v for v in ranking if v.role == ROLE_PREFILL]


def plan_disagg(
    ranking: Sequence[EngineView], num_prompt_tokens: int, config: DisaggConfig,
    *, num_samples: int = 1, lora_id: str = "",
) -> DisaggPlan | None:
    if num_samples != 1 or lora_id or num_prompt_tokens < config.prefill_threshold:
        return None
    prefill = [v for v in ranking if v.role == ROLE_PREFILL]
    decode = [v for v in ranking if v.role == ROLE_DECODE]
    if not prefill or not decode:
        return None
    ordered = sorted(decode, key=lambda v: (v.load, v.kv_cache_usage, v.engine_id))
    return DisaggPlan(prefill, ordered[0], tuple(ordered[1:]))


def first_engine(
    ranking: Sequence[EngineView], num_prompt_tokens: int, config: DisaggConfig,
    *, num_samples: int = 1, lora_id: str = "",
) -> EngineView | None:
    """The engine `open_request_stream` sends the request to first: the first prefill
    engine of a disaggregated plan, else the first engine taking whole requests (what a
    decision holds until the send, router.routing.pending)."""
    if not ranking:
        return None
    plan = plan_disagg(ranking, num_prompt_tokens, config, num_samples=num_samples,
                       lora_id=lora_id)
    return plan.prefill[0] if plan is not None else without_prefill_engines(ranking)[0]


class DisaggStream(EngineStream):
    """The prefill engine's first token, then the decode engine's stream."""

    def __init__(self, plan: DisaggPlan, prefill: EngineView,
                 prefill_call: grpc.aio.UnaryStreamCall, first: engine_pb2.GenerateResponse,
                 request: engine_pb2.PrefillRequest, pool: EnginePool,
                 deadlines: StreamDeadlines) -> None:
        super().__init__(plan.decode, prefill_call, first, pool, deadlines.stall_s)
        self._spares = list(plan.spare_decode)
        self._decoding = False  # a decode engine's first message arrived
        self.prefill_engine = prefill
        self._prefill_call = prefill_call
        self._request = request
        self._deadlines = deadlines
        self._first_token = first.token_ids[0] if first.token_ids else 0
        # A first token that ended the request: the prefill call is the whole stream.
        self._needs_handoff = not first.HasField("finish_reason")
        self._num_cached_tokens = first.num_cached_tokens
        # The prefill engine's own push has this limit; a silent one gets a little more.
        self._transfer_wait_s = request.transfer_timeout_s + deadlines.stall_s

    async def read(self) -> engine_pb2.GenerateResponse | None:
        if self._needs_handoff and self._pending is None:  # the first token went out
            self._needs_handoff = False
            await self._hand_off()
        message = await self._read_decode()
        if message is not None and message.HasField("finish_reason"):
            message.num_cached_tokens = self._num_cached_tokens
        return message

    async def _read_decode(self) -> engine_pb2.GenerateResponse | None:
        """The next message; a decode engine failing before its first one is replaced by
        the next spare, which recomputes (nothing of the request reached the client from it)."""
        while True:
            try:
                message = await super().read()
            except grpc.aio.AioRpcError as e:
                if self._decoding or not self._spares or e.code() not in RETRYABLE_CODES:
                    raise
                failed = self.engine
                self._pool.mark_suspect(failed.engine_id, failed.address)
                self._pool.end(failed.engine_id)
                self.engine = self._spares.pop(0)
                self._pool.begin(self.engine.engine_id, 0)
                self._pool.prefilled(self.engine.engine_id, 0)
                logger.warning("decode engine %s failed (%s); %s recomputes the request",
                               failed.engine_id, e.code().name, self.engine.engine_id)
                self._open_decode("")
                continue
            if self._call is not self._prefill_call:
                self._decoding = True
            return message

    async def _hand_off(self) -> None:
        """Wait for the transfer's result, then open the decode engine's stream (recompute
        there when the transfer failed)."""
        with tracer().start_as_current_span("kv_handoff") as span:
            span.set_attribute("kvfleet.disagg.prefill_engine", self.prefill_engine.engine_id)
            span.set_attribute("kvfleet.disagg.decode_engine", self.engine.engine_id)
            transfer_id = await self._transfer_result(span)
        self._open_decode(transfer_id)

    def _open_decode(self, transfer_id: str) -> None:
        imported = engine_pb2.ImportedGenerateRequest(
            request=self._request.request, transfer_id=transfer_id,
            first_token_id=self._first_token,
        )
        self._call = self._pool.stub(self.engine.engine_id, self.engine.address).GenerateImported(
            imported, metadata=self._deadlines.metadata() + self._pool.credential,
        )

    async def _transfer_result(self, span: trace.Span) -> str:
        try:
            async with asyncio.timeout(self._transfer_wait_s or None):
                return await self._read_transfer(span)
        except (grpc.aio.AioRpcError, UnavailableError, TimeoutError) as e:
            logger.warning("KV transfer %s failed (%s); %s recomputes the prompt",
                           self._request.transfer_id, e or "timeout", self.engine.engine_id)
            span.set_attribute("kvfleet.disagg.fallback", "recompute")
            self._prefill_call.cancel()
            return ""

    async def _read_transfer(self, span: trace.Span) -> str:
        while True:
            message = await self._prefill_call.read()
            if message is grpc.aio.EOF:
                raise UnavailableError("prefill stream ended without a transfer result")
            assert isinstance(message, engine_pb2.PrefillResponse)
            if message.HasField("transfer"):
                result = message.transfer
                self._num_cached_tokens = result.num_cached_tokens
                span.set_attribute("kvfleet.disagg.blocks", result.num_blocks)
                span.set_attribute("kvfleet.disagg.bytes", result.num_bytes)
                span.set_attribute("kvfleet.disagg.seconds", result.seconds)
                span.set_attribute("kvfleet.disagg.transport", result.transport)
                return result.transfer_id

    async def abort(self, request_id: str) -> engine_pb2.GenerateResponse | None:
        """A stop string in the first token: no handoff at all (the prefill engine has
        already freed the request; cancelling the call drops its transfer)."""
        if self._call is self._prefill_call:
            self.close()
            return engine_pb2.GenerateResponse(num_cached_tokens=self._num_cached_tokens)
        return await super().abort(request_id)

    def close(self) -> None:
        self._prefill_call.cancel()
        super().close()


async def open_request_stream(
    ranking: Sequence[EngineView], pool: EnginePool, request: engine_pb2.GenerateRequest,
    num_samples: int, max_attempts: int, deadlines: StreamDeadlines, config: DisaggConfig,
    on_retry: Callable[[str], None] | None = None, claims: PendingClaims | None = None,
) -> EngineStream:
    """A request's first stream: through a prefill engine then a decode engine when the
    fleet is disaggregated and the prompt long enough, else whole, on the ranking's engines
    that take whole requests (router.engines.dispatch)."""
    plan = plan_disagg(ranking, len(request.prompt_token_ids), config,
                       num_samples=num_samples, lora_id=request.lora_id)
    if plan is not None:
        stream = await open_disagg_stream(
            plan, pool, request, max_attempts, deadlines, config, claims
        )
        if stream is not None:
            return stream
    return await open_engine_stream(
        without_prefill_engines(ranking), pool, request, max_attempts, deadlines,
        on_retry=on_retry, claims=claims,
    )


async def open_disagg_stream(
    plan: DisaggPlan, pool: EnginePool, request: engine_pb2.GenerateRequest,
    max_attempts: int, deadlines: StreamDeadlines, config: DisaggConfig,
    claims: PendingClaims | None = None,
) -> DisaggStream | None:
    """The first prefill engine that sends a first token; None if none did. Like a whole
    request, it counts as prefilling on the prefill engine until then, with the prompt's
    blocks marked pending there (`claims`, released if it fails)."""
    for engine in plan.prefill[:max_attempts]:
        prefill = engine_pb2.PrefillRequest(
            request=request, decode_address=plan.decode.address,
            transfer_id=uuid.uuid4().hex, transfer_timeout_s=config.transfer_timeout_s,
            # What the decode engine already caches of the prompt is not sent again.
            skip_blocks=plan.decode.matched_blocks,
        )
        call = pool.stub(engine.engine_id, engine.address).Prefill(
            prefill, metadata=deadlines.metadata() + pool.credential
        )
        prefill_tokens = 0
        if claims is not None:
            claims.claim(engine)
            prefill_tokens = claims.uncached_tokens(engine.engine_id)
        pool.begin(engine.engine_id, prefill_tokens)
        try:
            first = await _first_output(call, engine, pool, deadlines)
        except BaseException:
            call.cancel()
            raise
        finally:
            pool.prefilled(engine.engine_id, prefill_tokens)
            pool.end(engine.engine_id)
        if first is None and claims is not None:
            claims.release(engine)
        if first is not None:
            pool.begin(plan.decode.engine_id, 0)  # ended by close(), like any EngineStream
            pool.prefilled(plan.decode.engine_id, 0)
            return DisaggStream(plan, engine, call, first, prefill, pool, deadlines)
    return None


async def _first_output(
    call: grpc.aio.UnaryStreamCall, engine: EngineView, pool: EnginePool,
    deadlines: StreamDeadlines,
) -> engine_pb2.GenerateResponse | None:
    """The Prefill stream's first token message; None (call cancelled) when it failed."""
    limit = deadlines.first_token_s
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(limit or None) as timer:
            while True:
                message = await call.read()
                if message is grpc.aio.EOF:
                    break
                assert isinstance(message, engine_pb2.PrefillResponse)
                if not keepalive.is_keepalive(message.output):
                    return message.output
                if limit:  # silence is what counts: each keep-alive restarts the wait
                    timer.reschedule(loop.time() + limit)
    except TimeoutError:
        logger.warning("prefill engine %s silent before the first token", engine.engine_id)
    except grpc.aio.AioRpcError as e:
        if e.code() not in RETRYABLE_CODES:
            raise
        logger.warning("prefill engine %s failed: %s %s", engine.engine_id, e.code().name,
                       e.details())
    pool.mark_suspect(engine.engine_id, engine.address)
    call.cancel()
    return None
