"""OpenAI error JSON for every failure of the HTTP API, whatever raised it.

Role: `error_response` renders {"error": {"message", "type", "param", "code"}};
`status_of` / `logged_failure` look an exception up in the one error table
(`kvfleet.contracts.errors`), the same one gRPC answers from; `install_handlers` makes
FastAPI's own errors (unknown route, wrong method, an unexpected exception) use the same shape.

Invariants:
- Never FastAPI's {"detail": ...}, never a Python class name or traceback: an unexpected
  exception is logged and answered "internal error" (500).
- `type` and `param` come from the table: `param` is the field the error carries (an
  `InvalidFieldError` names it where it is raised); this module guesses nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from kvfleet.contracts.errors import (
    ERROR_KINDS,
    INTERNAL,
    INTERNAL_ERROR_MESSAGE,
    Failure,
    failure_of,
    openai_type,
)

logger = logging.getLogger(__name__)

# The statuses that have an OpenAI error type of their own (the rest are InternalServerError),
# as the OpenAPI document lists them.
ERROR_TYPES = {kind.http_status: kind.openai_type for kind in ERROR_KINDS
               if kind.openai_type != INTERNAL.openai_type}


def error_response(
    status: int, message: str, param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, object]:
    return {"error": {"message": message, "type": openai_type(status), "param": param,
                      "code": status}}


def logged_failure(exc: BaseException) -> Failure:
    """The table's answer for `exc`; an unexpected one is logged here, once."""
    failure = failure_of(exc)
    if failure.unexpected:
        logger.error("request failed", exc_info=exc)
    return failure


def failure_response(failure: Failure) -> JSONResponse:
    """`failure` as OpenAI error JSON, with its headers (e.g. Retry-After)."""
    return error_response(failure.http_status, failure.message, failure.param,
                          failure.http_headers or None)


def status_of(exc: BaseException) -> tuple[int, str, str | None]:
    """(HTTP status, client-facing message, the field at fault or None)."""
    failure = logged_failure(exc)
    return failure.http_status, failure.message, failure.param


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
    return error_response(INTERNAL.http_status, INTERNAL_ERROR_MESSAGE)
