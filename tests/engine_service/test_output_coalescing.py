"""Outputs waiting behind one another leave as one (engine.service.engine_state.coalesce)."""

from __future__ import annotations

import asyncio

from engine.logprobs import Logprob, TokenLogprobs
from engine.service.engine_state import GenerateOutput, coalesce


def _lp(token_id: int) -> TokenLogprobs:
    return TokenLogprobs(Logprob(token_id, -0.5, 1))


def test_then_concatenates_tokens_and_logprobs_and_keeps_the_first_prompt_logprobs() -> None:
    first = GenerateOutput("r", [1], False, num_output_tokens=1, logprobs=[_lp(1)],
                           prompt_logprobs=[_lp(9)])
    last = GenerateOutput("r", [2, 3], True, finish_reason="length", num_prompt_tokens=4,
                          num_output_tokens=3, num_cached_tokens=2, logprobs=[_lp(2), _lp(3)])
    merged = first.then(last)
    assert merged.token_ids == [1, 2, 3]
    assert [lp.sampled.token_id for lp in merged.logprobs or []] == [1, 2, 3]
    assert merged.prompt_logprobs == [_lp(9)]
    assert (merged.finished, merged.finish_reason, merged.num_output_tokens,
            merged.num_prompt_tokens, merged.num_cached_tokens) == (True, "length", 3, 4, 2)


def test_then_without_logprobs_keeps_none() -> None:
    merged = GenerateOutput("r", [1], False).then(GenerateOutput("r", [2], False))
    assert merged.logprobs is None and merged.prompt_logprobs is None


def test_coalesce_takes_what_waits_and_stops_at_the_final_output() -> None:
    async def run() -> None:
        queue: asyncio.Queue[GenerateOutput | BaseException] = asyncio.Queue()
        for item in (GenerateOutput("r", [2], False), GenerateOutput("r", [3], True,
                                                                     finish_reason="stop")):
            queue.put_nowait(item)
        merged, held = coalesce(GenerateOutput("r", [1], False), queue)
        assert (merged.token_ids, merged.finished, held) == ([1, 2, 3], True, None)
        assert queue.empty()

    asyncio.run(run())


def test_coalesce_hands_back_an_exception_met_behind_the_outputs() -> None:
    async def run() -> None:
        queue: asyncio.Queue[GenerateOutput | BaseException] = asyncio.Queue()
        failure = RuntimeError("engine died")
        queue.put_nowait(GenerateOutput("r", [2], False))
        queue.put_nowait(failure)
        queue.put_nowait(GenerateOutput("r", [3], False))
        merged, held = coalesce(GenerateOutput("r", [1], False), queue)
        assert merged.token_ids == [1, 2] and held is failure
        assert queue.qsize() == 1

    asyncio.run(run())


def test_a_finished_output_takes_nothing_behind_it() -> None:
    async def run() -> None:
        queue: asyncio.Queue[GenerateOutput | BaseException] = asyncio.Queue()
        queue.put_nowait(GenerateOutput("r", [2], False))
        merged, held = coalesce(GenerateOutput("r", [1], True), queue)
        assert merged.token_ids == [1] and held is None and queue.qsize() == 1

    asyncio.run(run())
