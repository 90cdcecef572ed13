"""The router's OpenAI HTTP API, driven by the official `openai` SDK against a real fleet.

Real processes (Redis, tokenizer, one engine, router) over real sockets; the tiny model,
whose text is gibberish but deterministic. Sync and async clients, streaming and not.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from kvfleet.fleet import Fleet
from kvfleet.text.tokenizer import Tokenizer
from tests.fixtures.fleets import FleetOptions
from tests.fixtures.router_fleet import API_KEYS, engine_load, wait_until

pytestmark = pytest.mark.timeout(240)

KEY = API_KEYS["tenant-0"]
PROMPT = "Once upon a time, in a small village by the sea, there lived"
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def fleet_options() -> FleetOptions:
    return {
        "num_engines": 1,
        "api_keys": True,
        "engine_args": ("--num-kv-blocks", "256", "--max-concurrent-requests", "4"),
    }


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> str:
    return tiny_model_dir.name


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


def test_health_and_models(fleet: Fleet, openai_client: OpenAI, model: str) -> None:
    with urllib.request.urlopen(f"{fleet.http_url}/health", timeout=10) as reply:
        assert reply.status == 200
    assert [m.id for m in openai_client.models.list().data] == [model]


def test_completion_usage_and_greedy_text(
    openai_client: OpenAI, model: str, tokenizer: Tokenizer
) -> None:
    result = openai_client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True},
    )
    choice = result.choices[0]
    assert result.object == "text_completion" and result.model == model
    assert choice.finish_reason == "length" and choice.text
    prompt_tokens = len(tokenizer.encode(PROMPT))
    assert result.usage is not None
    assert result.usage.prompt_tokens == prompt_tokens
    assert result.usage.completion_tokens == 12
    assert result.usage.total_tokens == prompt_tokens + 12
    again = openai_client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert again.choices[0].text == choice.text


def test_completion_streams_the_same_text_with_usage(openai_client: OpenAI, model: str) -> None:
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=24, temperature=1.0, seed=11,
                  extra_body={"ignore_eos": True})
    whole = openai_client.completions.create(**kwargs)  # type: ignore[call-overload]
    chunks = list(openai_client.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs  # type: ignore[call-overload]
    ))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 24
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and set(finals[:-1]) == {None}
    if "\ufffd" not in whole.choices[0].text:  # no delta ends inside a character
        assert not any("\ufffd" in c.choices[0].text for c in chunks if c.choices)


def test_chat_streaming_and_not(openai_client: OpenAI, model: str) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Tell me a story about a café ☕ in 東京."}]
    whole = openai_client.chat.completions.create(
        model=model, messages=messages, max_tokens=20, seed=3,  # type: ignore[arg-type]
    )
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    stream = openai_client.chat.completions.create(
        model=model, messages=messages, max_tokens=20, seed=3, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]


def test_same_seed_same_text_other_seed_different(openai_client: OpenAI, model: str) -> None:
    def sample(seed: int) -> str:
        result = openai_client.completions.create(model=model, prompt=PROMPT, max_tokens=16,
                                                  temperature=1.0, seed=seed,
                                                  extra_body={"ignore_eos": True})
        return result.choices[0].text

    assert sample(5) == sample(5)
    assert sample(5) != sample(6)


def test_n2_gives_two_reproducible_samples_sharing_the_prompt_blocks(
    openai_client: OpenAI, model: str, tokenizer: Tokenizer
) -> None:
    prompt = "The lighthouse keeper counted the ships, one by one, until the fog rolled in " * 2
    num_prompt = len(tokenizer.encode(prompt))
    assert num_prompt > 33
    kwargs = dict(model=model, prompt=prompt, max_tokens=10, temperature=1.0, seed=21, n=2,
                  extra_body={"ignore_eos": True})
    first = openai_client.completions.create(**kwargs)  # type: ignore[call-overload]
    assert [c.index for c in first.choices] == [0, 1]
    assert first.choices[0].text != first.choices[1].text
    assert first.usage.prompt_tokens == num_prompt  # counted once  # type: ignore[union-attr]
    assert first.usage.completion_tokens == 20  # type: ignore[union-attr]
    # The second sample reuses every full prompt block the first one computed.
    cached = first.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    assert cached == (num_prompt - 1) // 16 * 16
    second = openai_client.completions.create(**kwargs)  # type: ignore[call-overload]
    assert [c.text for c in second.choices] == [c.text for c in first.choices]


def test_n2_streams_each_choice_as_the_whole_response(openai_client: OpenAI, model: str) -> None:
    kwargs = dict(model=model, messages=[{"role": "user", "content": "Name two colours."}],
                  max_tokens=12, seed=8, n=2)
    whole = openai_client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    texts = {0: "", 1: ""}
    finishes: dict[int, str | None] = {}
    stream = openai_client.chat.completions.create(stream=True, **kwargs)  # type: ignore[call-overload]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert finishes == {c.index: c.finish_reason for c in whole.choices}


def test_completion_logprobs(openai_client: OpenAI, model: str) -> None:
    result = openai_client.completions.create(model=model, prompt=PROMPT, max_tokens=6,
                                              temperature=0, logprobs=3,
                                              extra_body={"ignore_eos": True})
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert len(logprobs.tokens) == 6
    assert "".join(logprobs.tokens) == result.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs or [],
                                 logprobs.top_logprobs or [], strict=True):
        assert value <= 0.0
        # Up to 3 alternatives plus the sampled token; byte pieces may share a string.
        assert 1 <= len(top) <= 4
        # Greedy: the sampled token is the most likely one.
        assert top[token] == pytest.approx(max(top.values()))


def test_chat_logprobs(openai_client: OpenAI, model: str) -> None:
    result = openai_client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=2,
    )
    content = result.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == result.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.bytes == list(entry.token.encode())


def test_stop_strings_cut_the_text(openai_client: OpenAI, model: str) -> None:
    base = openai_client.completions.create(
        model=model, prompt=PROMPT, max_tokens=24, temperature=0,
        extra_body={"ignore_eos": True}).choices[0].text
    stop = base[8:11]
    cut = base[: base.index(stop)]
    result = openai_client.completions.create(model=model, prompt=PROMPT, max_tokens=24,
                                              temperature=0, stop=[stop],
                                              extra_body={"ignore_eos": True})
    choice = result.choices[0]
    assert choice.text == cut and choice.finish_reason == "stop"
    assert choice.model_extra is not None and choice.model_extra["stop_reason"] == stop
    kept = openai_client.completions.create(
        model=model, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == cut + stop


def test_frequency_penalty_lowers_repeats(openai_client: OpenAI, model: str) -> None:
    def repeats(penalty: float) -> int:
        result = openai_client.completions.create(
            model=model, prompt="the the the the", max_tokens=40, temperature=0, logprobs=0,
            frequency_penalty=penalty, extra_body={"ignore_eos": True})
        tokens = result.choices[0].logprobs.tokens  # type: ignore[union-attr]
        assert tokens is not None and len(tokens) == 40
        return len(tokens) - len(set(tokens))

    assert repeats(2.0) < repeats(0.0)


def test_echo_with_logprobs_shows_the_prompt_tokens_first(
    openai_client: OpenAI, model: str
) -> None:
    result = openai_client.completions.create(
        model=model, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=1,
        extra_body={"ignore_eos": True})
    choice, usage = result.choices[0], result.usage
    assert choice.text.startswith(PROMPT) and usage is not None
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert len(logprobs.tokens) == usage.prompt_tokens + usage.completion_tokens
    values = logprobs.token_logprobs or []
    assert values[0] is None and (logprobs.top_logprobs or [])[0] is None
    # Each prompt token's own text (the first one's too): together they spell the prompt.
    assert "".join(logprobs.tokens[: usage.prompt_tokens]) == PROMPT
    assert all(v is not None and v <= 0.0 for v in values[1:])
    offsets = logprobs.text_offset or []
    assert offsets[0] == 0 and offsets == sorted(offsets)
    # The generated part is the same as without echo.
    plain = openai_client.completions.create(
        model=model, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1,
        extra_body={"ignore_eos": True})
    tail = plain.choices[0].logprobs
    assert tail is not None and tail.token_logprobs is not None
    # The echo request computes its whole prompt while the plain one may reuse cached blocks
    # and run in another batch shape: float32 reductions then add up in another order, which
    # moves logprobs by ~1e-6 absolute. 1e-4 is far below any difference between tokens.
    assert values[-3:] == pytest.approx(tail.token_logprobs, rel=0, abs=1e-4)


def test_echo_and_default_max_tokens(
    openai_client: OpenAI, model: str, tokenizer: Tokenizer
) -> None:
    echoed = openai_client.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith(PROMPT)
    # Chat without max_tokens may use the rest of the context.
    messages = [{"role": "user", "content": "Go on."}]
    result = openai_client.chat.completions.create(
        model=model, messages=messages,  # type: ignore[arg-type] temperature=0,
        extra_body={"ignore_eos": True})
    assert result.choices[0].finish_reason == "length"
    usage = result.usage
    assert usage is not None and usage.prompt_tokens + usage.completion_tokens == MAX_MODEL_LEN


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"max_tokens": 5000}, "max_model_len"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"extra_body": {"top_k": -5}}, "top_k"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_invalid_completion_is_400_naming_the_parameter(
    openai_client: OpenAI, model: str, kwargs: dict[str, object], needle: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.completions.create(
            model=model, prompt=PROMPT, **kwargs)  # type: ignore[call-overload]
    assert info.value.status_code == 400
    assert needle in str(info.value.message), info.value.message


def test_invalid_chat_is_400(openai_client: OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError, match="messages"):
        openai_client.chat.completions.create(model=model, messages=[])
    with pytest.raises(openai.BadRequestError, match="role"):
        openai_client.chat.completions.create(
            model=model, messages=[{"role": "robot", "content": "x"}],  # type: ignore[list-item]
        )
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        openai_client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], top_logprobs=2,
        )


def test_unknown_model_is_404_and_bad_key_401(fleet: Fleet, model: str) -> None:
    with OpenAI(base_url=f"{fleet.http_url}/v1", api_key=KEY, max_retries=0) as c, \
            pytest.raises(openai.NotFoundError, match="does not exist"):
        c.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    with OpenAI(base_url=f"{fleet.http_url}/v1", api_key="wrong", max_retries=0) as c, \
            pytest.raises(openai.AuthenticationError):
        c.completions.create(model=model, prompt=PROMPT, max_tokens=2)
    request = urllib.request.Request(f"{fleet.http_url}/v1/completions", data=b"{not json",
                                     headers={"Authorization": f"Bearer {KEY}",
                                              "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    assert info.value.code == 400
    assert "error" in json.loads(info.value.read())


def test_async_client_streams_concurrent_requests(fleet: Fleet, model: str) -> None:
    async def run() -> list[str]:
        async with AsyncOpenAI(base_url=f"{fleet.http_url}/v1", api_key=KEY,
                               max_retries=0, timeout=60) as c:
            async def one(seed: int) -> str:
                stream = await c.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "Hello there"}],
                    max_tokens=8, seed=seed, stream=True,
                )
                return "".join([ch.choices[0].delta.content or "" async for ch in stream
                                if ch.choices])

            async def whole(seed: int) -> str:
                result = await c.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "Hello there"}],
                    max_tokens=8, seed=seed,
                )
                return result.choices[0].message.content or ""

            streamed = await asyncio.gather(*(one(s) for s in range(3)))
            wholes = await asyncio.gather(*(whole(s) for s in range(3)))
            assert list(streamed) == list(wholes)
            return list(streamed)

    texts = asyncio.run(run())
    assert len(set(texts)) > 1


def test_full_engine_is_429_and_disconnects_free_the_engine(openai_client: OpenAI, model: str,
                                                           fleet: Fleet) -> None:
    # The engine takes 4 requests in flight (--max-concurrent-requests 4); a 5th is refused.
    # On a slow machine the 4 streams (400 tokens of the tiny model) may all end before the
    # 5th arrives: then that attempt proves nothing and the next one tries again.
    address = fleet.engines[0].address
    for _attempt in range(3):
        streams = [
            openai_client.completions.create(
                model=model, prompt=PROMPT, max_tokens=400, temperature=0, stream=True,
                extra_body={"ignore_eos": True})
            for _ in range(4)
        ]
        # A stream's headers can come back before its request reaches the engine; a first
        # chunk from each proves all 4 are in flight there before the 5th is sent.
        for stream in streams:
            next(iter(stream))
        try:
            fifth = openai_client.completions.create(model=model, prompt=PROMPT, max_tokens=2)
        except openai.RateLimitError as refused:
            assert refused.status_code == 429 and "capacity" in str(refused)
            break
        finally:
            for stream in streams:
                stream.close()  # the client goes away mid-stream
            wait_until(lambda: engine_load(address).num_running == 0, 20,
                       what="the disconnected streams' requests to be aborted")
        assert fifth.choices[0].finish_reason == "length"
    else:
        pytest.fail("the 5th request was never refused while 4 streams were open")


def test_sigterm_lets_an_open_http_stream_finish_then_exits_0(fleet: Fleet, model: str) -> None:
    # Runs last in this module: it stops the module's router.
    assert fleet.router is not None
    with OpenAI(base_url=f"{fleet.http_url}/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        stream = c.completions.create(model=model, prompt=PROMPT, max_tokens=300, temperature=0,
                                      stream=True, extra_body={"ignore_eos": True})
        first = next(iter(stream))
        assert first.choices
        fleet.router.terminate()  # SIGTERM while the stream is open
        rest = [chunk for chunk in stream if chunk.choices]
    assert rest[-1].choices[0].finish_reason == "length"
    assert fleet.router.process.wait(30) == 0, fleet.router.log_tail()
