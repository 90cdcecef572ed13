"""The chosen engine's max_model_len: published in its record, GetLoad only as a fallback."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvfleet.contracts.errors import InvalidFieldError
from kvfleet.v1 import engine_pb2
from router.engines.context_window import ContextWindows, check_fits
from router.routing.engine_view import EngineView


class _Stub:
    def __init__(self, max_model_len: int) -> None:
        self.calls = 0
        self._max_model_len = max_model_len

    async def GetLoad(self, request: Any, timeout: float) -> engine_pb2.LoadInfo:  # noqa: N802
        self.calls += 1
        return engine_pb2.LoadInfo(max_model_len=self._max_model_len)


class _Pool:
    def __init__(self, stub: _Stub) -> None:
        self.stub_ = stub

    def stub(self, engine_id: str, address: str) -> _Stub:
        return self.stub_


def _windows(stub: _Stub, now: list[float]) -> ContextWindows:
    return ContextWindows(_Pool(stub), ttl_s=30.0, clock=lambda: now[0])  # type: ignore[arg-type]


def test_a_published_length_is_used_without_asking_the_engine() -> None:
    stub, now = _Stub(999), [100.0]
    windows = _windows(stub, now)
    assert windows.largest_known() is None
    engine = EngineView("e0", "a:1", max_model_len=2048)
    assert windows.published(engine) == 2048
    assert stub.calls == 0
    assert windows.largest_known() == 2048  # refuses a too long prompt before routing
    now[0] = 131.0  # past the TTL: only a fresh publication keeps it
    assert windows.largest_known() is None
    assert windows.published(engine) == 2048 and windows.largest_known() == 2048


def test_an_engine_that_publishes_none_is_asked_once_per_ttl() -> None:
    stub, now = _Stub(512), [0.0]
    windows = _windows(stub, now)
    engine = EngineView("e0", "a:1")
    assert windows.published(engine) is None

    async def twice() -> list[int | None]:
        return list(await asyncio.gather(windows.fetch(engine), windows.fetch(engine)))

    assert asyncio.run(twice()) == [512, 512]
    assert stub.calls == 1
    assert asyncio.run(windows.fetch(engine)) == 512 and stub.calls == 1
    now[0] = 30.5
    assert asyncio.run(windows.fetch(engine)) == 512 and stub.calls == 2


def test_the_messages_name_the_field() -> None:
    check_fits(100, 28, 128, "prompt")
    with pytest.raises(InvalidFieldError) as prompt:
        check_fits(128, None, 128, "prompt")
    assert prompt.value.param == "prompt"
    assert "the input (prompt) is 128 tokens long" in str(prompt.value)
    with pytest.raises(InvalidFieldError) as completion:
        check_fits(100, 29, 128, "messages")
    assert completion.value.param == "max_tokens"
    assert "you requested 129 tokens (100 in the messages, 29 in the completion)" in str(
        completion.value)
