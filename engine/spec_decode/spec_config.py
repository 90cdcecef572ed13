"""`speculative_config`: vLLM's JSON keys, parsed once at start-up into a frozen dataclass.

Accepted keys: method ("ngram" or "draft_model"; vLLM infers "draft_model" when only a model
is given), num_speculative_tokens (k >= 1, required), prompt_lookup_min / prompt_lookup_max
(ngram: the n-gram lengths tried, longest first; vLLM's defaults: both 5 when neither is
given, the other one's value when one is), model (draft_model: a Hugging Face-format
directory whose tokenizer and vocabulary match the target's) and disable_by_batch_size (no
speculation in a step that starts with at least this many running requests). Any other key,
or a value of the wrong type or range, raises ValueError naming it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
_KEYS = {
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "model",
    "disable_by_batch_size",
}
_DEFAULT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = _DEFAULT_LOOKUP
    prompt_lookup_max: int = _DEFAULT_LOOKUP
    model: str | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config method must be one of {', '.join(METHODS)}; "
                f"got {self.method!r}"
            )
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, 1)
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(
                f"speculative_config prompt_lookup_max ({self.prompt_lookup_max}) is smaller "
                f"than prompt_lookup_min ({self.prompt_lookup_min})"
            )
        if self.disable_by_batch_size is not None:
            _check_int("disable_by_batch_size", self.disable_by_batch_size, 1)
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config method draft_model needs a 'model' directory")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config method ngram takes no 'model'")


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(
            f"speculative_config {name} must be an integer >= {minimum}, got {value!r}"
        )


def parse_speculative_config(
    value: SpeculativeConfig | Mapping[str, Any] | str | None,
) -> SpeculativeConfig | None:
    """A SpeculativeConfig from a dict, a JSON object string, or one already parsed."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - _KEYS)
    if unknown:
        raise ValueError(
            f"speculative_config has unknown key(s) {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(sorted(_KEYS))}"
        )
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config needs num_speculative_tokens")
    method = value.get("method") or ("draft_model" if value.get("model") else None)
    if method is None:
        raise ValueError("speculative_config needs a method (ngram or draft_model)")
    given_min = value.get("prompt_lookup_min")
    given_max = value.get("prompt_lookup_max")
    # vLLM: both 5 when neither is given; one given stands for both.
    lookup_min = given_min if given_min is not None else given_max
    lookup_max = given_max if given_max is not None else given_min
    if lookup_min is None or lookup_max is None:
        lookup_min = lookup_max = _DEFAULT_LOOKUP
    return SpeculativeConfig(
        method=method,
        num_speculative_tokens=value["num_speculative_tokens"],
        prompt_lookup_min=lookup_min,
        prompt_lookup_max=lookup_max,
        model=value.get("model"),
        disable_by_batch_size=value.get("disable_by_batch_size"),
    )


def speculative_config_arg(text: str) -> SpeculativeConfig | None:
    """argparse type of --speculative-config: a bad value is a usage error naming it."""
    import argparse

    try:
        return parse_speculative_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
