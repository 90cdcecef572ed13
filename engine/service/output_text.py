"""The text of an engine's Generate stream: text deltas and logprob token strings.

Role: the engine holds the model's tokenizer, so it detokenizes its own output (as vLLM's
output processor does) and the router relays text without a per-token round trip to the
tokenizer service. `StreamText` is one Generate stream's incremental detokenizer
(`kvfleet.text.incremental`, the same one DetokenizeStream uses); `TokenTexts` decodes
single tokens for logprobs.

Invariants:
- The deltas of a stream concatenate to the text of its generated ids as they read after
  the prompt (the prompt's last tokens are the detokenizer's left context), honouring
  skip_special_tokens; no delta ends inside a character (held back until whole, flushed by
  the last output).
- The EOS or stop token that ends generation (finish_reason "stop") adds no text unless
  include_stop_str_in_output (vLLM); it stays in token_ids either way.
- With stop strings, an output of several tokens (speculative decoding) is detokenized one
  token at a time, exactly as one-token outputs would be, and `TextDelta.token_ends` says
  where each token's text ends, so the router can end the output at the token that
  completes a stop string. Without stop strings it is one call, and no ends.
- A token's logprob string is decode([id]) with special tokens kept (vLLM's decoded_token).
  It depends on the id alone, so `TokenTexts` caches it for the process (at most one entry
  per vocabulary id).
- Runs on the event loop: each step decodes a few tokens' window, cheaper than a thread hop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.service.engine_state import GenerateOutput
from kvfleet.contracts.sampling_params import SamplingParams
from kvfleet.text.incremental import Decoder, IncrementalDetokenizer


class TokenTexts:
    """decode([token_id]) with special tokens kept, cached per id."""

    def __init__(self, tokenizer: Decoder) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode(
                [token_id], skip_special_tokens=False
            )
        return text


@dataclass(frozen=True)
class TextDelta:
    """The text one output adds, and (several tokens, stop strings) where each token's ends."""

    text: str
    token_ends: list[int] = field(default_factory=list)


class StreamText:
    """One Generate stream: `delta(output)` is the text that output's tokens add."""

    def __init__(
        self, tokenizer: Decoder, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, params.skip_special_tokens, prompt_token_ids
        )
        self._keep_stop_token = params.include_stop_str_in_output
        self._per_token = bool(params.stop)

    def delta(self, output: GenerateOutput) -> TextDelta:
        ids = output.token_ids
        if output.finished and output.finish_reason == "stop" and not self._keep_stop_token:
            text_ids = ids[:-1]
        else:
            text_ids = ids
        if not self._per_token or len(ids) <= 1:
            return TextDelta(self._add(text_ids, output.finished))
        pieces: list[str] = []
        ends: list[int] = []
        end = 0
        for index in range(len(ids)):
            last = index == len(ids) - 1
            piece = self._add(text_ids[index : index + 1], output.finished and last)
            pieces.append(piece)
            end += len(piece)
            ends.append(end)
        return TextDelta("".join(pieces), ends)

    def _add(self, ids: Sequence[int], finished: bool) -> str:
        text = self._detokenizer.add_tokens(ids)
        if finished:
            text += self._detokenizer.flush()
        return text
