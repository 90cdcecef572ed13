"""The one table of errors: what a client sees, over gRPC and over HTTP, for each failure.

Role: servicers and request handlers raise plain exceptions; `failure_of` decides what the
client sees. `ERROR_KINDS` is the table: one `ErrorKind` row per kind of failure, with its
gRPC status code, its HTTP status, its OpenAI error `type` (the strings vLLM's OpenAI server
uses) and whether it names the field at fault (`param` in OpenAI's error JSON). Every front
door reads it: `kvfleet.runtime.interceptors` (gRPC status and trailing metadata),
`kvfleet.runtime.metrics` (status labels), `router.http.errors` (OpenAI error JSON and
headers), so no other module keeps a mapping of its own.

Invariants:
- A `ClientError` names its row (`kind`). `InvalidFieldError` is a ValueError that also
  names the offending field (`param`), set where it is raised; its row is INVALID_REQUEST
  (400) or, given `http_status=413` / `415`, REQUEST_TOO_LARGE / UNSUPPORTED_MEDIA_TYPE.
- A plain ValueError is INVALID_REQUEST too, with its message: raise ValueError only for
  problems with the *request*, phrased for the client. It carries no field, so its `param`
  falls back to the message's leading word when that is an OpenAI body field (the engine's
  sampling rules say "temperature must be ..."); the same holds for a downstream
  INVALID_ARGUMENT, whose field does not travel over gRPC. Raise `InvalidFieldError` where
  the field is known.
- An error from a downstream gRPC call keeps its status code and details on gRPC, so a
  router relays e.g. the tokenizer's INVALID_ARGUMENT unchanged; over HTTP it answers as the
  `relayed` row with that code, or INTERNAL (500) when there is none (e.g. UNAUTHENTICATED:
  a downstream refusing the router's own credentials is not the client's fault).
- Anything else is a bug: INTERNAL with a generic message (details stay in the server log,
  never leak to clients).
- HTTP statuses are unique across rows, so a status alone finds its OpenAI `type`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import grpc

# gRPC trailing metadata, as grpc.aio's context.abort takes it.
Metadata = Sequence[tuple[str, str | bytes]]


@dataclass(frozen=True)
class ErrorKind:
    """One row of the table: how one kind of failure is answered."""

    name: str
    grpc_code: grpc.StatusCode
    http_status: int
    openai_type: str
    # Whether OpenAI's error JSON names the field at fault (`param`); else `param` is null.
    names_field: bool = False
    # The client-facing message when the exception has none.
    default_message: str = ""
    # Whether a downstream gRPC status with this code is answered over HTTP as this row.
    relayed: bool = True


_Code = grpc.StatusCode
INVALID_REQUEST = ErrorKind("invalid_request", _Code.INVALID_ARGUMENT, 400, "BadRequestError",
                            names_field=True, default_message="invalid argument")
# The body middleware's own answers; the handlers never see these requests.
REQUEST_TOO_LARGE = ErrorKind("request_too_large", _Code.INVALID_ARGUMENT, 413,
                              "RequestTooLargeError", names_field=True,
                              default_message="request too large", relayed=False)
# A body that is not JSON by its Content-Type (HTTP only; never relayed).
UNSUPPORTED_MEDIA_TYPE = ErrorKind("unsupported_media_type", _Code.INVALID_ARGUMENT, 415,
                                   "UnsupportedMediaTypeError",
                                   default_message="unsupported media type", relayed=False)
REQUEST_TIMEOUT = ErrorKind("request_timeout", _Code.DEADLINE_EXCEEDED, 408,
                            "RequestTimeoutError", default_message="request timeout",
                            relayed=False)
UNAUTHENTICATED = ErrorKind("unauthenticated", _Code.UNAUTHENTICATED, 401,
                            "AuthenticationError", default_message="unauthenticated",
                            relayed=False)
# A valid caller asking for what only an admin may do (docs/security.md). Not relayed: a
# downstream refusing the router is not the client's fault.
PERMISSION_DENIED = ErrorKind("permission_denied", _Code.PERMISSION_DENIED, 403,
                              "PermissionDeniedError", default_message="permission denied",
                              relayed=False)
NOT_FOUND = ErrorKind("not_found", _Code.NOT_FOUND, 404, "NotFoundError",
                      default_message="not found")
# HTTP only (a route called with the wrong method); no RPC is ever answered with it.
METHOD_NOT_ALLOWED = ErrorKind("method_not_allowed", _Code.UNIMPLEMENTED, 405,
                               "MethodNotAllowedError", default_message="method not allowed",
                               relayed=False)
OVERLOADED = ErrorKind("overloaded", _Code.RESOURCE_EXHAUSTED, 429, "RateLimitError",
                       default_message="overloaded")
UNAVAILABLE = ErrorKind("unavailable", _Code.UNAVAILABLE, 503, "ServiceUnavailableError",
                        default_message="unavailable")
# Only ever relayed from a downstream call; OpenAI has no type of its own for these.
CANCELLED = ErrorKind("cancelled", _Code.CANCELLED, 499, "InternalServerError",
                      default_message="cancelled")
UNIMPLEMENTED = ErrorKind("unimplemented", _Code.UNIMPLEMENTED, 501, "InternalServerError",
                          default_message="unimplemented")
DEADLINE_EXCEEDED = ErrorKind("deadline_exceeded", _Code.DEADLINE_EXCEEDED, 504,
                              "InternalServerError", default_message="deadline exceeded")
INTERNAL = ErrorKind("internal", _Code.INTERNAL, 500, "InternalServerError",
                     default_message="internal error")

ERROR_KINDS: tuple[ErrorKind, ...] = (
    INVALID_REQUEST, REQUEST_TOO_LARGE, UNSUPPORTED_MEDIA_TYPE, REQUEST_TIMEOUT,
    UNAUTHENTICATED, PERMISSION_DENIED, NOT_FOUND, METHOD_NOT_ALLOWED, OVERLOADED,
    UNAVAILABLE, CANCELLED, UNIMPLEMENTED, DEADLINE_EXCEEDED, INTERNAL,
)

# What a client sees for an unexpected exception; the traceback goes to the server log.
INTERNAL_ERROR_MESSAGE = INTERNAL.default_message

_BY_HTTP_STATUS = {kind.http_status: kind for kind in ERROR_KINDS}
_RELAYED_BY_CODE = {kind.grpc_code: kind for kind in ERROR_KINDS if kind.relayed}
assert len(_BY_HTTP_STATUS) == len(ERROR_KINDS), "HTTP statuses must be unique across rows"
assert len(_RELAYED_BY_CODE) == sum(k.relayed for k in ERROR_KINDS), "one relayed row per code"


def kind_for_http_status(status: int) -> ErrorKind | None:
    """The row answered with HTTP `status`, if any."""
    return _BY_HTTP_STATUS.get(status)


def openai_type(status: int) -> str:
    """OpenAI's error `type` for HTTP `status` (InternalServerError for one not in the table)."""
    kind = _BY_HTTP_STATUS.get(status)
    return kind.openai_type if kind is not None else INTERNAL.openai_type


# -- the exceptions that name their row -----------------------------------------------------


class ClientError(Exception):
    """An expected failure, answered as row `kind`; subclasses fix the row.

    Extra answers a subclass may give: `http_headers` (e.g. Retry-After) and
    `grpc_trailing_metadata` (e.g. retry-after and a google.rpc.RetryInfo detail).
    """

    kind: ErrorKind = INTERNAL

    def http_headers(self) -> Mapping[str, str]:
        return {}

    def grpc_trailing_metadata(self) -> Metadata:
        return ()


class InvalidFieldError(ClientError, ValueError):
    """The request's field `param` (None: the request as a whole) is invalid."""

    def __init__(self, param: str | None, message: str, http_status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        kind = _BY_HTTP_STATUS.get(http_status)
        if kind is None or kind.grpc_code is not grpc.StatusCode.INVALID_ARGUMENT:
            raise TypeError(f"no invalid-request row answers HTTP {http_status}")
        self.kind = kind  # per instance: 400, or 413 for a body that is too large

    @property
    def http_status(self) -> int:
        return self.kind.http_status

    def __reduce__(self) -> tuple[type[InvalidFieldError], tuple[str | None, str, int]]:
        # Pickles (e.g. to another process) with all three arguments, not just the message.
        return type(self), (self.param, str(self), self.http_status)


class UnauthenticatedError(ClientError):
    """The caller presented no valid credentials (an API key)."""

    kind = UNAUTHENTICATED


class PermissionDeniedError(ClientError):
    """The caller is known but may not do this (e.g. change the fleet without being admin)."""

    kind = PERMISSION_DENIED


class NotFoundError(ClientError, LookupError):
    """The request names something that does not exist here (an unknown model)."""

    kind = NOT_FOUND


class OverloadedError(ClientError):
    """The service is at capacity (queue full, tenant over its limits): retry later."""

    kind = OVERLOADED


class UnavailableError(ClientError):
    """The service cannot serve this now (shutting down, no engine for the model)."""

    kind = UNAVAILABLE


# -- looking an exception up ----------------------------------------------------------------


@dataclass(frozen=True)
class Failure:
    """What the client sees for one exception, on either front door."""

    kind: ErrorKind
    # The row's code, or a relayed downstream status's own code (which may have no row).
    grpc_code: grpc.StatusCode
    message: str
    param: str | None = None
    # Unexpected (a bug, or a downstream INTERNAL): the caller logs it with its traceback.
    unexpected: bool = False
    http_headers: Mapping[str, str] = field(default_factory=dict)
    grpc_trailing_metadata: Metadata = ()

    @property
    def http_status(self) -> int:
        return self.kind.http_status


def failure_of(exc: BaseException) -> Failure:
    """Look `exc` up in the table."""
    if isinstance(exc, ClientError):
        kind = exc.kind
        param = getattr(exc, "param", None) if kind.names_field else None
        return Failure(kind, kind.grpc_code, str(exc) or kind.default_message, param,
                       http_headers=exc.http_headers(),
                       grpc_trailing_metadata=tuple(exc.grpc_trailing_metadata()))
    if isinstance(exc, ValueError):
        message = str(exc) or INVALID_REQUEST.default_message
        return Failure(INVALID_REQUEST, INVALID_REQUEST.grpc_code, message,
                       field_named_by(message))
    if isinstance(exc, grpc.RpcError):  # grpc.aio.AioRpcError included
        code, details = _rpc_error_status(exc)
        if code is not None and code is not grpc.StatusCode.OK:
            kind = _RELAYED_BY_CODE.get(code, INTERNAL)
            param = field_named_by(details) if kind.names_field else None
            return Failure(kind, code, details, param,
                           unexpected=code is grpc.StatusCode.INTERNAL)
    return Failure(INTERNAL, INTERNAL.grpc_code, INTERNAL_ERROR_MESSAGE, unexpected=True)


def status_for_exception(exc: BaseException) -> tuple[grpc.StatusCode, str, bool]:
    """(status code, client-facing message, whether it is unexpected and must be logged)."""
    failure = failure_of(exc)
    return failure.grpc_code, failure.message, failure.unexpected


# Fields of an OpenAI request body that a field-less message may start with (see module doc).
_BODY_FIELDS = frozenset({
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens",
    "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logprobs", "top_logprobs", "stop", "prompt", "messages", "request_id", "model",
})
_LEADING_NAME = re.compile(r"^([a-z_]+)\b")


def field_named_by(message: str) -> str | None:
    """The body field a field-less invalid-request message starts with, if any.

    Only for errors that arrive without a field: a plain ValueError, or a downstream
    service's INVALID_ARGUMENT details (gRPC carries no field).
    """
    match = _LEADING_NAME.match(message)
    return match.group(1) if match and match.group(1) in _BODY_FIELDS else None


def _rpc_error_status(exc: BaseException) -> tuple[grpc.StatusCode | None, str]:
    # Both aio and sync client errors expose code()/details() (sync ones via grpc.Call).
    code_fn = getattr(exc, "code", None)
    details_fn = getattr(exc, "details", None)
    code = code_fn() if callable(code_fn) else None
    details = details_fn() if callable(details_fn) else None
    return (code if isinstance(code, grpc.StatusCode) else None), str(details or "")
