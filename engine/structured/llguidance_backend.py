"""The llguidance grammar backend (engine.structured.backend's interface).

The llguidance tokenizer is built once from the engine's own tokenizer.json (added special
tokens included) over the model's vocabulary width, with the model's generation EOS ids, so
"the grammar is complete" allows exactly the tokens that end a generation. A compiled grammar
is a template matcher; each sample gets a deep copy of it (no recompilation).
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import llguidance.torch
import torch

from kvfleet.contracts.errors import InvalidFieldError
from kvfleet.contracts.structured_grammar import check_compiles
from kvfleet.contracts.structured_outputs import StructuredOutputsParams
from kvfleet.text.tokenizer import Tokenizer


class LLGuidanceMatcher:
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        return bool(self._matcher.consume_token(token_id))

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        return int(self._matcher.validate_tokens(list(token_ids)))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    @property
    def is_terminated(self) -> bool:
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str:
        return str(self._matcher.get_error())


class LLGuidanceGrammar:
    def __init__(self, template: llguidance.LLMatcher) -> None:
        self._template = template

    def new_matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._template.deep_copy())


class LLGuidanceBackend:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self._text_tokenizer = tokenizer
        eos = list(eos_token_ids) or (
            [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        )
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.to_json(), n_vocab=vocab_size, eos_token=eos or None
        )

    def compile(self, params: StructuredOutputsParams) -> LLGuidanceGrammar:
        grammar = check_compiles(params)
        # log_level 0: a grammar problem is reported through is_error, not printed.
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            field = f"structured_outputs.{params.kind}"
            raise InvalidFieldError(field, f"{field} is invalid: {template.get_error()}")
        return LLGuidanceGrammar(template)

    def token_bytes(self, token_id: int) -> bytes:
        return bytes(self.tokenizer.decode_bytes([token_id]))

    def tokenize(self, text: str) -> list[int]:
        return self._text_tokenizer.encode(text, False)
