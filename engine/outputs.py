"""Results returned to callers, shaped like vLLM's RequestOutput / CompletionOutput.

A prompt's RequestOutput holds one CompletionOutput per sample (`n`), index 0..n-1. Logprobs
follow vLLM: one dict per generated token, keyed by token id, holding the sampled token (first)
and the top-k alternatives; None when the request did not ask for logprobs. Prompt logprobs
likewise: None for the first prompt token, then one dict per prompt token holding that token
and the top-k alternatives; None when the request did not ask for prompt_logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.logprobs import Logprob


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # 'stop' | 'length' | 'abort'
    # The stop token id (or string) that ended generation; None for EOS or length.
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    # Sum of the sampled tokens' logprobs; None when the request did not ask for logprobs.
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    # One entry per prompt token (the first is None); with n > 1, the first sample's.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
