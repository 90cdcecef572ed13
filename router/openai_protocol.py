"""OpenAI request bodies (completions, chat) and their mapping onto RouterGenerateRequest.

Role: pydantic models with OpenAI's field names and defaults plus vLLM's extra body fields
(top_k, min_p, repetition_penalty, ignore_eos, min_tokens, include_stop_str_in_output,
skip_special_tokens, stop_token_ids); `to_router_requests` turns one body into one router
request per prompt.

Invariants:
- Every value is checked before anything is computed: field types and ranges here (pydantic),
  sampling rules by the router with the engine's own validation. A problem is a ValueError
  naming the parameter (HTTP 400).
- OpenAI features kvfleet does not implement (logit_bias, suffix, best_of != n) are refused
  by name, never silently ignored.
- Unknown extra fields are ignored, as vLLM does.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvfleet.v1 import common_pb2, router_pb2


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingBody(BaseModel):
    """Fields shared by completions and chat."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extra body fields.
    top_k: int | None = None
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[int] | None = None
    priority: int = 0
    request_id: str | None = None

    def check_common(self) -> None:
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.top_k is not None and self.top_k not in (-1, 0) and self.top_k < 1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or at least 1, got {self.top_k}")

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> common_pb2.SamplingParams:
        params = common_pb2.SamplingParams(
            n=self.n,
            min_p=self.min_p,
            min_tokens=self.min_tokens,
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else (self.stop or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
        )
        if any(t < 0 for t in params.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative")
        _set_if(params, "temperature", self.temperature)
        _set_if(params, "top_p", self.top_p)
        _set_if(params, "top_k", self.top_k if self.top_k not in (None, -1, 0) else None)
        _set_if(params, "seed", self.seed)
        _set_if(params, "max_tokens", max_tokens)
        _set_if(params, "repetition_penalty", self.repetition_penalty)
        _set_if(params, "logprobs", logprobs)
        return params

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    # OpenAI's default for completions; None means up to the remaining context.
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ValueError("prompt must not be empty")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]

    def to_router_requests(self) -> list[router_pb2.RouterGenerateRequest]:
        self.check_common()
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of must equal n (best_of sampling is not supported)")
        params = self.sampling(self.max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None:
            params.prompt_logprobs = self.logprobs  # the echoed prompt shows its logprobs
        requests = []
        for prompt in self.prompts():
            request = _router_request(self, params)
            if isinstance(prompt, str):
                if not prompt:
                    raise ValueError("prompt must not be empty")
                request.prompt = prompt
            else:
                if not prompt:
                    raise ValueError("prompt must not be empty")
                if any(t < 0 for t in prompt):
                    raise ValueError("prompt token ids must be non-negative")
                request.prompt_token_ids.ids.extend(prompt)
            requests.append(request)
        return requests


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(
                    f"messages[{index}].content: only text parts are supported, "
                    f"got type {part.get('type')!r}"
                )
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def to_router_requests(self) -> list[router_pb2.RouterGenerateRequest]:
        self.check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        k = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens or self.max_tokens
        request = _router_request(self, self.sampling(max_tokens, k))
        for index, message in enumerate(self.messages):
            request.messages.messages.add(role=message.role, content=message.text(index))
        return [request]


def _router_request(
    body: _SamplingBody, params: common_pb2.SamplingParams
) -> router_pb2.RouterGenerateRequest:
    return router_pb2.RouterGenerateRequest(
        sampling_params=params,
        model=body.model or "",
        priority=body.priority,
        request_id=body.request_id or "",
    )


def _set_if(params: common_pb2.SamplingParams, name: str, value: object) -> None:
    if value is not None:
        setattr(params, name, value)
