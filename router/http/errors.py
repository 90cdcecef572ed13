"""OpenAI error JSON for every failure of the HTTP API, whatever raised it.

Role: `error_response` renders {"error": {"message", "type", "param", "code"}};
`status_of` maps an exception to (HTTP status, message, param) through the same table as
gRPC (`kvfleet.contracts.errors`); `install_handlers` makes FastAPI's own errors (unknown route,
wrong method, an unexpected exception) use the same shape.

Invariants:
- Never FastAPI's {"detail": ...}, never a Python class name or traceback: an unexpected
  exception is logged and answered "internal error" (500).
- `param` names the offending field: an `InvalidFieldError` carries it; a plain ValueError
  from the engine's parameter rules (whose messages start with the field name, e.g.
  "temperature must be ...") gets the leading field name when it is one of the body's.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from kvfleet.contracts.errors import (
    HTTP_STATUS_FOR_CODE,
    INTERNAL_ERROR_MESSAGE,
    InvalidFieldError,
    status_for_exception,
)
from router.tenancy.api_keys import AuthenticationError

logger = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    503: "ServiceUnavailableError",
}
# Field names that engine validation messages may start with (see `param_of`).
_BODY_FIELDS = frozenset({
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens",
    "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logprobs", "top_logprobs", "stop", "prompt", "messages", "request_id", "model",
})
_LEADING_NAME = re.compile(r"^([a-z_]+)\b")


def error_response(
    status: int, message: str, param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, object]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "InternalServerError"),
                      "param": param, "code": status}}


def status_of(exc: BaseException) -> tuple[int, str, str | None]:
    """(HTTP status, client-facing message, the field at fault or None)."""
    if isinstance(exc, AuthenticationError):
        return 401, str(exc), None
    if isinstance(exc, InvalidFieldError):
        return exc.http_status, str(exc), exc.param
    code, message, unexpected = status_for_exception(exc)
    if unexpected:
        logger.error("request failed", exc_info=exc)
    status = HTTP_STATUS_FOR_CODE.get(code, 500)
    return status, message, param_of(message) if status == 400 else None


def param_of(message: str) -> str | None:
    match = _LEADING_NAME.match(message)
    return match.group(1) if match and match.group(1) in _BODY_FIELDS else None


def install_handlers(app: FastAPI) -> None:
    app.add_exception_handler(HTTPException, _http_exception)
    app.add_exception_handler(Exception, _unexpected)


async def _http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    message = {404: f"no route for {request.url.path}",
               405: f"method {request.method} is not allowed on {request.url.path}"}
    return error_response(exc.status_code, message.get(exc.status_code, str(exc.detail)),
                          headers=exc.headers)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.error("unexpected error in %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, INTERNAL_ERROR_MESSAGE)
