"""OpenAI request bodies (completions, chat) and their mapping onto RouterGenerateRequest.

Role: `parse_body` turns a decoded JSON body into a pydantic model with OpenAI's field
names and defaults plus vLLM's extra body fields (top_k, min_p, repetition_penalty,
ignore_eos, min_tokens, include_stop_str_in_output, skip_special_tokens, stop_token_ids);
`to_router_requests` turns one body into one router request per prompt.

Invariants:
- Every value is checked before anything is computed: field types and ranges here (pydantic
  in strict mode: a boolean is a JSON boolean, a number a JSON number, never a string; each
  integer bounded by its proto type so nothing overflows later; messages per role), sizes by
  `router.request_limits`, sampling rules by the router with the engine's own validation. A problem
  is an `InvalidFieldError` naming the field (HTTP 400, `param` in the error JSON).
- Structured outputs (`response_format`, vLLM's `structured_outputs` and `guided_*`) are
  read and compiled by `router.openai.structured_bodies`, a bad one naming its exact field.
- OpenAI and vLLM features kvfleet does not implement (logit_bias, suffix, best_of != n,
  another guided_decoding_backend, tools outside chat, ...) are refused by name when set to
  anything but their no-op value, never silently ignored.
- Chat `tools` / `tool_choice` are checked here (`router.openai.tools`), and assistant
  `tool_calls` and tool turns' `tool_call_id` travel to the chat template.
- Other unknown fields are ignored, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvfleet.contracts.errors import InvalidFieldError
from kvfleet.contracts.structured_proto import to_proto as structured_to_proto
from kvfleet.v1 import common_pb2, router_pb2
from router.openai.structured_bodies import structured_outputs_of
from router.openai.tools import ToolChoice, check_tools, message_tool_calls, tools_json
from router.request_limits import RequestLimits

INT32 = 2**31
UINT32 = 2**32
# Larger finite floats become infinity in the proto's float32 fields.
FLOAT32_MAX = 3.4e38
# Pydantic problems listed in one error message (the first one is the `param`).
MAX_REPORTED_PROBLEMS = 3

Body = TypeVar("Body", bound="_SamplingBody")

# JSON schemas (for /openapi.json) of the fields typed Any here, checked by hand below.
_TOKEN_IDS_SCHEMA = {
    "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": UINT32 - 1},
    "minItems": 1,
}
PROMPT_SCHEMA: dict[str, Any] = {"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
    _TOKEN_IDS_SCHEMA,
    {"type": "array", "items": _TOKEN_IDS_SCHEMA, "minItems": 1},
]}
STOP_SCHEMA: dict[str, Any] = {"anyOf": [
    {"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "null"},
]}
CONTENT_SCHEMA: dict[str, Any] = {"anyOf": [
    {"type": "string"},
    {"type": "array", "items": {
        "type": "object", "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    }},
    {"type": "null"},
]}


def _unset(value: Any) -> bool:
    return value is None


def _empty(value: Any) -> bool:
    return not value


# Fields kvfleet does not implement -> whether a value is harmless (their "off" value).
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "logit_bias": _empty,
    "functions": _empty,
    "function_call": lambda v: v in (None, "none"),
    # One backend (llguidance): naming it, or leaving the choice to the server, is harmless.
    "guided_decoding_backend": lambda v: v in (None, "auto", "guidance", "llguidance"),
    "allowed_token_ids": _unset,
    "bad_words": _empty,
    "logits_processors": _empty,
    "use_beam_search": _empty,
    "length_penalty": lambda v: v in (None, 1, 1.0),
    "truncate_prompt_tokens": _unset,
    "prompt_logprobs": _unset,
    "return_tokens_as_token_ids": _empty,
}
_UNSUPPORTED_CHAT: dict[str, Callable[[Any], bool]] = {
    "audio": _unset,
    "modalities": lambda v: v in (None, ["text"]),
    "prediction": _unset,
    "web_search_options": _unset,
    "reasoning_effort": _unset,
    "echo": _empty,
    "continue_final_message": _empty,
    "add_generation_prompt": lambda v: v in (None, True),
    "chat_template": _unset,
    "chat_template_kwargs": _empty,
    "documents": _empty,
    "mm_processor_kwargs": _empty,
}
_UNSUPPORTED_COMPLETION: dict[str, Callable[[Any], bool]] = {
    "tools": _empty,
    "tool_choice": lambda v: v in (None, "none"),
    "parallel_tool_calls": _unset,
    "suffix": _empty,
    "prompt_embeds": _unset,
}


# Strict: JSON types as they are ("stream": "yes" is a 400, not true); ints may fill floats.
STRICT = ConfigDict(strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class _SamplingBody(BaseModel):
    """Fields shared by completions and chat."""

    # extra="allow": unknown fields are kept (and ignored) so unsupported ones can be named.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)
    UNSUPPORTED: ClassVar[dict[str, Callable[[Any], bool]]] = _UNSUPPORTED

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0, le=FLOAT32_MAX)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: Any = Field(None, json_schema_extra=STOP_SCHEMA)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: Any = None
    # vLLM's extra body fields.
    top_k: int | None = Field(None, ge=-1, lt=INT32)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=FLOAT32_MAX)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, lt=UINT32)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[int] | None = None
    priority: int | None = Field(None, ge=-INT32, lt=INT32)
    request_id: str | None = None

    def check_common(self) -> None:
        for name, harmless in self.UNSUPPORTED.items():
            if not harmless(getattr(self, name, None)):
                raise InvalidFieldError(name, f"`{name}` is not supported")
        if self.stream_options is not None and not self.stream:
            raise InvalidFieldError(
                "stream_options", "stream_options is only allowed when stream is true"
            )
        if self.top_k is not None and (self.top_k == 0 or self.top_k < -1):
            # The documented range (README: -1 disables; otherwise >= 1), as the engine's.
            raise InvalidFieldError(
                "top_k", f"top_k must be -1 (disable) or at least 1, got {self.top_k}"
            )
        for index, token in enumerate(self.stop_token_ids or ()):
            if not 0 <= token < UINT32:
                raise InvalidFieldError(
                    "stop_token_ids", f"stop_token_ids[{index}] must be a token id, got {token}"
                )

    def stop_strings(self) -> list[str]:
        stop = self.stop
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise InvalidFieldError("stop", "stop must be a string or an array of strings")
        return [_utf8(s, f"stop[{i}]") for i, s in enumerate(stop)]

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> common_pb2.SamplingParams:
        params = common_pb2.SamplingParams(
            n=self.n,
            min_p=self.min_p,
            min_tokens=self.min_tokens,
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            stop=self.stop_strings(),
            include_stop_str_in_output=self.include_stop_str_in_output,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
        )
        _set_if(params, "temperature", self.temperature)
        _set_if(params, "top_p", self.top_p)
        _set_if(params, "top_k", self.top_k if self.top_k not in (None, -1) else None)
        _set_if(params, "seed", self.seed)
        _set_if(params, "max_tokens", max_tokens)
        _set_if(params, "repetition_penalty", self.repetition_penalty)
        _set_if(params, "logprobs", logprobs)
        structured = structured_outputs_of(self)
        if structured is not None:
            params.structured_outputs.CopyFrom(structured_to_proto(structured))
        return params

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingBody):
    UNSUPPORTED: ClassVar[dict[str, Callable[[Any], bool]]] = {
        **_UNSUPPORTED, **_UNSUPPORTED_COMPLETION
    }

    # str, list[str], list[int] or list[list[int]]; checked in prompts() with a clear message.
    prompt: Any = Field(json_schema_extra=PROMPT_SCHEMA)
    # OpenAI's default for completions; None means up to the remaining context.
    max_tokens: int | None = Field(16, ge=1, lt=UINT32)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=128)
    suffix: Any = None

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [_prompt_text(prompt, "prompt")]
        if not isinstance(prompt, list) or not prompt:
            problem = _PROMPT_TYPES if prompt else "prompt must not be empty"
            raise InvalidFieldError("prompt", problem)
        if all(_is_token_id(p) for p in prompt):
            return [_token_ids(prompt, "prompt")]
        out: list[str | list[int]] = []
        for index, item in enumerate(prompt):
            param = f"prompt[{index}]"
            if isinstance(item, str):
                out.append(_prompt_text(item, param))
            elif isinstance(item, list) and all(_is_token_id(t) for t in item):
                out.append(_token_ids(item, param))
            else:
                raise InvalidFieldError("prompt", _PROMPT_TYPES)
        return out

    def to_router_requests(self) -> list[router_pb2.RouterGenerateRequest]:
        self.check_common()
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidFieldError(
                "best_of", "best_of must equal n (best_of sampling is not supported)"
            )
        params = self.sampling(self.max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None:
            params.prompt_logprobs = self.logprobs  # the echoed prompt shows its logprobs
        requests = []
        for prompt in self.prompts():
            request = _router_request(self, params)
            if isinstance(prompt, str):
                request.prompt = prompt
            else:
                request.prompt_token_ids.ids.extend(prompt)
            requests.append(request)
        return requests


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = Field(None, json_schema_extra=CONTENT_SCHEMA)
    tool_calls: Any = None
    tool_call_id: str | None = None
    name: str | None = None

    def add_to(self, messages: common_pb2.ChatMessages, index: int) -> None:
        """Append this message (text, tool calls, tool_call_id) to the proto's messages."""
        message = messages.messages.add(role=self.role, content=self.text(index))
        if self.tool_calls:
            if self.role != "assistant":
                raise InvalidFieldError(f"messages[{index}].tool_calls",
                                        "only assistant messages have tool_calls")
            message.tool_calls.extend(message_tool_calls(self.tool_calls, index))
        if self.role == "tool" and not self.tool_call_id:
            raise InvalidFieldError(f"messages[{index}].tool_call_id",
                                    "a tool message needs the tool_call_id it answers")
        message.tool_call_id = _utf8(self.tool_call_id or "", f"messages[{index}].tool_call_id")
        message.name = _utf8(self.name or "", f"messages[{index}].name")

    def text(self, index: int) -> str:
        param = f"messages[{index}].content"
        if self.content is None:
            self.check_role(param)
            return ""
        if isinstance(self.content, str):
            return _utf8(self.content, param)
        if not isinstance(self.content, list):
            raise InvalidFieldError(param, f"{param} must be a string or an array of text parts")
        parts = []
        for part in self.content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise InvalidFieldError(
                    param, f"{param}: only text parts are supported, got type {kind!r}"
                )
            parts.append(part["text"])
        return _utf8("".join(parts), param)

    def check_role(self, param: str) -> None:
        """A message without content: only an assistant's may lack it, and only when it
        carries tool_calls (OpenAI's rule); every other role needs its content."""
        if self.role == "assistant" and self.tool_calls:
            return
        needed = ("an assistant message without tool_calls" if self.role == "assistant"
                  else f"a {self.role} message")
        raise InvalidFieldError(param, f"{param} is required for {needed}")


class ChatCompletionRequest(_SamplingBody):
    UNSUPPORTED: ClassVar[dict[str, Callable[[Any], bool]]] = {
        **_UNSUPPORTED, **_UNSUPPORTED_CHAT
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, lt=UINT32)
    max_completion_tokens: int | None = Field(None, ge=1, lt=UINT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Checked by router.openai.tools (typed Any so every problem names its exact field).
    tools: Any = Field(None, json_schema_extra={"type": ["array", "null"]})
    tool_choice: Any = Field(None, json_schema_extra={"type": ["string", "object", "null"]})
    parallel_tool_calls: bool | None = None

    def checked_tool_choice(self) -> ToolChoice:
        """The tool choice, after checking `tools` and `tool_choice` (InvalidFieldError)."""
        return check_tools(self.tools, self.tool_choice)

    def to_router_requests(self) -> list[router_pb2.RouterGenerateRequest]:
        self.check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidFieldError("top_logprobs", "top_logprobs requires logprobs to be true")
        self.checked_tool_choice()
        k = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens or self.max_tokens
        request = _router_request(self, self.sampling(max_tokens, k))
        for index, message in enumerate(self.messages):
            message.add_to(request.messages, index)
        request.messages.tools_json = tools_json(self.tools)
        return [request]


def parse_body(cls: type[Body], data: object, limits: RequestLimits) -> Body:
    """The body as `cls`; InvalidFieldError naming the first problem (and its field)."""
    if not isinstance(data, dict):
        raise InvalidFieldError(None, "the request body must be a JSON object")
    # Counted before pydantic builds a model per entry of a huge list.
    messages, prompt = data.get("messages"), data.get("prompt")
    if isinstance(messages, list) and len(messages) > limits.max_messages:
        raise InvalidFieldError("messages", f"messages has {len(messages)} entries; at most "
                                f"{limits.max_messages} are allowed")
    if isinstance(prompt, list) and prompt and not _is_token_id(prompt[0]):
        limits.check_choices(1, len(prompt))
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


def validation_error(error: ValidationError) -> InvalidFieldError:
    problems = []
    param = None
    for item in error.errors()[:MAX_REPORTED_PROBLEMS]:
        path = _path(item.get("loc", ()))
        param = param or path
        if item.get("type") == "missing":
            problems.append(f"{path or 'body'} is required")
        else:
            problems.append(f"{path or 'body'}: {item.get('msg', 'invalid value')}")
    return InvalidFieldError(param, "; ".join(problems) or "invalid request")


_PROMPT_TYPES = (
    "prompt must be a string, an array of strings, an array of token ids or an array of "
    "arrays of token ids"
)


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part != "body":
            out += f".{part}" if out else part
    return out


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(ids: list[int], param: str) -> list[int]:
    if not ids:
        raise InvalidFieldError(param, f"{param} must not be empty")
    if not all(0 <= t < UINT32 for t in ids):
        raise InvalidFieldError(param, f"{param}: token ids must be in [0, {UINT32})")
    return ids


def _prompt_text(text: str, param: str) -> str:
    if not text:
        raise InvalidFieldError(param, f"{param} must not be empty")
    return _utf8(text, param)


def _utf8(text: str, param: str) -> str:
    """`text` if it is valid Unicode; JSON escapes can smuggle in unpaired surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidFieldError(
            param, f"{param} contains an unpaired surrogate ({text[e.start]!r}), which is not "
            "valid Unicode",
        ) from None
    return text


def _router_request(
    body: _SamplingBody, params: common_pb2.SamplingParams
) -> router_pb2.RouterGenerateRequest:
    return router_pb2.RouterGenerateRequest(
        sampling_params=params,
        model=_utf8(body.model or "", "model"),
        priority=body.priority,  # None leaves it unset: the tenant's default
        request_id=_utf8(body.request_id or "", "request_id"),
    )


def _set_if(params: common_pb2.SamplingParams, name: str, value: object) -> None:
    if value is not None:
        setattr(params, name, value)
