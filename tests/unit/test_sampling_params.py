"""SamplingParams: vLLM defaults, and every bad value refused with the parameter's name."""

import pytest

from kvfleet.contracts.sampling_params import SamplingParams


def test_defaults_match_vllm():
    params = SamplingParams()
    assert params.n == 1
    assert params.temperature == 1.0
    assert params.top_p == 1.0
    assert params.top_k == -1
    assert params.min_p == 0.0
    assert params.seed is None
    assert params.max_tokens == 16
    assert params.min_tokens == 0
    assert params.stop_token_ids == []
    assert params.ignore_eos is False
    assert params.skip_special_tokens is True
    assert params.greedy is False


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids"),
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"stop": ["ok", ""]}, "stop"),
    ],
)
def test_bad_value_raises_naming_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"temperature": 2.0},
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"top_k": -1},
        {"top_k": 1},
        {"top_k": 50},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"max_tokens": 1},
        {"max_tokens": None},
        {"min_tokens": 4, "max_tokens": 4},
        {"min_tokens": 100, "max_tokens": None},
        {"stop_token_ids": [0, 2]},
        {"seed": 0},
    ],
)
def test_good_values_accepted(kwargs):
    SamplingParams(**kwargs)


def test_greedy_below_epsilon():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=0.01).greedy


def test_stop_token_ids_none_becomes_empty_list_and_is_copied():
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    source = [5, 6]
    params = SamplingParams(stop_token_ids=source)
    source.append(7)
    assert params.stop_token_ids == [5, 6]
