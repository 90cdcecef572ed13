"""DisaggStream with fake engine calls: the first token from the prefill engine, then the
decode engine's stream; a failed transfer recomputes on the decode engine; a decode engine
failing before its first message is replaced by the next one, which recomputes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
import grpc.aio
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once

from kvfleet.v1 import engine_pb2
from router.engines.disagg import DisaggConfig, open_disagg_stream, plan_disagg
from router.engines.dispatch import NO_DEADLINES
from router.engines.pool import EnginePool
from router.routing.engine_view import EngineView


class FakeCall:
    def __init__(self, items: Sequence[Any]) -> None:
        self._items = list(items)
        self.cancelled = False

    async def read(self) -> Any:
        if not self._items:
            return grpc.aio.EOF
        item = self._items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class Unavailable(grpc.aio.AioRpcError):
    def __init__(self) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                         details="gone")


def _token(token: int, finish: str | None = None) -> engine_pb2.GenerateResponse:
    response = engine_pb2.GenerateResponse(token_ids=[token])
    if finish is not None:
        response.finish_reason = finish
    return response


class FakeStub:
    def __init__(self, calls: dict[str, list[FakeCall]], engine_id: str,
                 log: list[tuple[str, str, str]]) -> None:
        self._calls, self._id, self._log = calls, engine_id, log

    def Prefill(self, request: engine_pb2.PrefillRequest, **_: Any) -> FakeCall:  # noqa: N802
        self._log.append(("Prefill", self._id, request.decode_address))
        return self._calls[self._id].pop(0)

    def GenerateImported(self, request: engine_pb2.ImportedGenerateRequest,  # noqa: N802
                         **_: Any) -> FakeCall:
        self._log.append(("GenerateImported", self._id, request.transfer_id))
        return self._calls[self._id].pop(0)


def _run(calls: dict[str, list[FakeCall]], decode_ids: Sequence[str]) -> tuple[
        list[int], list[tuple[str, str, str]], EnginePool]:
    pool = EnginePool()
    log: list[tuple[str, str, str]] = []
    pool.stub = lambda engine_id, address: FakeStub(calls, engine_id, log)  # type: ignore[method-assign,assignment,return-value]
    ranking = [EngineView("p0", "p0:1", role="prefill")] + [
        EngineView(d, f"{d}:1", role="decode", num_running=i) for i, d in enumerate(decode_ids)]
    plan = plan_disagg(ranking, 100, DisaggConfig(prefill_threshold=10))
    assert plan is not None

    async def go() -> list[int]:
        request = engine_pb2.GenerateRequest(request_id="r", prompt_token_ids=[1] * 100)
        stream = await open_disagg_stream(plan, pool, request, 2, NO_DEADLINES,
                                          DisaggConfig(prefill_threshold=10))
        assert stream is not None
        tokens: list[int] = []
        cached: list[int] = []
        try:
            while (message := await stream.read()) is not None:
                tokens.extend(message.token_ids)
                if message.HasField("finish_reason"):
                    cached.append(message.num_cached_tokens)
                    break
        finally:
            stream.close()
        # The prefill engine's prefix hits reach the client (through the transfer result).
        assert cached in ([32], [0])
        return tokens

    return asyncio.run(go()), log, pool


def _transfer(transfer_id: str) -> engine_pb2.PrefillResponse:
    return engine_pb2.PrefillResponse(transfer=engine_pb2.KVTransferResult(
        transfer_id=transfer_id, num_blocks=7, num_cached_tokens=32))


def test_first_token_then_decode_engine():
    calls = {"p0": [FakeCall([engine_pb2.PrefillResponse(output=_token(5)), _transfer("t")])],
             "d0": [FakeCall([_token(6), _token(7, "length")])]}
    tokens, log, pool = _run(calls, ["d0"])
    assert tokens == [5, 6, 7]
    assert log == [("Prefill", "p0", "d0:1"), ("GenerateImported", "d0", "t")]
    assert pool.in_flight("d0") == 0


def test_failed_transfer_recomputes_on_the_decode_engine():
    calls = {"p0": [FakeCall([engine_pb2.PrefillResponse(output=_token(5)), Unavailable()])],
             "d0": [FakeCall([_token(6), _token(7, "length")])]}
    tokens, log, _ = _run(calls, ["d0"])
    assert tokens == [5, 6, 7]
    assert log[-1] == ("GenerateImported", "d0", "")


def test_decode_engine_failing_first_is_replaced_by_the_next():
    calls = {"p0": [FakeCall([engine_pb2.PrefillResponse(output=_token(5)), _transfer("t")])],
             "d0": [FakeCall([Unavailable()])],
             "d1": [FakeCall([_token(6), _token(7, "length")])]}
    tokens, log, pool = _run(calls, ["d0", "d1"])
    assert tokens == [5, 6, 7]
    assert log[1:] == [("GenerateImported", "d0", "t"), ("GenerateImported", "d1", "")]
    assert pool.in_flight("d0") == pool.in_flight("d1") == 0


def test_decode_engine_failing_after_its_first_token_ends_the_stream():
    calls = {"p0": [FakeCall([engine_pb2.PrefillResponse(output=_token(5)), _transfer("t")])],
             "d0": [FakeCall([_token(6), Unavailable()])],
             "d1": [FakeCall([_token(6), _token(7, "length")])]}
    with pytest.raises(grpc.aio.AioRpcError):
        _run(calls, ["d0", "d1"])


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """The SDK with an in-memory exporter as the global provider, for one test."""
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    saved = (trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE)  # noqa: SLF001
    trace._TRACER_PROVIDER_SET_ONCE = Once()  # noqa: SLF001 - the API sets it once per process
    trace.set_tracer_provider(provider)
    yield memory
    trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE = saved  # noqa: SLF001
    provider.shutdown()


def test_handoff_span(spans):
    calls = {"p0": [FakeCall([engine_pb2.PrefillResponse(output=_token(5)), _transfer("t")])],
             "d0": [FakeCall([_token(6), _token(7, "length")])]}
    _run(calls, ["d0"])
    (span,) = [s for s in spans.get_finished_spans() if s.name == "kv_handoff"]
    attributes = dict(span.attributes or {})
    assert attributes["kvfleet.disagg.prefill_engine"] == "p0"
    assert attributes["kvfleet.disagg.decode_engine"] == "d0"
    assert attributes["kvfleet.disagg.blocks"] == 7


def test_stop_string_in_the_first_token_aborts_without_a_handoff():
    pool = EnginePool()
    log: list[tuple[str, str, str]] = []
    prefill_call = FakeCall([engine_pb2.PrefillResponse(output=_token(5)), _transfer("t")])
    calls = {"p0": [prefill_call], "d0": [FakeCall([_token(6)])]}
    pool.stub = lambda engine_id, address: FakeStub(calls, engine_id, log)  # type: ignore[method-assign,assignment,return-value]
    ranking = [EngineView("p0", "p0:1", role="prefill"), EngineView("d0", "d0:1", role="decode")]
    plan = plan_disagg(ranking, 100, DisaggConfig(prefill_threshold=10))
    assert plan is not None

    async def go() -> engine_pb2.GenerateResponse | None:
        request = engine_pb2.GenerateRequest(request_id="r", prompt_token_ids=[1] * 100)
        stream = await open_disagg_stream(plan, pool, request, 1, NO_DEADLINES,
                                          DisaggConfig(prefill_threshold=10))
        assert stream is not None
        first = await stream.read()
        assert first is not None and list(first.token_ids) == [5]
        return await stream.abort("r")

    last = asyncio.run(go())
    assert last is not None and last.num_cached_tokens == 0
    assert [entry[0] for entry in log] == ["Prefill"]
    assert prefill_call.cancelled and pool.in_flight("d0") == 0
