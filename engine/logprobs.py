"""Log-probabilities of sampled tokens (vLLM's `Logprob`), engine-side and framework-free.

Invariant: values are the model's raw distribution, log_softmax of the logits before
penalties, banned tokens, temperature or top-k/p (vLLM's default `raw_logprobs`), so they do
not depend on how a request is sampled. `rank` is 1-based: 1 + the number of tokens with a
strictly larger logprob.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Logprob:
    token_id: int
    logprob: float
    rank: int
    # The token's text, decode([token_id]) with special tokens kept; filled in by the offline
    # API (vLLM's field), None inside the engine, which has no tokenizer at hand.
    decoded_token: str | None = None


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token: its own logprob and the `logprobs` most likely alternatives."""

    sampled: Logprob
    top: tuple[Logprob, ...] = ()
