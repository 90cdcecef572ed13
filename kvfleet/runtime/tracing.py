"""OpenTelemetry tracing for kvfleet services: provider from OTEL_*, W3C propagation over gRPC.

Role:
- `init_tracing(default_service_name)` is called by a service's `main` when it starts (never
  on import). It reads the standard environment: tracing is on when OTEL_TRACES_EXPORTER is
  "otlp" or an OTLP endpoint (OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT) is set, and off when
  OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none. When on, an SDK TracerProvider with
  the OTel resource (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES; default service name
  `default_service_name`), the sampler from OTEL_TRACES_SAMPLER[_ARG], a batch processor
  (OTEL_BSP_*) and the OTLP/gRPC exporter (OTEL_EXPORTER_OTLP_*) becomes the global one.
  When off, the API's no-op tracer stays: a span costs a function call and no allocation
  of note, and `trace_metadata()` returns nothing.
- `TracingInterceptor` (installed on every `GrpcServer`) starts a SERVER span per work RPC,
  named after the method, whose parent is the W3C `traceparent` in the call's metadata; the
  handler runs with it as the current span.
- `trace_metadata()` is the outgoing side: the current context as gRPC metadata, passed on
  every downstream call, so router -> tokenizer -> engine is one trace.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc
import grpc.aio
from opentelemetry import propagate, trace

from kvfleet.runtime.interceptors import EXEMPT_METHOD_PREFIXES, wrap_handler

logger = logging.getLogger(__name__)

TRACER_NAME = "kvfleet"
# Set by init_tracing when a provider is installed: until then the server interceptor
# leaves handlers untouched (tracing off costs nothing per RPC).
_state = {"active": False}


def tracing_enabled(environ: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """Whether the OTEL_* environment asks for traces to be exported."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    if exporter:
        return True
    return bool(
        env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


class TracingHandle:
    """What `init_tracing` set up; `shutdown()` flushes pending spans (call on exit)."""

    def __init__(self, provider: Any | None) -> None:
        self._provider = provider

    @property
    def enabled(self) -> bool:
        return self._provider is not None

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = None


def init_tracing(default_service_name: str) -> TracingHandle:
    """Install the global TracerProvider from OTEL_* (see the module docstring)."""
    if not tracing_enabled():
        return TracingHandle(None)
    # Imported only when tracing is on: the SDK and exporter are not needed otherwise.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    exporter_name = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
    if exporter_name != "otlp":
        logger.warning("OTEL_TRACES_EXPORTER=%s is not supported; using otlp", exporter_name)
    protocol = os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    )
    if protocol.strip().lower() != "grpc":
        logger.warning("OTLP protocol %s is not supported; exporting over grpc", protocol)
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: default_service_name}))
    provider = TracerProvider(resource=resource)  # sampler: OTEL_TRACES_SAMPLER[_ARG]
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _state["active"] = True
    logger.info("tracing on: service %s", resource.attributes.get(SERVICE_NAME))
    return TracingHandle(provider)


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def trace_metadata() -> tuple[tuple[str, str], ...]:
    """The current trace context as outgoing gRPC metadata (empty when none is active)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items())


def wall_time_ns(monotonic_s: float) -> int:
    """A time.monotonic() instant as epoch nanoseconds (for span event timestamps)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def _metadata_carrier(context: grpc.aio.ServicerContext) -> dict[str, str]:
    carrier: dict[str, str] = {}
    for key, value in context.invocation_metadata() or ():
        if isinstance(value, str):
            carrier[key] = value
    return carrier


@contextlib.contextmanager
def _server_span(method: str, context: grpc.aio.ServicerContext) -> Iterator[trace.Span]:
    parent = propagate.extract(_metadata_carrier(context))
    service, _, name = method.lstrip("/").partition("/")
    attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}
    with tracer().start_as_current_span(
        method.lstrip("/"), context=parent, kind=trace.SpanKind.SERVER, attributes=attributes
    ) as span:
        yield span


class TracingInterceptor(grpc.aio.ServerInterceptor):
    """A SERVER span per work RPC, child of the caller's `traceparent` (see module doc)."""

    @contextlib.asynccontextmanager
    async def _scope(
        self, method: str, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[None]:
        with _server_span(method, context):
            yield

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if not _state["active"] or handler is None or method.startswith(EXEMPT_METHOD_PREFIXES):
            return handler
        return wrap_handler(handler, method, self._scope)
