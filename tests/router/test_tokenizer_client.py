"""The router's TokenizerClient against a real tokenizer server on loopback.

A tokenizer that is down fails a call with UNAVAILABLE naming the service; one that comes
back on the same address answers the very next call, although the client's old connection
is still backing off from the failed attempts (the retry goes over a fresh connection).
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from kvfleet.contracts.errors import UnavailableError
from kvfleet.router_client import build_request
from kvfleet.text.tokenizer import Tokenizer
from router.tokenizer_client import TokenizerClient
from tokenizer_svc.server import build_server

PROMPT = "Once upon a time there was a small village by the sea"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_tokenizer_that_comes_back_answers_the_next_call(tiny_model_dir: Path) -> None:
    port = free_port()
    request = build_request(PROMPT)

    async def scenario() -> list[int]:
        client = TokenizerClient(f"127.0.0.1:{port}", timeout_s=10)
        try:
            with pytest.raises(UnavailableError, match=f"tokenizer service 127.0.0.1:{port}"):
                await client.tokenize(request)
            server = build_server(tiny_model_dir, "127.0.0.1", port)
            await server.start()
            try:
                return await client.tokenize(request)
            finally:
                await server.shutdown()
        finally:
            await client.close()

    ids = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert ids == Tokenizer.from_dir(tiny_model_dir).encode(PROMPT)
