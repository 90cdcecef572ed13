"""The router's side of tokenizer_svc: prompts -> token ids (and whole-text decodes for echo).

Role: the router never loads a tokenizer itself; a tokenizer service (a pool of replicas
behind one address) does text work for every router replica, so routers stay model-agnostic
and light. It is called once per request, never per generated token: engines stream their
text already detokenized.

Invariants:
- `tokenize` sends text with special tokens added (BOS) and chat with the template applied,
  exactly as the Router proto documents; pre-tokenized prompts never reach this module.
- Every call is retried once on UNAVAILABLE, over a fresh connection: a restarted tokenizer
  (or, behind a Service, another replica) answers the retry without waiting out the old
  channel's reconnect backoff. Calls still running on the old channel finish on it (it is
  closed with a grace period). A second UNAVAILABLE fails the request with UNAVAILABLE.
  Tokenization is idempotent, so a retry never changes a result.
- Other errors from the tokenizer keep their status (e.g. INVALID_ARGUMENT for a bad chat)
  through `kvfleet.contracts.errors`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
import grpc.aio

from kvfleet.contracts.errors import InvalidFieldError, UnavailableError
from kvfleet.runtime.tls import ClientTls, aio_channel
from kvfleet.runtime.tracing import trace_metadata
from kvfleet.v1 import router_pb2, tokenizer_pb2, tokenizer_pb2_grpc

logger = logging.getLogger(__name__)

T = TypeVar("T")
# A dropped connection is retried soon (gRPC's default backoff starts at 1 s, grows to 120 s).
# A private subchannel pool per channel: otherwise a replacement channel shares the old one's
# connection (gRPC pools them process-wide) and with it the reconnect backoff it must skip.
CHANNEL_OPTIONS = (
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
)


class TokenizerClient:
    """A channel to tokenizer_svc; create inside the event loop that will use it."""

    def __init__(
        self, address: str, timeout_s: float = 30.0, tls: ClientTls | None = None
    ) -> None:
        self.address = address
        self._timeout_s = timeout_s
        # Mutual TLS verifying the tokenizer's certificate (kvfleet.runtime.tls); None: plaintext.
        self._tls = tls
        self._channel = aio_channel(address, tls, options=CHANNEL_OPTIONS)
        self._stub = tokenizer_pb2_grpc.TokenizerStub(self._channel)
        self._info: tokenizer_pb2.TokenizerInfo | None = None
        # Replaced channels, closing once their calls end (kept so close() can await them).
        self._closing: set[asyncio.Task[None]] = set()

    async def info(self) -> tokenizer_pb2.TokenizerInfo:
        """The tokenizer's static facts, fetched once (they never change for a server)."""
        if self._info is None:
            request = tokenizer_pb2.GetInfoRequest()
            info: tokenizer_pb2.TokenizerInfo = await self._call(
                lambda stub, **kw: stub.GetInfo(request, **kw)
            )
            self._info = info
            return info
        return self._info

    async def tokenize(self, request: router_pb2.RouterGenerateRequest) -> list[int]:
        """Token ids of a prompt or a chat; InvalidFieldError for an empty input."""
        kind = request.WhichOneof("input")
        if kind == "prompt":
            if not request.prompt:
                raise InvalidFieldError("prompt", "prompt must not be empty")
            tokenize = tokenizer_pb2.TokenizeRequest(text=request.prompt)
        elif kind == "messages":
            if not request.messages.messages:
                raise InvalidFieldError("messages", "messages must not be empty")
            tokenize = tokenizer_pb2.TokenizeRequest(messages=request.messages)
        else:
            raise ValueError(f"tokenize() got input {kind!r}; expected prompt or messages")
        response = await self._call(lambda stub, **kw: stub.Tokenize(tokenize, **kw))
        return list(response.token_ids)

    async def tokenize_raw(
        self, request: tokenizer_pb2.TokenizeRequest
    ) -> tokenizer_pb2.TokenizeResponse:
        """The tokenizer's own Tokenize (HTTP /tokenize: special-token and template flags)."""
        response: tokenizer_pb2.TokenizeResponse = await self._call(
            lambda stub, **kw: stub.Tokenize(request, **kw)
        )
        return response

    async def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool) -> str:
        """Text of `token_ids` in one piece (echo of a pre-tokenized prompt)."""
        request = tokenizer_pb2.DetokenizeRequest(
            token_ids=list(token_ids), skip_special_tokens=skip_special_tokens
        )
        response = await self._call(lambda stub, **kw: stub.Detokenize(request, **kw))
        return str(response.text)

    async def close(self) -> None:
        await self._channel.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    async def _call(self, rpc: Callable[..., Awaitable[T]]) -> T:
        """`rpc(stub, timeout=..., metadata=...)`, retried once on UNAVAILABLE."""
        stub = self._stub
        try:
            return await rpc(stub, **self._call_options())
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            logger.warning("tokenizer %s unavailable (%s); retrying on a new connection",
                           self.address, e.details())
        self._reconnect(stub)
        try:
            return await rpc(self._stub, **self._call_options())
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            raise UnavailableError(
                f"tokenizer service {self.address} is unavailable: {e.details()}"
            ) from e

    def _call_options(self) -> dict[str, Any]:
        return {"timeout": self._timeout_s, "metadata": trace_metadata()}

    def _reconnect(self, failed: tokenizer_pb2_grpc.TokenizerStub) -> None:
        if failed is not self._stub:
            return  # a concurrent call already replaced that channel
        old = self._channel
        self._channel = aio_channel(self.address, self._tls, options=CHANNEL_OPTIONS)
        self._stub = tokenizer_pb2_grpc.TokenizerStub(self._channel)
        task = asyncio.ensure_future(old.close(grace=self._timeout_s))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
