"""Service logging: plain text or structured JSON lines carrying request_id, tenant, trace_id.

Role: `configure_logging(level, fmt)` is called by a service's `main` (never on import).
With fmt="json" every record is one JSON object per line:
`{"ts": ..., "level": ..., "logger": ..., "message": ..., "request_id": ..., "tenant": ...,
"trace_id": ..., "span_id": ...}` — the request fields come from `request_context(...)`,
which a servicer enters around one request (contextvars: they follow the request's task),
the trace fields from the current OpenTelemetry span when one is recording. Fields that are
unknown are left out; exceptions go in "exc".

Level and format come from --log-level/--log-format, else KVFLEET_LOG_LEVEL /
KVFLEET_LOG_FORMAT (read when the service starts; see kvfleet.runtime.options), else INFO / text.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import json
import logging
from collections.abc import Iterator
from typing import Any

from opentelemetry import trace

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "kvfleet_request_id", default=None
)
_tenant: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "kvfleet_tenant", default=None
)


@contextlib.contextmanager
def request_context(request_id: str | None = None, tenant: str | None = None) -> Iterator[None]:
    """Log records emitted inside carry this request id and tenant (JSON format)."""
    tokens = []
    if request_id is not None:
        tokens.append((_request_id, _request_id.set(request_id)))
    if tenant is not None:
        tokens.append((_tenant, _tenant.set(tenant)))
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            with contextlib.suppress(ValueError):  # reset from another context: harmless
                var.reset(token)


def set_tenant(tenant: str) -> None:
    """Record the tenant once known (after authentication), for the rest of the request.

    gRPC runs each RPC in its own task (own context), so this never leaks to another RPC.
    """
    _tenant.set(tenant)


def set_request_id(request_id: str) -> None:
    """Like `set_tenant`, for a request id known only inside the handler."""
    _request_id.set(request_id)


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id, tenant = _request_id.get(), _tenant.get()
        if request_id is not None:
            entry["request_id"] = request_id
        if tenant is not None:
            entry["tenant"] = tenant
        span_context = trace.get_current_span().get_span_context()
        if span_context.is_valid:
            entry["trace_id"] = format(span_context.trace_id, "032x")
            entry["span_id"] = format(span_context.span_id, "016x")
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Process-wide logging for a service's main: `level` and "text" or "json" lines."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=getattr(logging, level), handlers=[handler], force=True)
