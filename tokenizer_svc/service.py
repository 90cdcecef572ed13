"""TokenizerServicer: the kvfleet.v1.Tokenizer gRPC service over `kvfleet.text.tokenizer.Tokenizer`.

Role: a thin adapter. Validation happens here and raises ValueError with a message naming
the offending field; `kvfleet.runtime.interceptors.ErrorMappingInterceptor` turns that into
INVALID_ARGUMENT. Results are exactly `kvfleet.text.tokenizer.Tokenizer`'s (the engine and the
service can never disagree on ids).

Invariants:
- Unset optional fields take vLLM's defaults: add_special_tokens is true for text and
  false for chat (templates emit their own BOS), add_generation_prompt and
  skip_special_tokens are true.
- Whole-prompt work (template rendering, encoding, full decodes) runs in a worker thread so
  one long prompt never stalls other streams on the event loop; the per-token streaming
  path decodes small windows inline (a thread hop would cost more than the work).
- Special-token strings in a text prompt or a message's content are plain text, never
  control tokens; the chat template's own stay special (`kvfleet.text.chat_encoding`).
  `allow_special_tokens` (`--allow-special-tokens-in-prompts`) restores vLLM's behaviour.
- The servicer keeps no state between RPCs; each DetokenizeStream owns its detokenizer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc.aio
import jinja2
from google.protobuf.message import Message

from kvfleet.runtime.grpc_server import Service
from kvfleet.text.chat_encoding import encode_chat
from kvfleet.text.incremental import IncrementalDetokenizer
from kvfleet.text.tokenizer import Tokenizer, load_generation_eos_ids
from kvfleet.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from tokenizer_svc.chat_input import CHAT_ROLES, parse_tools, validate_messages

SERVICE_NAME = tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name
__all__ = ["CHAT_ROLES", "TokenizerServicer", "build_info", "validate_messages"]


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    def __init__(
        self, tokenizer: Tokenizer, info: tokenizer_pb2.TokenizerInfo,
        allow_special_tokens: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._info = info
        self._vocab_size = tokenizer.vocab_size
        self._allow_special_tokens = allow_special_tokens

    @classmethod
    def from_model_dir(
        cls, model_dir: str | Path, model_name: str | None = None,
        chat_template: str | None = None, allow_special_tokens: bool = False,
    ) -> TokenizerServicer:
        """`chat_template` (source) replaces the model's own, or supplies a missing one;
        `allow_special_tokens`: prompts may spell control tokens (vLLM's behaviour)."""
        model_dir = Path(model_dir)
        tokenizer = Tokenizer.from_dir(model_dir)
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        eos_token_ids = load_generation_eos_ids(model_dir)
        info = build_info(tokenizer, eos_token_ids, model_name or model_dir.name)
        return cls(tokenizer, info, allow_special_tokens)

    def as_service(self) -> Service:
        """This servicer as a `kvfleet.runtime.grpc_server.Service` to host."""
        return Service(
            SERVICE_NAME,
            lambda server: tokenizer_pb2_grpc.add_TokenizerServicer_to_server(self, server),
        )

    async def Tokenize(
        self, request: tokenizer_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.TokenizeResponse:
        kind = request.WhichOneof("input")
        if kind == "text":
            if not request.text:
                raise ValueError("text must not be empty")
            add_special = _flag(request, "add_special_tokens", default=True)
            ids = await asyncio.to_thread(self._tokenizer.encode, request.text, add_special,
                                          not self._allow_special_tokens)
            return tokenizer_pb2.TokenizeResponse(token_ids=ids, prompt=request.text)
        if kind == "messages":
            messages = validate_messages(request.messages.messages)
            tools = parse_tools(request.messages.tools_json)
            prompt, ids = await asyncio.to_thread(
                self._render_and_encode,
                messages,
                tools,
                _flag(request, "add_generation_prompt", default=True),
                _flag(request, "add_special_tokens", default=False),
            )
            return tokenizer_pb2.TokenizeResponse(token_ids=ids, prompt=prompt)
        raise ValueError("input must be set: either text or messages")

    async def Detokenize(
        self, request: tokenizer_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.DetokenizeResponse:
        ids = list(request.token_ids)
        self._check_token_ids(ids, "token_ids")
        skip = _flag(request, "skip_special_tokens", default=True)
        text = await asyncio.to_thread(self._tokenizer.decode, ids, skip)
        response = tokenizer_pb2.DetokenizeResponse(text=text)
        if request.per_token:
            response.token_texts.extend(
                await asyncio.to_thread(lambda: [self._tokenizer.decode([i], False) for i in ids])
            )
        return response

    async def DetokenizeStream(
        self,
        request_iterator: AsyncIterator[tokenizer_pb2.DetokenizeStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[tokenizer_pb2.DetokenizeStreamResponse]:
        detokenizer: IncrementalDetokenizer | None = None
        async for request in request_iterator:
            if detokenizer is None:
                detokenizer = self._start_stream(request)
            elif request.HasField("skip_special_tokens") or request.prompt_token_ids:
                raise ValueError(
                    "skip_special_tokens and prompt_token_ids may only be set on the first message"
                )
            ids = list(request.token_ids)
            self._check_token_ids(ids, "token_ids")
            yield tokenizer_pb2.DetokenizeStreamResponse(text_delta=detokenizer.add_tokens(ids))
        if detokenizer is not None:
            tail = detokenizer.flush()
            if tail:
                yield tokenizer_pb2.DetokenizeStreamResponse(text_delta=tail)

    async def GetInfo(
        self, request: tokenizer_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.TokenizerInfo:
        return self._info

    # -- helpers ---------------------------------------------------------------------------

    def _start_stream(self, first: tokenizer_pb2.DetokenizeStreamRequest) -> IncrementalDetokenizer:
        prompt_ids = list(first.prompt_token_ids)
        self._check_token_ids(prompt_ids, "prompt_token_ids")
        skip = _flag(first, "skip_special_tokens", default=True)
        return IncrementalDetokenizer(self._tokenizer, skip, prompt_ids)

    def _render_and_encode(
        self, messages: list[dict[str, Any]], tools: list[Any] | None,
        add_generation_prompt: bool, add_special: bool,
    ) -> tuple[str, list[int]]:
        try:
            return encode_chat(self._tokenizer, messages, add_generation_prompt, add_special,
                               self._allow_special_tokens, tools)
        except jinja2.TemplateSyntaxError:
            raise  # the model's template is broken: a server problem, not the request's
        except jinja2.TemplateError as e:
            # raise_exception() in templates, e.g. "roles must alternate user/assistant".
            raise ValueError(f"the chat template rejected the messages: {e}") from e

    def _check_token_ids(self, ids: Sequence[int], field: str) -> None:
        # max() runs in C; only a failing request pays for finding the index.
        if ids and max(ids) >= self._vocab_size:
            index, bad = next((i, t) for i, t in enumerate(ids) if t >= self._vocab_size)
            raise ValueError(
                f"{field}[{index}] = {bad} is outside the vocabulary (size {self._vocab_size})"
            )


def _flag(message: Message, field: str, default: bool) -> bool:
    """An `optional bool` field's value, or its documented default when unset."""
    return bool(getattr(message, field)) if message.HasField(field) else default


def build_info(
    tokenizer: Tokenizer, eos_token_ids: Sequence[int], model_name: str
) -> tokenizer_pb2.TokenizerInfo:
    info = tokenizer_pb2.TokenizerInfo(
        model_name=model_name,
        vocab_size=tokenizer.vocab_size,
        eos_token_ids=list(eos_token_ids),
        all_special_ids=tokenizer.all_special_ids,
        has_chat_template=tokenizer.chat_template is not None,
    )
    if tokenizer.bos_token_id is not None:
        info.bos_token_id = tokenizer.bos_token_id
    if tokenizer.pad_token_id is not None:
        info.pad_token_id = tokenizer.pad_token_id
    return info
