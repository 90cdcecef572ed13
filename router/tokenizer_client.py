"""The router's side of tokenizer_svc: prompts -> token ids, token stream -> text deltas.

Role: the router never loads a tokenizer itself; one tokenizer service (or a pool behind one
address) does text work for every replica, so routers stay model-agnostic and light.

Invariants:
- `tokenize` sends text with special tokens added (BOS) and chat with the template applied,
  exactly as the Router proto documents; pre-tokenized prompts never reach this module.
- `StreamingDetokenizer` follows DetokenizeStream's lockstep protocol: one response per
  request message, then at most one tail message after half-close. Text is therefore
  exactly `Detokenize(all generated ids)` and never ends inside a character.
- Errors from the tokenizer keep their status (INVALID_ARGUMENT for a bad chat, UNAVAILABLE
  when the service is down) through `kvfleet.errors`.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
import grpc.aio

from kvfleet.tracing import trace_metadata
from kvfleet.v1 import router_pb2, tokenizer_pb2, tokenizer_pb2_grpc

# Prompt ids sent as left context for the first generated tokens (the service uses fewer).
PROMPT_CONTEXT_IDS = 16


class TokenizerClient:
    """A channel to tokenizer_svc; create inside the event loop that will use it."""

    def __init__(self, address: str, timeout_s: float = 30.0) -> None:
        self.address = address
        self._timeout_s = timeout_s
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = tokenizer_pb2_grpc.TokenizerStub(self._channel)
        self._info: tokenizer_pb2.TokenizerInfo | None = None

    async def info(self) -> tokenizer_pb2.TokenizerInfo:
        """The tokenizer's static facts, fetched once (they never change for a server)."""
        if self._info is None:
            self._info = await self._stub.GetInfo(
                tokenizer_pb2.GetInfoRequest(), timeout=self._timeout_s
            )
        return self._info

    async def tokenize(self, request: router_pb2.RouterGenerateRequest) -> list[int]:
        """Token ids of a prompt or a chat; ValueError for an empty input."""
        kind = request.WhichOneof("input")
        if kind == "prompt":
            if not request.prompt:
                raise ValueError("prompt must not be empty")
            tokenize = tokenizer_pb2.TokenizeRequest(text=request.prompt)
        elif kind == "messages":
            if not request.messages.messages:
                raise ValueError("messages must not be empty")
            tokenize = tokenizer_pb2.TokenizeRequest(messages=request.messages)
        else:
            raise ValueError(f"tokenize() got input {kind!r}; expected prompt or messages")
        response = await self._stub.Tokenize(
            tokenize, timeout=self._timeout_s, metadata=trace_metadata()
        )
        return list(response.token_ids)

    async def token_texts(self, token_ids: Sequence[int]) -> list[str]:
        """Each id decoded on its own (the strings logprobs show); one round trip."""
        if not token_ids:
            return []
        response = await self._stub.Detokenize(
            tokenizer_pb2.DetokenizeRequest(token_ids=list(token_ids), per_token=True),
            timeout=self._timeout_s,
            metadata=trace_metadata(),
        )
        return list(response.token_texts)

    async def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool) -> str:
        """Text of `token_ids` in one piece (echo of a pre-tokenized prompt)."""
        response = await self._stub.Detokenize(
            tokenizer_pb2.DetokenizeRequest(
                token_ids=list(token_ids), skip_special_tokens=skip_special_tokens
            ),
            timeout=self._timeout_s,
            metadata=trace_metadata(),
        )
        return str(response.text)

    def detokenizer(
        self, prompt_ids: Sequence[int], skip_special_tokens: bool
    ) -> StreamingDetokenizer:
        return StreamingDetokenizer(self._stub, prompt_ids, skip_special_tokens)

    async def close(self) -> None:
        await self._channel.close()


class StreamingDetokenizer:
    """One DetokenizeStream call: `add(ids)` -> text delta; `finish()` -> held-back tail."""

    def __init__(
        self,
        stub: tokenizer_pb2_grpc.TokenizerStub,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool,
    ) -> None:
        self._stub = stub
        self._first = tokenizer_pb2.DetokenizeStreamRequest(
            skip_special_tokens=skip_special_tokens,
            prompt_token_ids=list(prompt_ids[-PROMPT_CONTEXT_IDS:]),
        )
        self._call: grpc.aio.StreamStreamCall | None = None

    async def add(self, token_ids: Sequence[int]) -> str:
        if not token_ids:
            return ""
        if self._call is None:
            # Opened lazily: a request that fails before its first token costs no stream.
            self._call = self._stub.DetokenizeStream(metadata=trace_metadata())
            message = self._first
            message.token_ids.extend(token_ids)
        else:
            message = tokenizer_pb2.DetokenizeStreamRequest(token_ids=list(token_ids))
        await self._call.write(message)
        response = await self._call.read()
        if response is grpc.aio.EOF:
            raise RuntimeError("tokenizer closed the detokenize stream early")
        return str(response.text_delta)

    async def finish(self) -> str:
        """Half-close and return the text still held back (usually empty)."""
        if self._call is None:
            return ""
        call, self._call = self._call, None
        await call.done_writing()
        tail: list[str] = []
        while (response := await call.read()) is not grpc.aio.EOF:
            tail.append(response.text_delta)
        return "".join(tail)

    def cancel(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None
