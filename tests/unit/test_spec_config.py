"""speculative_config parsing: vLLM's keys and defaults, errors that name the problem."""

from __future__ import annotations

import pytest

from engine.spec_decode.spec_config import SpeculativeConfig, parse_speculative_config


def test_ngram_defaults_follow_vllm():
    config = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert config == SpeculativeConfig("ngram", 3, 5, 5)
    one = parse_speculative_config(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}
    )
    assert one is not None and (one.prompt_lookup_min, one.prompt_lookup_max) == (4, 4)


def test_draft_model_inferred_from_model():
    config = parse_speculative_config({"model": "/m", "num_speculative_tokens": 2})
    assert config is not None and config.method == "draft_model" and config.model == "/m"


def test_none_and_parsed_pass_through():
    assert parse_speculative_config(None) is None
    config = SpeculativeConfig("ngram", 1)
    assert parse_speculative_config(config) is config


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"num_speculative_tokens": 2}, "needs a method"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
        ({"method": "ngram", "num_speculative_tokens": "3"}, "num_speculative_tokens must be"),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown key(s) 'k'"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_max (2) is smaller",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a 'model'"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
            "disable_by_batch_size must be",
        ),
    ],
)
def test_bad_configs_name_the_problem(raw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_speculative_config(raw)


def test_engine_service_flag_reaches_the_config():
    from engine.service.server import build_parser, options_from_args

    args = build_parser().parse_args(
        [
            "--model",
            "/m",
            "--engine-id",
            "e",
            "--redis-url",
            "redis://127.0.0.1:6379/0",
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}',
        ]
    )
    config = options_from_args(args).engine.speculative_config
    assert config == SpeculativeConfig("ngram", 4, 3, 3)


def test_engine_service_flag_refuses_bad_json(capsys):
    from engine.service.server import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(
            [
                "--model",
                "/m",
                "--engine-id",
                "e",
                "--redis-url",
                "redis://x",
                "--speculative-config",
                '{"method": "ngram"}',
            ]
        )
    assert "needs num_speculative_tokens" in capsys.readouterr().err


def test_engine_config_parses_a_dict():
    from engine.config import EngineConfig

    config = EngineConfig(
        model="/m",
        speculative_config={
            "method": "ngram",  # type: ignore[arg-type]
            "num_speculative_tokens": 2,
        },
    )
    assert config.speculative_config == SpeculativeConfig("ngram", 2)
    with pytest.raises(ValueError, match="speculative_config must be"):
        EngineConfig(model="/m", speculative_config=3)  # type: ignore[arg-type]
