"""The tokenizer service on loopback: one in-process server per module and model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.fixtures.servers import ThreadedServer
from tokenizer_svc.server import build_server


def _tokenizer_server(model_dir: Path) -> Iterator[ThreadedServer]:
    server = ThreadedServer(lambda: build_server(model_dir, "127.0.0.1", 0)).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tiny_tokenizer_server(tiny_model_dir: Path) -> Iterator[ThreadedServer]:
    yield from _tokenizer_server(tiny_model_dir)


@pytest.fixture(scope="module")
def tiny_channel(tiny_tokenizer_server: ThreadedServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(tiny_tokenizer_server.address) as channel:
        yield channel


@pytest.fixture(scope="module")
def smollm2_tokenizer_server(smollm2_dir: Path) -> Iterator[ThreadedServer]:
    yield from _tokenizer_server(smollm2_dir)


@pytest.fixture(scope="module")
def smollm2_channel(smollm2_tokenizer_server: ThreadedServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(smollm2_tokenizer_server.address) as channel:
        yield channel
