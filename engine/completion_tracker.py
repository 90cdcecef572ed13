"""One sample of the offline API as it is generated: text, stop strings and logprobs.

Role: `LLM` feeds every engine update of a request to its `CompletionTracker`; when the
tracker reports a stop string, `LLM` stops the engine request (freeing its blocks); at the end
the tracker builds the `CompletionOutput`.

Invariants:
- Without stop strings the text is decode(output ids), taken once at the end: requests that
  need no stop-string matching pay no per-token detokenization.
- The EOS or stop token that ends generation stays in token_ids but not in the text, unless
  include_stop_str_in_output (vLLM).
- With stop strings the text is built by the shared output rules (`kvfleet.text.output_rules`:
  `SampleText` detokenizes incrementally, without prompt context so it adds up to
  decode(output ids), and `StopStringFilter` matches token by token once min_tokens tokens
  exist). On a match: finish_reason "stop", stop_reason the string, text ends before it
  (after it with include_stop_str_in_output), token ids and logprobs are those generated up
  to the token completing it, even inside a several-token update (speculative decoding). A
  match on the request's last token wins over finish_reason "length" (vLLM).
- logprobs: one dict per token, the sampled token first (with its own rank), then the top-k
  not already in it; cumulative_logprob sums the sampled logprobs. Both None unless asked.
- prompt logprobs: kept from the request's first update (the only one carrying them) and
  shaped the same way, the prompt token in place of the sampled one; the first prompt token's
  entry stays None. None unless asked.
"""

from __future__ import annotations

import dataclasses

from engine.core.request import Request, RequestStatus
from engine.core.scheduler_output import RequestUpdate
from engine.logprobs import Logprob, TokenLogprobs
from engine.outputs import CompletionOutput
from kvfleet.text.incremental import Decoder
from kvfleet.text.output_rules import SampleText, StopStringFilter, text_token_ids
from kvfleet.text.stop_strings import StopStringMatcher


class CompletionTracker:
    def __init__(self, request: Request, tokenizer: Decoder) -> None:
        self.request = request
        self._tokenizer = tokenizer
        params = request.sampling_params
        self._logprobs: list[TokenLogprobs] | None = None if params.logprobs is None else []
        self._prompt_logprobs: list[TokenLogprobs | None] | None = None
        # Only with stop strings is the text built as tokens arrive (else decoded at the end).
        self._sample_text: SampleText | None = None
        self._filter: StopStringFilter | None = None
        if params.stop:
            self._sample_text = SampleText(
                tokenizer,
                skip_special_tokens=params.skip_special_tokens,
                include_stop_str_in_output=params.include_stop_str_in_output,
                split_by_token=True,
            )
            matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output)
            self._filter = StopStringFilter(matcher, params.min_tokens)
        self._text: list[str] = []
        self.stop_string: str | None = None
        # Output tokens when a stop string matched (tokens after it in the same update are
        # not part of the output).
        self._num_output_at_stop: int | None = None
        self.finished = False
        self._token_texts: dict[int, str] = {}

    def on_update(self, update: RequestUpdate) -> str | None:
        """Record one engine update; returns the stop string if this update completed one."""
        if self.finished:
            return None
        if self._logprobs is not None and update.new_logprobs is not None:
            self._logprobs.extend(update.new_logprobs)
        if update.prompt_logprobs is not None:
            self._prompt_logprobs = update.prompt_logprobs
        self.finished = update.finished
        if self._sample_text is not None and self._filter is not None:
            delta = self._sample_text.add(
                update.new_token_ids, finished=update.finished, ends_on_stop_token=self._stopped
            )
            kept = self._filter.add(
                delta.text, delta.token_ends, len(update.new_token_ids), update.finished
            )
            self._text.append(kept.text)
            self.stop_string = self._filter.stop_string
            if self.stop_string is not None:
                self._num_output_at_stop = self._filter.num_tokens
                self.finished = True
        return self.stop_string

    @property
    def _stopped(self) -> bool:
        # An EOS or stop token ended generation (LLM sets this status for stop strings only
        # after this tracker reported one).
        return self.request.status == RequestStatus.FINISHED_STOPPED

    def to_output(self, index: int) -> CompletionOutput:
        request = self.request
        token_ids = list(request.output_token_ids[: self._num_output_at_stop])
        if self._sample_text is None:
            params = request.sampling_params
            text = self._tokenizer.decode(
                text_token_ids(token_ids, self._stopped, params.include_stop_str_in_output),
                skip_special_tokens=params.skip_special_tokens,
            )
        else:
            text = "".join(self._text)
        finish_reason = request.status.finish_reason
        stop_reason = request.stop_reason
        if self.stop_string is not None:
            finish_reason, stop_reason = "stop", self.stop_string
        logprobs, cumulative = self._logprob_dicts()
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=token_ids,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            logprobs=logprobs,
            cumulative_logprob=cumulative,
        )

    def prompt_logprob_dicts(self) -> list[dict[int, Logprob] | None] | None:
        """vLLM's RequestOutput.prompt_logprobs: None first, then one dict per prompt token."""
        if self._prompt_logprobs is None:
            return None
        return [None if token is None else self._dict(token) for token in self._prompt_logprobs]

    def _logprob_dicts(self) -> tuple[list[dict[int, Logprob]] | None, float | None]:
        if self._logprobs is None:
            return None, None
        kept = self._logprobs[: self._num_output_at_stop]
        dicts = [self._dict(token) for token in kept]
        return dicts, sum(token.sampled.logprob for token in kept)

    def _dict(self, token: TokenLogprobs) -> dict[int, Logprob]:
        # The scored token first (with its own rank), then the top-k not already in it (vLLM).
        entry = {token.sampled.token_id: self._decoded(token.sampled)}
        for alternative in token.top:
            if alternative.token_id not in entry:
                entry[alternative.token_id] = self._decoded(alternative)
        return entry

    def _decoded(self, logprob: Logprob) -> Logprob:
        return dataclasses.replace(logprob, decoded_token=self._token_text(logprob.token_id))

    def _token_text(self, token_id: int) -> str:
        # vLLM's decoded_token: the token decoded on its own, special tokens kept.
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text
