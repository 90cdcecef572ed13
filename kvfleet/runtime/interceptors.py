"""Server interceptors every kvfleet service installs: error mapping and drain tracking.

Role: servicers stay thin — they raise ValueError / OverloadedError / UnavailableError and
never touch status codes; `ErrorMappingInterceptor` turns exceptions into statuses (and
trailing metadata, e.g. a rate limit's retry-after) through the one error table,
`kvfleet.contracts.errors.failure_of`. `DrainTracker` counts in-flight work RPCs so a
shutting-down server can wait for exactly those (not for endless health Watch streams) and
refuse new work with UNAVAILABLE while health checks still answer NOT_SERVING.

Invariants:
- Works for all four handler kinds of grpc.aio (unary/streaming requests and responses),
  whether a streaming handler is an async generator or uses `context.write`. Handlers
  must be `async` (a plain function would run on, and block, the event loop).
- `context.abort(...)` called by a servicer (grpc.aio.AbortError), cancellation and
  generator close pass through untouched: only `Exception`s raised by handler code are
  mapped, and never twice.
- Health and reflection RPCs are exempt from drain tracking: they are not work, and a
  Watch stream never ends on its own.
- Request messages are decoded inside error mapping (grpc is handed raw bytes): a message
  that does not parse is INVALID_ARGUMENT naming the expected type, on every service
  (health and reflection included), never grpc's UNKNOWN with a Python class name.
  Request-streaming handlers must therefore read their requests from the request
  iterator, not with `context.read()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio

from kvfleet.contracts.errors import UnavailableError, failure_of

logger = logging.getLogger(__name__)

# Method-name prefixes of infrastructure services that drain tracking ignores.
EXEMPT_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

# An async context manager entered around one whole RPC (method name, servicer context).
RpcScope = Callable[[str, grpc.aio.ServicerContext], contextlib.AbstractAsyncContextManager[Any]]


class _ScopedInterceptor(grpc.aio.ServerInterceptor):
    """Base class: wraps every handler so the RPC runs inside `self.scope(method, context)`."""

    def scope(
        self, method: str, context: grpc.aio.ServicerContext
    ) -> contextlib.AbstractAsyncContextManager[Any]:
        raise NotImplementedError

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: let grpc answer UNIMPLEMENTED
            return handler
        return wrap_handler(self.prepare(handler), handler_call_details.method, self.scope)

    def prepare(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """The handler to wrap (subclasses may change it first)."""
        return handler


class ErrorMappingInterceptor(_ScopedInterceptor):
    """Maps exceptions escaping a handler (or its request decoding) to a status code."""

    def prepare(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        # Request bytes are decoded inside the scope, so an undecodable message maps too.
        return decoding_in_handler(handler)

    def scope(
        self, method: str, context: grpc.aio.ServicerContext
    ) -> contextlib.AbstractAsyncContextManager[Any]:
        return _map_errors(method, context)


class DrainTracker(_ScopedInterceptor):
    """Counts in-flight work RPCs; once draining, refuses new ones with UNAVAILABLE."""

    def __init__(self) -> None:
        self._in_flight = 0
        self._draining = False
        # Created lazily: it must belong to the server's event loop.
        self._idle: asyncio.Event | None = None

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def draining(self) -> bool:
        return self._draining

    def start_draining(self) -> None:
        self._draining = True

    async def wait_idle(self, timeout_s: float | None) -> bool:
        """Wait until no work RPC is in flight; False if `timeout_s` passed first."""
        if self._in_flight == 0:
            return True
        idle = self._idle_event()
        try:
            await asyncio.wait_for(idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def scope(
        self, method: str, context: grpc.aio.ServicerContext
    ) -> contextlib.AbstractAsyncContextManager[Any]:
        if method.startswith(EXEMPT_METHOD_PREFIXES):
            return contextlib.nullcontext()
        return self._track()

    def _idle_event(self) -> asyncio.Event:
        if self._idle is None:
            self._idle = asyncio.Event()
        return self._idle

    @contextlib.asynccontextmanager
    async def _track(self) -> AsyncIterator[None]:
        if self._draining:
            raise UnavailableError("server is shutting down; retry on another replica")
        self._in_flight += 1
        self._idle_event().clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle_event().set()


@contextlib.asynccontextmanager
async def _map_errors(method: str, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    try:
        yield
    except grpc.aio.AbortError:
        raise  # the handler already chose a status with context.abort()
    except Exception as exc:
        failure = failure_of(exc)
        if failure.unexpected:
            logger.exception("unexpected error in %s", method)
        else:
            logger.debug("%s failed with %s: %s", method, failure.grpc_code.name, failure.message)
        await context.abort(failure.grpc_code, failure.message,
                            trailing_metadata=tuple(failure.grpc_trailing_metadata))


def wrap_handler(handler: grpc.RpcMethodHandler, method: str, scope: RpcScope) -> Any:
    """A copy of `handler` whose behaviour runs inside `scope(method, context)`."""
    request_streaming = handler.request_streaming
    if not handler.response_streaming:
        inner = handler.stream_unary if request_streaming else handler.unary_unary

        async def unary_response(request: Any, context: grpc.aio.ServicerContext) -> Any:
            async with scope(method, context):
                result = inner(request, context)
                return await result if inspect.isawaitable(result) else result

        factory = (
            grpc.stream_unary_rpc_method_handler
            if request_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        behavior: Callable[..., Any] = unary_response
    else:
        inner = handler.stream_stream if request_streaming else handler.unary_stream

        # Always an async generator: grpc.aio dispatches on the handler's function kind.
        async def streaming_response(
            request: Any, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            # aclosing: if grpc stops iterating early, the handler's own cleanup (finally
            # blocks, e.g. aborting an engine request) runs now, not when the GC finds it.
            # inner() is called inside the scope: it may raise (request decoding).
            async with scope(method, context):
                result = inner(request, context)
                # An async generator (every streaming handler of ours) is iterated as it is:
                # one generator layer less per message than the _responses adapter.
                stream = result if hasattr(result, "aclose") else _responses(result)
                async with contextlib.aclosing(stream):
                    async for response in stream:
                        yield response

        factory = (
            grpc.stream_stream_rpc_method_handler
            if request_streaming
            else grpc.unary_stream_rpc_method_handler
        )
        behavior = streaming_response
    return factory(
        behavior,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def decoding_in_handler(handler: grpc.RpcMethodHandler) -> Any:
    """A copy of `handler` that gets raw bytes from grpc and decodes them itself.

    grpc turns a failing deserializer into UNKNOWN ("Unexpected <class ...DecodeError>");
    decoding inside the handler lets error mapping answer INVALID_ARGUMENT instead.
    """
    decode = handler.request_deserializer
    if decode is None:
        return handler

    def parse(raw: bytes) -> Any:
        try:
            return decode(raw)
        except Exception as exc:  # DecodeError, or anything a custom deserializer raises
            raise ValueError(f"the request message could not be decoded: {exc}") from None

    async def decoded(requests: AsyncIterator[bytes]) -> AsyncIterator[Any]:
        async for raw in requests:
            yield parse(raw)

    adapt: Callable[[Any], Any] = decoded if handler.request_streaming else parse
    kind = _HANDLER_KINDS[(handler.request_streaming, handler.response_streaming)]
    inner = getattr(handler, kind)

    def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
        return inner(adapt(request), context)

    factory = getattr(grpc, f"{kind}_rpc_method_handler")
    return factory(
        behavior, request_deserializer=None, response_serializer=handler.response_serializer
    )


_HANDLER_KINDS = {
    (False, False): "unary_unary",
    (False, True): "unary_stream",
    (True, False): "stream_unary",
    (True, True): "stream_stream",
}


async def _responses(result: Any) -> AsyncGenerator[Any, None]:
    """Responses of a streaming handler: async generator, sync iterator or writer coroutine."""
    if hasattr(result, "__aiter__"):
        try:
            async for response in result:
                yield response
        finally:
            aclose = getattr(result, "aclose", None)
            if aclose is not None:
                await aclose()
    elif inspect.isawaitable(result):
        await result  # reader/writer API: responses already went out via context.write()
    elif result is not None:
        for response in result:
            yield response
