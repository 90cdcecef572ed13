"""A kvfleet service's gRPC server: bind, health, reflection, error mapping, graceful drain.

Role: every service (tokenizer, engine, router) hosts its servicers through `GrpcServer`, so
they all behave the same to clients, load balancers and Kubernetes:

- Binds host:port; port 0 picks a free port, and `start()` returns the bound one. Port
  reuse is off, so two servers never silently share a port.
- Standard health service (grpc.health.v1): "" and every hosted service report SERVING
  (or NOT_SERVING until `set_serving(True)`, for services that load slowly).
- Server reflection lists the hosted services, health and reflection.
- Every RPC runs through `ErrorMappingInterceptor` (exceptions -> status codes, one place;
  it also decodes the request, so an undecodable one is INVALID_ARGUMENT) and
  `DrainTracker`, then `TracingInterceptor` (a span per RPC when tracing is on, see
  kvfleet.runtime.tracing) and the service's own interceptors (e.g. RPC metrics).
- Plaintext, or TLS with the `credentials` given (kvfleet.runtime.tls).

Shutdown (SIGTERM/SIGINT under `serve_until_signal`, or `shutdown()`), in this order:
1. health turns NOT_SERVING for all services, permanently; new work RPCs are refused with
   UNAVAILABLE (health checks keep answering, so probes see NOT_SERVING);
2. `on_shutdown()` (deregistration) runs while in-flight work RPCs finish, both bounded by
   the grace period; a second signal cuts the wait short;
3. the server stops (leftover health Watch streams are cancelled) and the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from kvfleet.runtime.interceptors import DrainTracker, ErrorMappingInterceptor
from kvfleet.runtime.tracing import TracingInterceptor

logger = logging.getLogger(__name__)

DEFAULT_GRACE_S = 30.0
# After the last work RPC ends, how long its final status may take to reach the client
# before leftover streams (health Watch) are cancelled.
STATUS_FLUSH_S = 1.0
# grpc enables SO_REUSEPORT by default: a second server on a taken port would "succeed".
BASE_CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (("grpc.so_reuseport", 0),)

ShutdownHook = Callable[[], Awaitable[None]]


@dataclass(frozen=True)
class Service:
    """One servicer to host: its full proto name and how to attach it to a server."""

    name: str  # e.g. "kvfleet.v1.Tokenizer"
    register: Callable[[grpc.aio.Server], None]


def format_address(host: str, port: int) -> str:
    """host:port, bracketing IPv6 literals."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class GrpcServer:
    """Hosts `services` on one grpc.aio server; create and use it inside a running loop."""

    def __init__(
        self,
        services: Sequence[Service],
        *,
        host: str = "0.0.0.0",
        port: int = 0,
        grace_s: float = DEFAULT_GRACE_S,
        initially_serving: bool = True,
        options: Sequence[tuple[str, int | str]] = (),
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        credentials: grpc.ServerCredentials | None = None,
    ) -> None:
        if not services:
            raise ValueError("a server needs at least one service")
        self.services = list(services)
        self.host = host
        self.grace_s = grace_s
        self._requested_port = port
        self._initially_serving = initially_serving
        self._options = [*BASE_CHANNEL_OPTIONS, *options]
        # TLS (kvfleet.runtime.tls); None: plaintext.
        self._credentials = credentials
        self._drain = DrainTracker()
        # Run inside error mapping and drain tracking (they see the handlers' exceptions).
        # Tracing first: the server span covers the other interceptors' work too.
        self._interceptors = [TracingInterceptor(), *interceptors]
        self._server: grpc.aio.Server | None = None
        self._health: HealthServicer | None = None
        self._port: int | None = None
        self._shutdown_task: asyncio.Task[None] | None = None
        self._force_stop: asyncio.Event | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("server not started")
        return self._port

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)

    @property
    def in_flight(self) -> int:
        """Work RPCs currently running (health and reflection excluded)."""
        return self._drain.in_flight

    async def start(self) -> int:
        """Bind and start serving; returns the bound port."""
        if self._server is not None:
            raise RuntimeError("server already started")
        server = grpc.aio.server(
            interceptors=[ErrorMappingInterceptor(), self._drain, *self._interceptors],
            options=self._options,
        )
        for service in self.services:
            service.register(server)
        self._health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        names = [s.name for s in self.services]
        health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
        reflection.enable_server_reflection([*names, health_name, reflection.SERVICE_NAME], server)
        # add_*_port raises RuntimeError when the address cannot be bound.
        address = format_address(self.host, self._requested_port)
        if self._credentials is None:
            self._port = server.add_insecure_port(address)
        else:
            self._port = server.add_secure_port(address, self._credentials)
        self._force_stop = asyncio.Event()
        await server.start()
        self._server = server
        await self.set_serving(self._initially_serving)
        logger.info("serving %s on %s%s", ", ".join(names), self.address,
                    "" if self._credentials is None else " (TLS)")
        return self._port

    async def set_serving(self, serving: bool) -> None:
        """Report SERVING / NOT_SERVING for "" and every service (ignored once draining)."""
        if self._health is None:
            raise RuntimeError("server not started")
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *(s.name for s in self.services)]:
            await self._health.set(name, status)

    async def shutdown(self, on_shutdown: ShutdownHook | None = None) -> None:
        """Drain and stop (see the module docstring); concurrent calls share one shutdown."""
        if self._server is None:
            raise RuntimeError("server not started")
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.ensure_future(self._shutdown(on_shutdown))
        await asyncio.shield(self._shutdown_task)

    def force_stop(self) -> None:
        """Stop waiting for in-flight RPCs: they are cancelled now."""
        if self._force_stop is not None:
            self._force_stop.set()

    async def wait_for_termination(self) -> None:
        if self._server is None:
            raise RuntimeError("server not started")
        await self._server.wait_for_termination()

    async def serve_until_signal(self, on_shutdown: ShutdownHook | None = None) -> int:
        """Serve until SIGTERM/SIGINT, then drain and stop; returns the exit code (0).

        Must run on the main thread (signal handlers). A second signal forces the stop.
        """
        loop = asyncio.get_running_loop()
        stop_requested = asyncio.Event()

        def on_signal(signum: int) -> None:
            if stop_requested.is_set():
                logger.warning("second %s: cancelling in-flight RPCs", signal.Signals(signum).name)
                self.force_stop()
                return
            logger.info("%s received: draining", signal.Signals(signum).name)
            stop_requested.set()

        signals = (signal.SIGTERM, signal.SIGINT)
        for signum in signals:
            loop.add_signal_handler(signum, on_signal, signum)
        try:
            terminated = asyncio.ensure_future(self.wait_for_termination())
            requested = asyncio.ensure_future(stop_requested.wait())
            await asyncio.wait({terminated, requested}, return_when=asyncio.FIRST_COMPLETED)
            requested.cancel()
            if not terminated.done():
                await self.shutdown(on_shutdown)
            terminated.cancel()
        finally:
            for signum in signals:
                loop.remove_signal_handler(signum)
        return 0

    async def _shutdown(self, on_shutdown: ShutdownHook | None) -> None:
        assert self._server is not None and self._health is not None
        assert self._force_stop is not None
        started = asyncio.get_running_loop().time()
        self._drain.start_draining()
        await self._health.enter_graceful_shutdown()
        hook = asyncio.ensure_future(_run_hook(on_shutdown, self.grace_s))
        drained = asyncio.ensure_future(self._drain.wait_idle(self.grace_s))
        forced = asyncio.ensure_future(self._force_stop.wait())
        await asyncio.wait({drained, forced}, return_when=asyncio.FIRST_COMPLETED)
        forced.cancel()
        if not drained.done() or not drained.result():
            drained.cancel()
            reason = "on a second signal" if self._force_stop.is_set() else "after the grace period"
            logger.warning("cancelling %d in-flight RPC(s) %s", self.in_flight, reason)
        if self._force_stop.is_set():
            hook.cancel()  # "stop now" includes the deregistration hook
        await asyncio.gather(hook, return_exceptions=True)
        remaining_s = self.grace_s - (asyncio.get_running_loop().time() - started)
        flush_s = 0.0 if self._force_stop.is_set() else min(STATUS_FLUSH_S, max(0.0, remaining_s))
        await self._server.stop(flush_s)
        logger.info("server stopped after %.2fs", asyncio.get_running_loop().time() - started)


async def _run_hook(hook: ShutdownHook | None, timeout_s: float) -> None:
    """Run the shutdown hook, bounded; its failure is logged, never blocks the shutdown."""
    if hook is None:
        return
    try:
        await asyncio.wait_for(hook(), timeout_s)
    except TimeoutError:
        logger.error("on_shutdown hook did not finish within %.1fs", timeout_s)
    except Exception:
        logger.exception("on_shutdown hook failed")


def write_port_file(path: str | Path, port: int) -> None:
    """Write the bound port atomically, so a reader never sees a partial file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(f"{port}\n")
    os.replace(tmp, path)
