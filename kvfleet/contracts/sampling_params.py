"""Per-request sampling parameters (vLLM's names and defaults), validated on construction.

Validation raises `InvalidFieldError` (a ValueError) naming the offending parameter, both in its
message and as its `param`, so a bad request is refused before it reaches the scheduler and never
disturbs other requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvfleet.contracts.errors import InvalidFieldError
from kvfleet.contracts.structured_outputs import StructuredOutputsParams

_GREEDY_EPS = 1e-5
# vLLM's default --max-logprobs: how many alternatives a request may ask for per token.
MAX_LOGPROBS = 20
# OpenAI's limit on completions per prompt.
MAX_N = 128


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    # -1 disables top-k (vLLM's convention); 0 is rejected as ambiguous.
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    # None means "up to the remaining context" (max_model_len - prompt length).
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # OpenAI's additive penalties over the tokens generated so far, in [-2, 2].
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # CTRL-style multiplicative penalty over prompt and generated tokens; 1.0 disables.
    repetition_penalty: float = 1.0
    # None: no logprobs. k: the sampled token's logprob plus the k most likely (k may be 0).
    logprobs: int | None = None
    # The same for every prompt token after the first (whose entry is None). Such requests
    # compute their whole prompt: they take no prefix-cache hits (vLLM).
    prompt_logprobs: int | None = None
    # Stop strings, matched on the detokenized text (the LLM API or the router applies them).
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    # Grammar-constrained decoding (kvfleet.contracts.structured_outputs); a dict of its
    # fields is accepted and converted.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self._validate()
        self._validate_extensions()

    def _validate(self) -> None:
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise InvalidFieldError("n", f"n must be an integer in [1, {MAX_N}], got {self.n}")
        if not math.isfinite(self.temperature) or self.temperature < 0.0:
            raise InvalidFieldError(
                "temperature", f"temperature must be a non-negative number, got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidFieldError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k == 0 or self.top_k < -1:
            raise InvalidFieldError(
                "top_k", f"top_k must be -1 (disable) or at least 1, got {self.top_k}"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidFieldError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidFieldError(
                "max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}"
            )
        if self.min_tokens < 0:
            raise InvalidFieldError(
                "min_tokens", f"min_tokens must be non-negative, got {self.min_tokens}"
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidFieldError(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidFieldError(
                "stop_token_ids", f"stop_token_ids must be non-negative, got {self.stop_token_ids}"
            )

    def _validate_extensions(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or not -2.0 <= value <= 2.0:
                raise InvalidFieldError(name, f"{name} must be in [-2, 2], got {value}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0.0:
            raise InvalidFieldError(
                "repetition_penalty",
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidFieldError(
                "logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"
            )
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise InvalidFieldError(
                "prompt_logprobs",
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"
            )
        for index, value in enumerate(self.stop):
            if not isinstance(value, str) or not value:
                # `stop`, not `stop[i]`: the whole list is the body field at fault.
                raise InvalidFieldError(
                    "stop", f"stop[{index}] must be a non-empty string, got {value!r}"
                )

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS
