"""Incremental detokenization: token ids arrive one (or a few) at a time, text leaves in
pieces that never split a character.

Role: the text of generation streams, one implementation for all of them: the output
rules' `SampleText` (`kvfleet.text.output_rules`, behind the engine's Generate stream and
the offline API's stop strings) and tokenizer_svc's DetokenizeStream. Decoding each new token
on its own is wrong for byte-level BPE (a character's UTF-8 bytes can span tokens) and for
SentencePiece-style decoders (whether a token starts with a space depends on its left
neighbour). Decoding the whole sequence every step is right but O(n^2). This uses the
prefix-offset / read-offset technique of TGI and vLLM: decode only a window of recent tokens,

    prefix_text = decode(ids[prefix_offset:read_offset])   # already emitted
    new_text    = decode(ids[prefix_offset:])              # window + new tokens

and emit `new_text[len(prefix_text):]` once it no longer ends in U+FFFD (the replacement
character a truncated UTF-8 sequence decodes to); then the window slides forward.

Invariants (for token sequences whose full decode is valid text):
- every emitted delta is whole characters: none contains a U+FFFD that the full decode
  lacks;
- the concatenation of all deltas plus `flush()` equals `decode(all ids)` exactly (with
  prompt context: the text that the generated ids add after the prompt);
- each step decodes O(window) tokens, where the window is the tokens since the last emit
  plus the tokens of that emit.
Sequences that truly contain invalid UTF-8 still concatenate to the full decode; their
U+FFFD simply comes out later, at the next emit or at `flush()`. (One case stays ambiguous
by nature: a prompt that ends inside a character whose remaining bytes are generated.)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as left context (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET):
# enough for a decoder to see the word boundary before the first generated token.
PROMPT_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    """What the detokenizer needs from a tokenizer (kvfleet.text.tokenizer.Tokenizer fits)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Streams text for a growing list of token ids; one instance per generation stream.

    Not thread-safe (one stream, one owner).
    """

    def __init__(
        self,
        tokenizer: Decoder,
        skip_special_tokens: bool = True,
        prompt_token_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Only the prompt's tail matters as context; its text is never emitted.
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._ids: list[int] = context
        self._num_context_ids = len(context)
        # ids[prefix_offset:read_offset] decode to text already emitted (or to prompt text);
        # ids[read_offset:] are not emitted yet.
        self._prefix_offset = 0
        self._read_offset = len(context)

    @property
    def num_generated_tokens(self) -> int:
        """Ids added so far (prompt context excluded)."""
        return len(self._ids) - self._num_context_ids

    def add_tokens(self, token_ids: Iterable[int]) -> str:
        """Append ids; return the newly complete text (possibly empty, held back)."""
        self._ids.extend(token_ids)
        if len(self._ids) == self._read_offset:
            return ""
        prefix_text, new_text = self._decode_window()
        # Hold back while the tail is an incomplete character, or nothing new decoded
        # (e.g. a skipped special token): the next tokens may change how it decodes.
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._emit(prefix_text, new_text)

    def flush(self) -> str:
        """Text still held back (the stream ended); may contain U+FFFD if the ids do."""
        if len(self._ids) == self._read_offset:
            return ""
        prefix_text, new_text = self._decode_window()
        if len(new_text) <= len(prefix_text):
            return ""
        return self._emit(prefix_text, new_text)

    def _decode_window(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        skip = self._skip_special_tokens
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], skip)
        new_text = decode(self._ids[self._prefix_offset :], skip)
        return prefix_text, new_text

    def _emit(self, prefix_text: str, new_text: str) -> str:
        # The emitted tokens become the next window's left context.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]
