"""The runner asks the model for the sampled rows only, so the last decoder layer runs its
o_proj and MLP on those (engine.models.llama `forward_rows`), and falls back to every row
when the step needs more: prompt logprobs. Tokens stay the reference's either way."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from kvfleet.contracts.sampling_params import SamplingParams

PROMPT_LEN = 40  # a chunked prefill below: chunks of 16, 16, 8
NEW_TOKENS = 6


def rows_seen(engine: LLMEngine) -> list[int]:
    """Rows the last layer's o_proj/MLP ran on, per forward pass through `forward_rows`."""
    layer = engine.model.layers[-1]
    original = layer.forward_rows
    seen: list[int] = []

    def spy(*args, **kwargs):
        seen.append(int(args[-1].numel()))
        return original(*args, **kwargs)

    layer.forward_rows = spy
    return seen


def generate(engine: LLMEngine, params: SamplingParams) -> list[int]:
    vocab = engine.model_config.vocab_size
    request = engine.add_request("r", [(13 * i + 7) % vocab for i in range(PROMPT_LEN)], params)
    while engine.has_unfinished_requests():
        engine.step()
    return list(request.output_token_ids)


@pytest.fixture
def engine(tiny_model_dir) -> LLMEngine:
    config = EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=32,
                          max_num_batched_tokens=16, enable_chunked_prefill=True)
    return LLMEngine(config)


def test_prefill_chunks_run_the_last_layer_on_the_sampled_row_only(engine, tiny_model_dir):
    seen = rows_seen(engine)
    tokens = generate(engine, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    # Two chunks that sample nothing, the last chunk's one row, then one row per decode step.
    assert seen == [0, 0, 1] + [1] * (NEW_TOKENS - 1)
    reference = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32",
                                       num_kv_blocks=32))
    reference.model.layers[-1].row_prunable = lambda: False  # every row, as before
    assert tokens == generate(reference, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))


def test_prompt_logprobs_keep_every_row(engine):
    seen = rows_seen(engine)
    generate(engine, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1))
    assert seen == [1]  # the prompt's chunks took the full forward; the decode step did not
