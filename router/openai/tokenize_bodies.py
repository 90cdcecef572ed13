"""Bodies of vLLM's /tokenize and /detokenize, and of the small answers the router gives.

Role: pydantic models with vLLM's field names and defaults, checked like the OpenAI bodies
(`router.openai.requests`: an `InvalidFieldError` naming the field, HTTP 400), and their
mapping onto the tokenizer service's `TokenizeRequest`.

Invariants:
- A body with `messages` is a chat (template applied, `add_generation_prompt` true and
  `add_special_tokens` false by default); otherwise `prompt` is text (`add_special_tokens`
  true by default). These are exactly what /v1/completions and /v1/chat/completions use, so
  /tokenize gives the ids the engine will see.
- Chat-template options that /v1/chat/completions refuses are refused here by name too, as
  is vLLM's `return_token_strs` (no raw token strings over the tokenizer service).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvfleet.contracts.errors import InvalidFieldError
from kvfleet.v1 import common_pb2, router_pb2, tokenizer_pb2
from router.openai.requests import UINT32, ChatMessage, validation_error
from router.openai.tools import check_tools, tools_json
from router.request_limits import RequestLimits

# Fields of vLLM's tokenize bodies kvfleet does not implement -> is the value harmless?
_REFUSED_UNLESS_OFF = ("return_token_strs", "continue_final_message", "chat_template",
                       "chat_template_kwargs", "mm_processor_kwargs")


class _TokenizeBody(BaseModel):
    # Unknown fields are ignored, as vLLM does; known-unsupported ones are named. Strict, as
    # the OpenAI bodies: "add_special_tokens": "no" is a 400, not true.
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    return_token_strs: bool | None = Field(
        False, description="Not supported: must be false or unset."
    )

    def check_unsupported(self) -> None:
        for name in _REFUSED_UNLESS_OFF:
            if getattr(self, name, None):
                raise InvalidFieldError(name, f"`{name}` is not supported")


class TokenizeCompletionBody(_TokenizeBody):
    """Text to token ids, as /v1/completions tokenizes a prompt."""

    prompt: str = Field(min_length=1)
    add_special_tokens: bool = Field(True, description="Add the tokenizer's BOS/EOS etc.")

    def router_request(self) -> router_pb2.RouterGenerateRequest:
        try:
            self.prompt.encode("utf-8")
        except UnicodeEncodeError:  # JSON escapes can carry unpaired surrogates
            raise InvalidFieldError("prompt", "prompt is not valid Unicode") from None
        return router_pb2.RouterGenerateRequest(prompt=self.prompt)

    def tokenizer_request(self) -> tokenizer_pb2.TokenizeRequest:
        return tokenizer_pb2.TokenizeRequest(
            text=self.prompt, add_special_tokens=self.add_special_tokens
        )


class TokenizeChatBody(_TokenizeBody):
    """Chat messages to token ids through the chat template, as /v1/chat/completions does."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = Field(True, description="End with the assistant header.")
    add_special_tokens: bool = Field(
        False, description="Add special tokens on top of the template's own."
    )
    continue_final_message: bool = Field(False, description="Not supported: must be false.")
    tools: Any = Field(None, description="Tools the chat template renders, as in chat "
                       "completions.", json_schema_extra={"type": ["array", "null"]})

    def router_request(self) -> router_pb2.RouterGenerateRequest:
        request = router_pb2.RouterGenerateRequest()
        check_tools(self.tools, None)
        for index, message in enumerate(self.messages):
            message.add_to(request.messages, index)
        request.messages.tools_json = tools_json(self.tools)
        return request

    def tokenizer_request(self) -> tokenizer_pb2.TokenizeRequest:
        messages = common_pb2.ChatMessages()
        messages.CopyFrom(self.router_request().messages)
        return tokenizer_pb2.TokenizeRequest(
            messages=messages,
            add_special_tokens=self.add_special_tokens,
            add_generation_prompt=self.add_generation_prompt,
        )


class DetokenizeBody(BaseModel):
    """Token ids to text; special tokens are kept, so tokenize -> detokenize gives back the
    text (or rendered chat) that was encoded."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    tokens: list[int] = Field(description=f"Token ids, each in [0, vocab size) (< {UINT32})")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


TokenizeBody = TokenizeCompletionBody | TokenizeChatBody


def parse_tokenize(data: object, limits: RequestLimits) -> TokenizeBody:
    """A /tokenize body: a chat when it has `messages`, else text; InvalidFieldError."""
    if not isinstance(data, dict):
        raise InvalidFieldError(None, "the request body must be a JSON object")
    cls: type[TokenizeBody] = TokenizeChatBody if "messages" in data else TokenizeCompletionBody
    messages = data.get("messages")
    if isinstance(messages, list) and len(messages) > limits.max_messages:
        raise InvalidFieldError("messages", f"messages has {len(messages)} entries; at most "
                                f"{limits.max_messages} are allowed")
    body = _validate(cls, data)
    body.check_unsupported()
    limits.check_request(body.router_request())
    return body


def parse_detokenize(data: object) -> DetokenizeBody:
    if not isinstance(data, dict):
        raise InvalidFieldError(None, "the request body must be a JSON object")
    body = _validate(DetokenizeBody, data)
    for index, token in enumerate(body.tokens):
        if not 0 <= token < UINT32:
            raise InvalidFieldError("tokens", f"tokens[{index}] must be a token id, got {token}")
    return body


def _validate(cls: type[Any], data: dict[str, Any]) -> Any:
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
