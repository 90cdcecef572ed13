"""kvfleet.runtime.grpc_server plumbing over real gRPC: error mapping, health, drain, shutdown.

The servicer under test is a scripted kvfleet.v1.Engine whose behaviour is chosen by the
request (which exception to raise, how many tokens to stream and how slowly), so every path
runs through the real server, interceptors and wire format.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvfleet.contracts.errors import INTERNAL_ERROR_MESSAGE, OverloadedError, UnavailableError
from kvfleet.runtime.grpc_server import GrpcServer, Service
from kvfleet.v1 import engine_pb2, engine_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc
from tokenizer_svc.server import build_server

TIMEOUT_S = 30
ENGINE = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name

# request_id -> the exception the scripted servicer raises.
ERRORS: dict[str, Exception] = {
    "value-error": ValueError("temperature must be non-negative, got -1.0"),
    "overloaded": OverloadedError("waiting queue is full (256 requests)"),
    "unavailable": UnavailableError("engine is shutting down"),
    "bug": RuntimeError("secret internal detail"),
    "key-error": KeyError("missing"),
}
EXPECTED = {
    "value-error": (grpc.StatusCode.INVALID_ARGUMENT, str(ERRORS["value-error"])),
    "overloaded": (grpc.StatusCode.RESOURCE_EXHAUSTED, str(ERRORS["overloaded"])),
    "unavailable": (grpc.StatusCode.UNAVAILABLE, str(ERRORS["unavailable"])),
    "bug": (grpc.StatusCode.INTERNAL, INTERNAL_ERROR_MESSAGE),
    "key-error": (grpc.StatusCode.INTERNAL, INTERNAL_ERROR_MESSAGE),
}


class ScriptedEngine(engine_pb2_grpc.EngineServicer):
    """Generate streams prompt_token_ids back, one per message, `priority` ms apart (a
    negative priority: after the first message, wait until the test opens `gate`), then
    raises ERRORS[request_id] if any. Records which streams completed and which closed."""

    def __init__(self) -> None:
        self.completed: list[str] = []
        self.closed: list[str] = []
        self.gate = threading.Event()

    async def Generate(
        self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        try:
            for index, token_id in enumerate(request.prompt_token_ids):
                if index and request.priority < 0:
                    await asyncio.to_thread(self.gate.wait, TIMEOUT_S)
                elif index:
                    await asyncio.sleep(request.priority / 1000)
                yield engine_pb2.GenerateResponse(token_ids=[token_id], engine_id="scripted")
            if request.request_id in ERRORS:
                raise ERRORS[request.request_id]
            self.completed.append(request.request_id)
        finally:  # runs on normal end, error, client cancel and server stop alike
            self.closed.append(request.request_id)

    async def Abort(
        self, request: engine_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.AbortResponse:
        if request.request_id == "explicit-abort":
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such request")
        if request.request_id in ERRORS:
            raise ERRORS[request.request_id]
        return engine_pb2.AbortResponse(found=True)

    async def GetLoad(
        self, request: engine_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.LoadInfo:
        return engine_pb2.LoadInfo(engine_id="scripted", block_size=16)


class WriterEngine(engine_pb2_grpc.EngineServicer):
    """Generate through the reader/writer API (context.write) instead of a generator."""

    async def Generate(
        self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        for token_id in request.prompt_token_ids:
            await context.write(engine_pb2.GenerateResponse(token_ids=[token_id]))
        if request.request_id in ERRORS:
            raise ERRORS[request.request_id]


def engine_server(servicer: engine_pb2_grpc.EngineServicer, **kwargs) -> Callable[[], GrpcServer]:
    service = Service(ENGINE, lambda s: engine_pb2_grpc.add_EngineServicer_to_server(servicer, s))
    return lambda: GrpcServer([service], host="127.0.0.1", port=0, **kwargs)


def generate(stub, request_id: str, tokens: list[int], delay_ms: int = 0):
    request = engine_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=tokens, priority=delay_ms
    )
    return stub.Generate(request, timeout=TIMEOUT_S)


def health_status(channel: grpc.Channel, service: str = "") -> int:
    health = health_pb2_grpc.HealthStub(channel)
    return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S).status


@pytest.fixture
def scripted(threaded_server):
    servicer = ScriptedEngine()
    server = threaded_server(engine_server(servicer))
    with grpc.insecure_channel(server.address) as channel:
        yield servicer, server, engine_pb2_grpc.EngineStub(channel), channel


# -- error mapping ------------------------------------------------------------------------


@pytest.mark.parametrize("request_id", list(ERRORS))
def test_unary_exceptions_map_to_status_codes(scripted, request_id, caplog):
    _, _, stub, _ = scripted
    with caplog.at_level(logging.ERROR, logger="kvfleet"), pytest.raises(grpc.RpcError) as info:
        stub.Abort(engine_pb2.AbortRequest(request_id=request_id), timeout=TIMEOUT_S)
    assert (info.value.code(), info.value.details()) == EXPECTED[request_id]
    unexpected = EXPECTED[request_id][0] == grpc.StatusCode.INTERNAL
    # Bugs are logged with their traceback (and never leaked); client errors are not.
    assert ("unexpected error in /kvfleet.v1.Engine/Abort" in caplog.text) is unexpected
    assert stub.Abort(engine_pb2.AbortRequest(request_id="fine"), timeout=TIMEOUT_S).found


@pytest.mark.parametrize("request_id", list(ERRORS))
def test_streaming_exceptions_map_after_partial_output(scripted, request_id):
    servicer, _, stub, _ = scripted
    responses = generate(stub, request_id, [7, 8, 9])
    received = []
    with pytest.raises(grpc.RpcError) as info:
        for response in responses:
            received.append(response.token_ids[0])
    assert received == [7, 8, 9]  # messages sent before the error still arrive
    assert (info.value.code(), info.value.details()) == EXPECTED[request_id]


def test_explicit_context_abort_passes_through(scripted):
    _, _, stub, _ = scripted
    with pytest.raises(grpc.RpcError) as info:
        stub.Abort(engine_pb2.AbortRequest(request_id="explicit-abort"), timeout=TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert info.value.details() == "no such request"


@pytest.mark.parametrize("request_id", ["ok", "value-error", "bug"])
def test_writer_api_streams_are_wrapped_too(threaded_server, request_id):
    server = threaded_server(engine_server(WriterEngine()))
    with grpc.insecure_channel(server.address) as channel:
        responses = generate(engine_pb2_grpc.EngineStub(channel), request_id, [1, 2])
        if request_id == "ok":
            assert [r.token_ids[0] for r in responses] == [1, 2]
            return
        with pytest.raises(grpc.RpcError) as info:
            list(responses)
    assert (info.value.code(), info.value.details()) == EXPECTED[request_id]


class RelayEngine(engine_pb2_grpc.EngineServicer):
    """GetLoad calls a tokenizer service with bad input, as a router would relay it."""

    def __init__(self, tokenizer_address: str) -> None:
        self.tokenizer_address = tokenizer_address

    async def GetLoad(self, request, context):
        async with grpc.aio.insecure_channel(self.tokenizer_address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerStub(channel)
            await stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=""), timeout=TIMEOUT_S)
        return engine_pb2.LoadInfo()


def test_downstream_status_is_relayed(threaded_server, tiny_model_dir: Path):
    tokenizer = threaded_server(lambda: build_server(tiny_model_dir, "127.0.0.1", 0))
    relay = threaded_server(engine_server(RelayEngine(tokenizer.address)))
    with grpc.insecure_channel(relay.address) as channel, pytest.raises(grpc.RpcError) as info:
        engine_pb2_grpc.EngineStub(channel).GetLoad(engine_pb2.GetLoadRequest(), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "text must not be empty"


# -- binding and health -------------------------------------------------------------------


def test_port_zero_binds_a_free_port_and_taken_ports_fail(threaded_server):
    server = threaded_server(engine_server(ScriptedEngine()))
    assert server.server is not None and server.server.port > 0
    with socket.create_connection(("127.0.0.1", server.server.port), timeout=5):
        pass
    with pytest.raises(RuntimeError):  # no silent SO_REUSEPORT sharing
        threaded_server(
            lambda: GrpcServer(
                [Service(ENGINE, lambda s: None)], host="127.0.0.1", port=server.server.port
            )
        )


def test_health_follows_set_serving(threaded_server):
    server = threaded_server(engine_server(ScriptedEngine(), initially_serving=False))
    with grpc.insecure_channel(server.address) as channel:
        assert health_status(channel, ENGINE) == health_pb2.HealthCheckResponse.NOT_SERVING
        server.call(lambda: server.server.set_serving(True))
        for service in ("", ENGINE):
            assert health_status(channel, service) == health_pb2.HealthCheckResponse.SERVING


# -- drain and shutdown -------------------------------------------------------------------


def test_drain_finishes_in_flight_refuses_new_and_runs_hook(scripted):
    servicer, server, stub, channel = scripted
    hook_calls: list[int] = []

    async def on_shutdown() -> None:
        hook_calls.append(server.server.in_flight)  # runs while the stream is in flight

    responses = generate(stub, "slow", list(range(10)), delay_ms=-1)
    assert next(responses).token_ids == [0]  # the stream is in flight, held at the gate
    shutdown = server.submit(lambda: server.server.shutdown(on_shutdown))
    deadline = time.monotonic() + TIMEOUT_S
    while health_status(channel) != health_pb2.HealthCheckResponse.NOT_SERVING:
        assert time.monotonic() < deadline, "health never turned NOT_SERVING"
        time.sleep(0.01)
    with pytest.raises(grpc.RpcError) as info:
        stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in info.value.details()
    assert not shutdown.done()  # still draining: the stream is in flight
    servicer.gate.set()
    assert [r.token_ids[0] for r in responses] == list(range(1, 10))  # finishes in full
    assert responses.code() == grpc.StatusCode.OK
    shutdown.result(TIMEOUT_S)
    assert servicer.completed == ["slow"]
    assert hook_calls == [1]


def test_grace_period_cancels_stragglers(threaded_server):
    servicer = ScriptedEngine()
    server = threaded_server(engine_server(servicer, grace_s=0.5))
    with grpc.insecure_channel(server.address) as channel:
        responses = generate(engine_pb2_grpc.EngineStub(channel), "endless", [1] * 100, 200)
        assert next(responses).token_ids == [1]
        started = time.monotonic()
        server.call(lambda: server.server.shutdown())
        assert time.monotonic() - started < 10
        with pytest.raises(grpc.RpcError) as info:
            list(responses)
    assert info.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    assert servicer.closed == ["endless"] and servicer.completed == []  # cleanup ran


def test_client_cancel_runs_handler_cleanup(scripted):
    servicer, server, stub, _ = scripted
    responses = generate(stub, "cancelled", [1] * 100, delay_ms=50)
    assert next(responses).token_ids == [1]
    responses.cancel()
    deadline = time.monotonic() + TIMEOUT_S
    while servicer.closed != ["cancelled"] or server.server.in_flight:
        assert time.monotonic() < deadline, "handler cleanup did not run"
        time.sleep(0.01)
    assert servicer.completed == []
