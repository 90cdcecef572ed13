"""The grammar backend interface: compile a constraint once, then one matcher per sample.

A backend (llguidance today; xgrammar would fit the same shape) compiles a
`StructuredOutputsParams` into a `CompiledGrammar`; each sample of each request gets its own
`GrammarMatcher` from it, which follows that sample's committed output tokens.

Invariants a matcher keeps:
- It has consumed exactly the request's committed output tokens (never drafts nor
  candidates), so the mask it fills is the set of tokens allowed next.
- Packed bitmasks are int32 rows, bit (t % 32) of word (t // 32) set when token t is
  allowed (llguidance's and xgrammar's layout).
- `is_terminated`: the grammar is complete and takes nothing more (or the matcher failed;
  `error` says why); its mask then allows only EOS, whose sampling finishes the request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kvfleet.contracts.structured_outputs import StructuredOutputsParams


class GrammarMatcher(Protocol):
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the packed mask of the tokens allowed next into `bitmask[row]` (CPU int32)."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by one committed token; False if the grammar refused it."""

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading `token_ids` the grammar would accept, without consuming them."""

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` accepted tokens."""

    @property
    def is_terminated(self) -> bool: ...

    @property
    def error(self) -> str: ...


class CompiledGrammar(Protocol):
    def new_matcher(self) -> GrammarMatcher:
        """A matcher at the grammar's start (cheap: no compilation)."""


class GrammarBackend(Protocol):
    # Width of the packed masks, in tokens (the model's vocabulary, logits' last dim).
    vocab_size: int

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Compile the constraint; InvalidFieldError naming the field if it cannot be."""

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` decodes to (special tokens as their text)."""

    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text`, special tokens parsed (a reasoning marker may be one)."""
