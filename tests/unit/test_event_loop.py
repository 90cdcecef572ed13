"""kvfleet.runtime.event_loop: which loop a service runs on, and that gRPC serves on uvloop."""

from __future__ import annotations

import argparse
import asyncio
import sys

import grpc.aio
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvfleet.runtime.event_loop import loop_factory, run
from kvfleet.runtime.options import ServerOptions, add_server_arguments


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_the_flag_defaults_to_auto_and_names_a_loop() -> None:
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    assert ServerOptions.from_args(parser.parse_args([])).event_loop == "auto"
    assert ServerOptions.from_args(
        parser.parse_args(["--event-loop", "asyncio"])).event_loop == "asyncio"
    with pytest.raises(SystemExit):
        parser.parse_args(["--event-loop", "trio"])


def test_auto_runs_on_uvloop_and_asyncio_on_asyncio() -> None:
    assert run(_loop_module()).startswith("uvloop")  # a pinned dependency
    assert run(_loop_module(), "uvloop").startswith("uvloop")
    assert run(_loop_module(), "asyncio").startswith("asyncio")
    with pytest.raises(ValueError, match="event loop must be one of"):
        loop_factory("trio")


def test_without_uvloop_auto_falls_back_and_uvloop_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    assert run(_loop_module()).startswith("asyncio")
    with pytest.raises(ValueError, match="uvloop is not installed"):
        loop_factory("uvloop")
    # Refused when the flags are parsed, so a service exits with the message at start.
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    with pytest.raises(ValueError, match="uvloop is not installed"):
        ServerOptions.from_args(parser.parse_args(["--event-loop", "uvloop"]))


async def _health_round_trip() -> int:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10)
            return int(reply.status)
    finally:
        await server.stop(None)


def test_grpc_aio_serves_and_calls_on_uvloop() -> None:
    assert run(_health_round_trip(), "uvloop") == health_pb2.HealthCheckResponse.SERVING
