"""Reading an HTTP request body under limits, and decoding it as JSON.

Role: `BodyReader` is ASGI middleware in front of the OpenAI API. For a request with a body
it reads the whole body before the app runs: at most `max_body_bytes`, all of it within
`body_read_timeout_s`. The app then gets the buffered body followed by the server's own
`receive`, so it still sees `http.disconnect` when the client leaves. `read_json` checks the
body is declared JSON and `decode_json` turns the bytes into a Python object, with errors
phrased for the client.

Invariants:
- A declared Content-Length over the limit, or a body that grows past it (chunked), is
  refused with 413. The rest of the body is read and discarded first (up to
  `DISCARD_FACTOR` x the limit, within the same deadline), so a client that sends its whole
  body before reading the response (the OpenAI SDK) gets the 413, not a connection reset;
  a client that sent `Expect: 100-continue` gets it at once, before sending anything.
- A body not complete by the deadline (a trickle, or a Content-Length larger than what is
  sent) is answered 408.
- Refused requests close their connection: their body was never read to its end.
- A client that disconnects while sending gets no response and the app never runs.
- A JSON body must say so: `Content-Type: application/json` (parameters such as
  `charset=utf-8` allowed, any case); anything else, or none, is 415 before the body is
  parsed, so a form post or a text/plain "simple" request from a browser page never runs.
- Every refusal is OpenAI error JSON (`router.http.errors`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvfleet.contracts.errors import (
    REQUEST_TIMEOUT,
    REQUEST_TOO_LARGE,
    UNSUPPORTED_MEDIA_TYPE,
    ErrorKind,
    InvalidFieldError,
)
from router.http.errors import error_response
from router.request_limits import RequestLimits

_BODILESS_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE"})


# How much of a too-large body is read and discarded before answering 413.
DISCARD_FACTOR = 8


class _TooLarge(Exception):
    """The body is over the limit; the message says how large it is known to be."""


class _Disconnected(Exception):
    pass


class BodyReader:
    def __init__(self, app: ASGIApp, limits: RequestLimits) -> None:
        self._app = app
        self._max_bytes = limits.max_body_bytes
        self._timeout_s = limits.body_read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in _BODILESS_METHODS:
            await self._app(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self._timeout_s
        declared = _header(scope, b"content-length")
        try:
            if declared is not None and declared.isdigit() and int(declared) > self._max_bytes:
                raise _TooLarge(f"{int(declared)} bytes")
            body = await asyncio.wait_for(self._read(receive, self._max_bytes), self._timeout_s)
        except _TooLarge as e:
            await self._refuse_too_large(scope, receive, send, str(e), deadline)
            return
        except TimeoutError:
            message = f"the request body was not received within {self._timeout_s:g} s"
            await _respond(scope, receive, send, REQUEST_TIMEOUT, message)
            return
        except _Disconnected:
            return
        await self._app(scope, _replay(body, receive), send)

    async def _refuse_too_large(
        self, scope: Scope, receive: Receive, send: Send, size: str, deadline: float
    ) -> None:
        if _header(scope, b"expect") != "100-continue":
            remaining = deadline - asyncio.get_running_loop().time()
            with contextlib.suppress(_TooLarge, _Disconnected, TimeoutError):
                await asyncio.wait_for(
                    self._read(receive, DISCARD_FACTOR * self._max_bytes, keep=False),
                    max(remaining, 0.0),
                )
        message = (f"the request body ({size}) is larger than the limit of "
                   f"{self._max_bytes} bytes (--payload-limit)")
        await _respond(scope, receive, send, REQUEST_TOO_LARGE, message)

    @staticmethod
    async def _read(receive: Receive, max_bytes: int, keep: bool = True) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > max_bytes:
                raise _TooLarge(f"over {max_bytes} bytes")
            if keep:
                chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


async def _respond(
    scope: Scope, receive: Receive, send: Send, kind: ErrorKind, message: str
) -> None:
    response = error_response(kind.http_status, message, headers={"connection": "close"})
    await response(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """`receive` for the app: the whole body once, then the server's messages (disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value).decode("latin-1").strip().lower()
    return None


JSON_MEDIA_TYPE = "application/json"


async def read_json(request: Request) -> Any:
    """The request's body as JSON, once its Content-Type says JSON (else 415)."""
    check_json_content_type(request.headers.get("content-type"))
    return decode_json(await request.body())


def check_json_content_type(value: str | None) -> None:
    """InvalidFieldError (415) unless `value` is application/json, parameters allowed."""
    media_type = (value or "").split(";", 1)[0].strip().lower()
    if media_type != JSON_MEDIA_TYPE:
        shown = f"'{value}'" if value else "none"
        raise InvalidFieldError(
            None, f"the request body must be JSON sent with Content-Type: {JSON_MEDIA_TYPE}, "
            f"got {shown}", UNSUPPORTED_MEDIA_TYPE.http_status,
        )


def decode_json(body: bytes) -> Any:
    """The body as JSON; InvalidFieldError (400) saying what is wrong with it."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidFieldError(
            None, f"the request body is not valid UTF-8 (byte 0x{body[e.start]:02x} at "
            f"offset {e.start})",
        ) from None
    if not text.strip():
        raise InvalidFieldError(None, "the request body is empty; expected a JSON object")
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise InvalidFieldError(None, "the request body is nested too deeply") from None
    except ValueError as e:
        reason = str(e)
        if "digits" in reason:  # Python's int_max_str_digits guard
            reason = "a number has too many digits"
        raise InvalidFieldError(None, f"the request body is not valid JSON: {reason}") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")
