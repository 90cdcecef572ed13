"""Prometheus plumbing every kvfleet service shares: the /metrics endpoint and RPC metrics.

Role: each service keeps its metrics in its own `CollectorRegistry` (so several services
in one test process never collide) and serves it with prometheus_client's HTTP server on a
daemon thread (`MetricsEndpoint`): on `--metrics-port` (default 9090; a default port that
is taken falls back to a free one), nothing with `--no-metrics`. Port 0 picks a free port;
`--metrics-port-file` receives the bound one (written atomically, like --port-file). The
thread only works when scraped; the metric objects cost a few dict updates per request
(`python -m benchmarks.metrics_overhead` measures it).

`RpcMetricsInterceptor` counts a service's RPCs by method and status code and times them;
installed innermost (after error mapping), it sees the handler's own exceptions and maps
them with `kvfleet.contracts.errors.failure_of`, exactly as clients will see them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import start_http_server

from kvfleet.contracts.errors import failure_of
from kvfleet.runtime.grpc_server import write_port_file
from kvfleet.runtime.interceptors import EXEMPT_METHOD_PREFIXES, wrap_handler

logger = logging.getLogger(__name__)

# Request latency buckets (seconds) for RPC-level histograms.
RPC_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    30.0, 60.0, 120.0,
)


class MetricsEndpoint:
    """prometheus_client's HTTP server for one registry, on a daemon thread."""

    def __init__(self, registry: CollectorRegistry, host: str = "0.0.0.0", port: int = 0) -> None:
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.port: int = int(self._server.server_port)
        logger.info("serving /metrics on %s:%d", host, self.port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_metrics_endpoint(
    registry: CollectorRegistry,
    host: str,
    port: int | None,
    port_file: Path | None = None,
    fallback: bool = False,
) -> MetricsEndpoint | None:
    """Serve `registry` when `port` is set (0: a free port, written to `port_file`).

    `fallback`: the port is a default, not the operator's choice, so a busy one means a free
    port (logged) instead of a failed start.
    """
    if port is None:
        return None
    try:
        endpoint = MetricsEndpoint(registry, host, port)
    except OSError as e:
        if not fallback or port == 0:
            raise
        logger.warning("metrics port %d unavailable (%s); serving /metrics on a free port "
                       "(--metrics-port N to choose one)", port, e)
        endpoint = MetricsEndpoint(registry, host, 0)
    if port_file is not None:
        write_port_file(port_file, endpoint.port)
    return endpoint


def status_label(exc: BaseException | None, context: grpc.aio.ServicerContext | None) -> str:
    """The gRPC status name a client sees for an RPC that ended with `exc` (None: OK)."""
    if exc is None:
        return grpc.StatusCode.OK.name
    if isinstance(exc, grpc.aio.AbortError) and context is not None:
        with contextlib.suppress(Exception):
            code = context.code()
            if isinstance(code, grpc.StatusCode):
                return code.name
        return "ABORTED_BY_HANDLER"
    if isinstance(exc, (GeneratorExit, asyncio.CancelledError)):
        return grpc.StatusCode.CANCELLED.name
    return failure_of(exc).grpc_code.name


class RpcMetrics:
    """`<prefix>_requests{method,code}` and `<prefix>_request_duration_seconds{method}`."""

    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        self.requests = Counter(
            f"{prefix}_requests", "RPCs handled, by method and status code",
            ["method", "code"], registry=registry,
        )
        self.duration = Histogram(
            f"{prefix}_request_duration_seconds", "RPC handling time, by method",
            ["method"], buckets=RPC_LATENCY_BUCKETS, registry=registry,
        )

    @contextlib.asynccontextmanager
    async def observe(
        self, method: str, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[None]:
        name = method.rsplit("/", 1)[-1]
        started = time.perf_counter()
        error: BaseException | None = None
        try:
            yield
        except BaseException as exc:
            error = exc
            raise
        finally:
            self.duration.labels(name).observe(time.perf_counter() - started)
            self.requests.labels(name, status_label(error, context)).inc()


class RpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    """Times and counts every work RPC (health and reflection are left out)."""

    def __init__(self, metrics: RpcMetrics) -> None:
        self._metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(EXEMPT_METHOD_PREFIXES):
            return handler
        return wrap_handler(handler, method, self._metrics.observe)
