"""Parallel sampling (`n` > 1) as child requests, the way vLLM v1 fans a request out.

A request with n samples becomes n independent requests with n=1 over the same prompt. They
share the prompt's KV blocks through the prefix cache: a block becomes a hit once the step that
computes it has completed, and a sibling whose first uncached block is being computed in the
current step waits one step for it (`Scheduler._waits_for_computing_block`). A seeded parent
gives child i the seed `seed + i`, so every sample is reproducible and the samples differ from
each other.
Only child 0 keeps `prompt_logprobs`: the prompt's logprobs are the same for every sample, and
a request asking for them takes no prefix-cache hits, so the others would recompute the whole
prompt for nothing instead of sharing child 0's blocks.
"""

from __future__ import annotations

import dataclasses

from kvfleet.contracts.sampling_params import SamplingParams


def child_request_id(parent_id: str, index: int) -> str:
    return f"{index}_{parent_id}"


def child_seed(seed: int | None, index: int) -> int | None:
    """Sample `index`'s seed: unseeded stays unseeded (the router uses the same rule)."""
    return None if seed is None else seed + index


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    seed = child_seed(params.seed, index)
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    return dataclasses.replace(params, n=1, seed=seed, prompt_logprobs=prompt_logprobs)


def fan_out(parent_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """(request id, params) of each sample; a request with n=1 is its own only child."""
    if params.n == 1:
        return [(parent_id, params)]
    return [(child_request_id(parent_id, i), child_params(params, i)) for i in range(params.n)]
