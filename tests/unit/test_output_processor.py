"""CompletionTracker: stop strings, finish reasons and logprob dicts, on a one-letter tokenizer."""

from __future__ import annotations

from collections.abc import Sequence

from engine.completion_tracker import CompletionTracker
from engine.core.request import Request, RequestStatus
from engine.core.scheduler_output import RequestUpdate
from engine.logprobs import Logprob, TokenLogprobs
from kvfleet.contracts.sampling_params import SamplingParams


class LetterTokenizer:
    """Token i is the letter chr(ord('a') + i); nothing is special."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def letters(text: str) -> list[int]:
    return [ord(c) - ord("a") for c in text]


def run(text: str, max_tokens: int | None = None, **params) -> CompletionTracker:
    """Feed `text` one letter per update, as the engine would, until the tracker stops it."""
    max_tokens = max_tokens or len(text)
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params)
    request = Request("r", [0], sampling, max_tokens, block_size=4, arrival_seq=0)
    tracker = CompletionTracker(request, LetterTokenizer())
    for token in letters(text):
        request.append_output_token(token)
        finished = request.num_output_tokens == max_tokens
        if finished:
            request.status = RequestStatus.FINISHED_LENGTH
        logprobs = None
        if sampling.logprobs is not None:
            logprobs = [TokenLogprobs(Logprob(token, -1.0, 2), (Logprob(25, -0.5, 1),))]
        if tracker.on_update(RequestUpdate(request, [token], finished, logprobs)) is not None:
            request.status = RequestStatus.FINISHED_STOPPED  # what LLM's stop_request does
            break
    return tracker


def test_without_stop_strings_text_is_the_full_decode():
    out = run("hello").to_output(0)
    assert (out.text, out.token_ids, out.finish_reason) == ("hello", letters("hello"), "length")
    assert out.logprobs is None and out.cumulative_logprob is None


def test_stop_string_ends_text_and_tokens_at_the_match():
    out = run("abcdefgh", stop=["de", "zz"]).to_output(3)
    assert (out.index, out.text, out.token_ids) == (3, "abc", letters("abcde"))
    assert (out.finish_reason, out.stop_reason) == ("stop", "de")


def test_include_stop_str_in_output_keeps_the_string():
    out = run("abcdefgh", stop=["de"], include_stop_str_in_output=True).to_output(0)
    assert out.text == "abcde"


def test_stop_string_on_the_last_token_wins_over_length():
    out = run("abcde", stop=["de"]).to_output(0)
    assert (out.text, out.finish_reason, out.stop_reason) == ("abc", "stop", "de")


def test_stop_string_is_checked_only_from_min_tokens():
    # The first "ab" completes at token 2 < min_tokens; the second one matches.
    out = run("abxxab", max_tokens=10, stop=["ab"], min_tokens=3).to_output(0)
    assert (out.text, out.token_ids) == ("abxx", letters("abxxab"))


def test_unmatched_stop_string_flushes_held_back_text():
    out = run("abcab", stop=["abd"]).to_output(0)
    assert (out.text, out.finish_reason, out.stop_reason) == ("abcab", "length", None)


def test_logprob_dicts_put_the_sampled_token_first():
    out = run("ab", logprobs=1).to_output(0)
    assert out.logprobs is not None
    assert [list(entry) for entry in out.logprobs] == [[0, 25], [1, 25]]
    first = out.logprobs[0]
    assert first[0] == Logprob(0, -1.0, 2, decoded_token="a")
    assert first[25] == Logprob(25, -0.5, 1, decoded_token="z")
    assert out.cumulative_logprob == -2.0
