"""The text of an engine's Generate stream: text deltas and logprob token strings.

Role: the engine holds the model's tokenizer, so it detokenizes its own output (as vLLM's
output processor does) and the router relays text without a per-token round trip to the
tokenizer service. `StreamText` adapts one Generate stream to the shared output rules
(`kvfleet.text.output_rules.SampleText`: incremental detokenization with the prompt's tail
as context, the stop-token rule, per-token ends); `TokenTexts` decodes single tokens for
logprobs.

Invariants (the rules themselves are `output_rules`'):
- The deltas of a stream concatenate to the text of its generated ids as they read after
  the prompt, honouring skip_special_tokens; no delta ends inside a character.
- The EOS or stop token that ends generation (finish_reason "stop") adds no text unless
  include_stop_str_in_output (vLLM); it stays in token_ids either way.
- With stop strings, `TextDelta.token_ends` says where each token's text ends in an output
  of several tokens (speculative decoding), so the router can end the output at the token
  that completes a stop string. Without stop strings an output is one decode, and no ends:
  stop strings are the router's job, this only prepares for them.
- A token's logprob string is decode([id]) with special tokens kept (vLLM's decoded_token).
  It depends on the id alone, so `TokenTexts` caches it for the process (at most one entry
  per vocabulary id).
- Runs on the event loop: each step decodes a few tokens' window, cheaper than a thread hop.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.service.engine_state import GenerateOutput
from kvfleet.contracts.sampling_params import SamplingParams
from kvfleet.text.incremental import Decoder
from kvfleet.text.output_rules import SampleText, TextDelta


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


class StreamText:
    """One Generate stream: `delta(output)` is the text that output's tokens add."""

    def __init__(
        self, tokenizer: Decoder, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        self._text = SampleText(
            tokenizer,
            skip_special_tokens=params.skip_special_tokens,
            include_stop_str_in_output=params.include_stop_str_in_output,
            split_by_token=bool(params.stop),
            prompt_token_ids=prompt_token_ids,
        )

    def delta(self, output: GenerateOutput) -> TextDelta:
        # Stop strings are the router's, never applied here: finish_reason "stop" means an
        # EOS / stop token ended generation.
        return self._text.add(
            output.token_ids,
            finished=output.finished,
            ends_on_stop_token=output.finish_reason == "stop",
        )
