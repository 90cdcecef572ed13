"""The one mapping from Python exceptions to gRPC status codes (and HTTP statuses).

Role: servicers raise plain exceptions; `status_for_exception` decides what the client sees.
`kvfleet.runtime.interceptors.ErrorMappingInterceptor` applies it to every RPC, and an HTTP gateway
can use `HTTP_STATUS_FOR_CODE` to answer with the matching OpenAI-style status.

Invariants:
- ValueError (and subclasses) -> INVALID_ARGUMENT with the exception's message: raise
  ValueError only for problems with the *request*, phrased for the client.
  `InvalidFieldError` is a ValueError that also names the offending field (`param`), which
  the HTTP API puts in OpenAI's error JSON; its HTTP status may differ from 400 (413 for a
  body that is too large).
- OverloadedError -> RESOURCE_EXHAUSTED, UnavailableError -> UNAVAILABLE,
  NotFoundError -> NOT_FOUND.
- An error from a downstream gRPC call keeps its status code and details, so a router
  relays e.g. the tokenizer's INVALID_ARGUMENT unchanged.
- Anything else is a bug: INTERNAL with a generic message (details stay in the server log,
  never leak to clients).
"""

from __future__ import annotations

import grpc


class InvalidFieldError(ValueError):
    """The request's field `param` is invalid (INVALID_ARGUMENT; HTTP `http_status`)."""

    def __init__(self, param: str | None, message: str, http_status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.http_status = http_status


class OverloadedError(Exception):
    """The service is at capacity (queue full, tenant over its limits): retry later."""


class UnavailableError(Exception):
    """The service cannot serve this now (shutting down, no engine for the model)."""


class NotFoundError(LookupError):
    """The request names something that does not exist here (an unknown model)."""


# What a client sees for an unexpected exception; the traceback goes to the server log.
INTERNAL_ERROR_MESSAGE = "internal error"

# OpenAI-compatible HTTP status for each gRPC code a kvfleet service returns.
HTTP_STATUS_FOR_CODE: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def status_for_exception(exc: BaseException) -> tuple[grpc.StatusCode, str, bool]:
    """(status code, client-facing message, whether it is unexpected and must be logged)."""
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc) or "invalid argument", False
    if isinstance(exc, OverloadedError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc) or "overloaded", False
    if isinstance(exc, UnavailableError):
        return grpc.StatusCode.UNAVAILABLE, str(exc) or "unavailable", False
    if isinstance(exc, NotFoundError):
        return grpc.StatusCode.NOT_FOUND, str(exc) or "not found", False
    if isinstance(exc, grpc.RpcError):  # grpc.aio.AioRpcError included
        code, details = _rpc_error_status(exc)
        if code is not None and code is not grpc.StatusCode.OK:
            return code, details, code is grpc.StatusCode.INTERNAL
    return grpc.StatusCode.INTERNAL, INTERNAL_ERROR_MESSAGE, True


def _rpc_error_status(exc: BaseException) -> tuple[grpc.StatusCode | None, str]:
    # Both aio and sync client errors expose code()/details() (sync ones via grpc.Call).
    code_fn = getattr(exc, "code", None)
    details_fn = getattr(exc, "details", None)
    code = code_fn() if callable(code_fn) else None
    details = details_fn() if callable(details_fn) else None
    return (code if isinstance(code, grpc.StatusCode) else None), str(details or "")
