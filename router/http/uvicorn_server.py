"""Serves an ASGI app with uvicorn inside the router's event loop, beside the gRPC server.

Role: bind (port 0 picks a free port, reported by `start`), serve, and stop gracefully when
the router drains; HTTPS with `https` (router.http.https). uvicorn's own signal handling is
turned off: the gRPC server owns SIGTERM/SIGINT and stops this server from its shutdown hook.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from router.http.https import HttpsOptions

# How long start() waits for uvicorn to accept connections.
START_TIMEOUT_S = 10.0


class _QuietServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    def __init__(
        self, app: FastAPI, host: str, port: int, grace_s: float,
        https: HttpsOptions | None = None,
    ) -> None:
        self._host = host
        self._port = port
        self._grace_s = grace_s
        config = uvicorn.Config(
            app, log_level="warning", access_log=False, lifespan="off",
            timeout_graceful_shutdown=max(1, int(grace_s)),
            **({} if https is None else https.uvicorn_kwargs()),
        )
        self._server = _QuietServer(config)
        self._task: asyncio.Future[None] | None = None

    async def start(self) -> int:
        """Serve in the background; returns the bound port once connections are accepted."""
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self._host, self._port))
        port = int(sock.getsockname()[1])
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("HTTP server stopped during start-up")
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError("HTTP server did not start in time")
            await asyncio.sleep(0.01)
        return port

    async def stop(self) -> None:
        """Stop accepting, let open responses finish (up to the grace period), then close."""
        if self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), self._grace_s + 1)
        except TimeoutError:
            self._server.force_exit = True
            await self._task
