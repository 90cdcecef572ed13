"""A decode engine's prompt cap (--max-prefill-tokens-per-decode-step): prompts arriving
while others decode are chunked to the cap, greedy text still equals transformers'; the flag
defaults by role and refuses bad values by name; urgent steps stay off under it."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.scheduler_output import SchedulerOutput
from engine.core.urgent_step import unsupported_reason
from engine.service.server import build_parser, options_from_args
from tests.engine.test_exactness import GREEDY, prompts, reference  # noqa: F401

CAP = 4


def _record_steps(engine: LLMEngine) -> list[tuple[int, int]]:
    """Per step, as scheduled: (decode rows, prompt tokens)."""
    steps: list[tuple[int, int]] = []
    schedule = engine.scheduler.schedule

    def recording() -> SchedulerOutput:
        out = schedule()
        decoding = [s.request.num_output_tokens > 0 for s in out.scheduled]
        steps.append((sum(decoding), sum(s.num_new_tokens for s, d in
                                         zip(out.scheduled, decoding, strict=True) if not d)))
        return out

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    return steps


def test_prompts_beside_decodes_are_chunked_and_exact(tiny_model_dir, prompts,  # noqa: F811
                                                      reference):  # noqa: F811
    engine = LLM(tiny_model_dir, dtype="float32", num_kv_blocks=128,
                 max_prefill_tokens_per_decode_step=CAP).engine
    steps = _record_steps(engine)
    tokens: dict[str, list[int]] = {}

    def step() -> None:
        for update in engine.step():
            tokens.setdefault(update.request.request_id, []).extend(update.new_token_ids)
        engine.kv.check_integrity()

    for i in range(5):
        engine.add_request(f"r{i}", prompts[i], GREEDY)
    step()  # their prompts; from here on they decode
    for i in range(5, len(prompts)):
        engine.add_request(f"r{i}", prompts[i], GREEDY)
    while engine.has_unfinished_requests():
        step()
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == reference
    beside = [prompt for decodes, prompt in steps if decodes]
    assert max(beside) == CAP  # the later prompts were chunked beside the decodes
    assert max(prompt for decodes, prompt in steps if not decodes) > CAP  # alone: whole
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def _options(*extra: str) -> EngineConfig:
    args = build_parser().parse_args(
        ["--model", "m", "--engine-id", "e", "--redis-url", "redis://x", *extra])
    return options_from_args(args).engine


def test_flag_defaults_by_role_and_names_bad_values() -> None:
    assert _options("--role", "decode").max_prefill_tokens_per_decode_step == CAP
    assert _options("--role", "both").max_prefill_tokens_per_decode_step is None
    assert _options("--role", "prefill").max_prefill_tokens_per_decode_step is None
    assert _options("--role", "decode", "--max-prefill-tokens-per-decode-step",
                    "0").max_prefill_tokens_per_decode_step is None
    assert _options("--max-prefill-tokens-per-decode-step",
                    "16").max_prefill_tokens_per_decode_step == 16
    with pytest.raises(ValueError, match="--max-prefill-tokens-per-decode-step"):
        _options("--max-prefill-tokens-per-decode-step", "-1")
    with pytest.raises(ValueError, match="max_prefill_tokens_per_decode_step"):
        EngineConfig(model="m", max_prefill_tokens_per_decode_step=-2)


def test_urgent_steps_stay_off_under_the_cap() -> None:
    cpu = torch.device("cpu")
    assert unsupported_reason(EngineConfig(model="m"), cpu) is None
    reason = unsupported_reason(EngineConfig(model="m", max_prefill_tokens_per_decode_step=4), cpu)
    assert reason is not None and "max-prefill-tokens-per-decode-step" in reason
