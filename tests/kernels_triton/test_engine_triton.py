"""The whole engine through the Triton kernels (interpreted on CPU): greedy tokens identical to
transformers' `generate` in float32, in one mixed batch, with chunked prefill, under
preemption and with prefix hits.

Tiny shapes keep the interpreter fast: four prompts (1, 12, 17, 29 tokens: single-token,
mid-block, one-block-plus-one, two blocks growing into a third), 6 new tokens each, the dense
linear backend (no start-up GEMM timing), a 32-block cache. Launch counters prove that the
attention ran in the Triton kernels, not in a CPU fallback.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.llm_engine import LLMEngine
from kernels.triton import runtime
from tests.fixtures.greedy import random_prompts, transformers_greedy
from tests.fixtures.greedy import run_checked as run_to_completion

HAS_CUDA = torch.cuda.is_available()
NEW_TOKENS = 6
PROMPT_LENGTHS = [1, 12, 17, 29]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tiny_model_dir) -> list[list[int]]:
    return random_prompts(tiny_model_dir, PROMPT_LENGTHS, seed=99)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, prompts) -> list[list[int]]:
    return transformers_greedy(tiny_model_dir, prompts, NEW_TOKENS)


def triton_llm(model_dir, **engine_args) -> LLM:
    # A small cache: the interpreter copies every tensor argument (the whole layer cache
    # included) to the host and back on each launch. On a GPU machine (make gpu-check) the
    # same tests run compiled on CUDA, eagerly so that every launch is counted.
    engine_args.setdefault("num_kv_blocks", 32)
    engine_args.setdefault("enforce_eager", True)
    llm = LLM(
        str(model_dir), dtype="float32", attention_backend="triton",
        device="cuda" if HAS_CUDA else "cpu", linear_backend="dense", **engine_args,
    )
    assert llm.engine.runner.use_triton and not llm.engine.runner.use_decode_kernel
    return llm


def run_checked(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    """Runs to completion (block accounting checked every step); every step that did not
    replay a CUDA graph launched the unified kernel once per layer."""
    before = runtime.launch_counts["unified_attention"]
    outputs, steps = run_to_completion(engine, prompts, GREEDY)
    replayed = 0
    graphs = engine.runner.decode_graphs
    if graphs is not None and graphs.graphs:
        replayed = sum(graphs.runs.values())
    layers = engine.model_config.num_hidden_layers
    assert runtime.launch_counts["unified_attention"] - before == (steps - replayed) * layers
    return outputs


def test_triton_engine_chunked_prefill(tiny_model_dir, prompts, reference):
    llm = triton_llm(tiny_model_dir, max_num_batched_tokens=16)
    assert run_checked(llm.engine, prompts) == reference


def test_triton_engine_under_preemption(tiny_model_dir, prompts, reference):
    # The prompts take 6 blocks and grow to 8 (12 -> 18 and 29 -> 35 cross block ends): with 6
    # blocks, growing needs a preemption.
    llm = triton_llm(tiny_model_dir, num_kv_blocks=6, max_num_batched_tokens=32)
    assert run_checked(llm.engine, prompts) == reference
    assert llm.get_stats()["num_preemptions"] > 0


def test_triton_engine_one_batch_then_prefix_hits(tiny_model_dir, prompts, reference):
    """All prompts in one mixed batch; then again, reusing their cached full blocks."""
    llm = triton_llm(tiny_model_dir)
    batch = [{"prompt_token_ids": p} for p in prompts]
    first = llm.generate(batch, GREEDY, use_tqdm=False)
    second = llm.generate(batch, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == reference
    assert [o.outputs[0].token_ids for o in second] == reference
    expected_hits = [((len(p) - 1) // 16) * 16 for p in prompts]
    assert [o.num_cached_tokens for o in second] == expected_hits
    assert sum(expected_hits) > 0


@pytest.mark.parametrize(
    ("sizes", "engine_args", "expected_sizes"),
    [
        # Four decodes padded up to 8 rows (three padding rows that must change nothing).
        pytest.param((1, 2, 8), {}, {8}, id="padded-4-to-8"),
        # Three at a time fit exactly; the fourth decodes alone, then padded 1 -> 2 never
        # happens: sizes 1 and 3 both run.
        pytest.param((1, 3), {"max_num_seqs": 3}, {1, 3}, id="exact-sizes"),
    ],
)
def test_triton_engine_decode_graph_path(
    tiny_model_dir, prompts, reference, sizes, engine_args, expected_sizes
):
    """The CUDA-graph decode path (static buffers, padding): exact tokens. Run eagerly under
    the interpreter on CPU, captured and replayed on CUDA."""
    llm = triton_llm(tiny_model_dir, **engine_args)
    runner = llm.engine.runner
    max_blocks = -(-llm.engine.max_model_len // 16)
    runner.enable_decode_graphs(sizes, max_blocks, capture=HAS_CUDA)
    assert run_checked(llm.engine, prompts) == reference
    assert runner.decode_graphs is not None
    assert set(runner.decode_graphs.runs) == expected_sizes
