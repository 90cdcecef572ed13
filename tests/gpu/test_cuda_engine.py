"""The engine on a CUDA GPU (run by `make gpu-check`; skipped where there is none).

- float32: greedy tokens equal transformers' `generate` on the same GPU, token for token, in
  one mixed batch, with chunked prefill, under preemption and with prefix hits, with decode
  steps replayed from CUDA graphs and with --enforce-eager.
- bfloat16 and float16: tokens agree with transformers in the same dtype on the same GPU;
  rounding differs between two half-precision implementations (kernel order, fused
  projections), so a greedy stream may part after a near-tie. The test requires every
  prompt's first token to agree and most of the tokens before the first divergence, and
  prints the figures for the report.
- KV sizing from gpu_memory_utilization, and its error when nothing is left.
- Seeded sampling gives the same tokens run to run.
"""

from __future__ import annotations

import gc

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.worker.gpu_memory import GpuMemoryError
from tests.fixtures.greedy import random_prompts, transformers_greedy
from tests.fixtures.greedy import run_checked as run_to_completion

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

NEW_TOKENS = 32
PROMPT_LENGTHS = [1, 2, 7, 16, 17, 33, 64, 100, 150, 200]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tiny_model_dir) -> list[list[int]]:
    return random_prompts(tiny_model_dir, PROMPT_LENGTHS, seed=1234)


def hf_greedy(model_dir, prompts, dtype) -> list[list[int]]:
    return transformers_greedy(model_dir, prompts, NEW_TOKENS, dtype, device="cuda")


@pytest.fixture(scope="module")
def reference(tiny_model_dir, prompts) -> list[list[int]]:
    return hf_greedy(tiny_model_dir, prompts, torch.float32)


def run_checked(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    return run_to_completion(engine, prompts, GREEDY)[0]


@pytest.mark.parametrize("eager", [False, True], ids=["cuda-graphs", "eager"])
@pytest.mark.parametrize(
    "engine_args",
    [
        pytest.param({}, id="one-batch"),
        pytest.param({"max_num_batched_tokens": 32}, id="chunked-32"),
        pytest.param({"num_kv_blocks": 24, "max_num_batched_tokens": 64}, id="preemption"),
    ],
)
def test_cuda_greedy_matches_transformers(tiny_model_dir, prompts, reference, engine_args, eager):
    engine_args = {"num_kv_blocks": 256, **engine_args}
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cuda", enforce_eager=eager,
              **engine_args)
    engine = llm.engine
    assert engine.device.type == "cuda" and engine.runner.kv_caches[0].is_cuda
    assert engine.runner.use_triton
    assert run_checked(engine, prompts) == reference
    graphs = engine.runner.decode_graphs
    if eager:
        assert graphs is None
    else:
        assert graphs is not None and graphs.graphs and sum(graphs.runs.values()) > 0
    if engine_args["num_kv_blocks"] < 256:
        assert llm.get_stats()["num_preemptions"] > 0


def test_cuda_prefix_hits(tiny_model_dir, prompts, reference):
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cuda", num_kv_blocks=256)
    batch = [{"prompt_token_ids": p} for p in prompts]
    first = llm.generate(batch, GREEDY, use_tqdm=False)
    second = llm.generate(batch, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == reference
    assert [o.outputs[0].token_ids for o in second] == reference
    assert [o.num_cached_tokens for o in second] == [((len(p) - 1) // 16) * 16 for p in prompts]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_half_precision_agrees_with_transformers(tiny_model_dir, prompts, dtype):
    want = hf_greedy(tiny_model_dir, prompts, getattr(torch, dtype))
    llm = LLM(str(tiny_model_dir), dtype=dtype, device="cuda", num_kv_blocks=256)
    assert llm.engine.runner.kv_caches[0].dtype == getattr(torch, dtype)
    got = run_checked(llm.engine, prompts)
    agree = []
    for g, w in zip(got, want, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), len(g))
        agree.append(same)
    fraction = sum(agree) / (len(prompts) * NEW_TOKENS)
    print(f"{dtype} agreement: tokens before first divergence {agree}, fraction {fraction:.3f}")
    assert all(a >= 1 for a in agree)
    assert fraction >= 0.5


def kv_blocks_at(model_dir, utilization: float) -> tuple[int, int]:
    """(KV blocks, bytes per block) of an engine sized by `utilization`, freed afterwards so
    the next engine sees the GPU as this one found it."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", device="cuda",
                                    enforce_eager=True, gpu_memory_utilization=utilization))
    layout = engine.kv_layout
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return layout.num_blocks, layout.bytes_per_block


def test_kv_cache_sized_from_gpu_memory_utilization(tiny_model_dir):
    small, per_block = kv_blocks_at(tiny_model_dir, 0.2)
    large, _ = kv_blocks_at(tiny_model_dir, 0.4)
    assert 0 < small < large
    total = torch.cuda.get_device_properties(0).total_memory
    # The difference is the extra 20% of the GPU, to block rounding and allocator slack.
    assert abs((large - small) * per_block - 0.2 * total) <= 2 * per_block + 0.01 * total


def test_no_room_for_kv_cache_is_a_clear_error(tiny_model_dir):
    with pytest.raises(GpuMemoryError, match="no GPU memory left for the KV cache"):
        kv_blocks_at(tiny_model_dir, 0.001)


def test_cuda_seeded_sampling_repeats(tiny_model_dir, prompts):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts[:4]]
    runs = []
    for _ in range(2):
        llm = LLM(str(tiny_model_dir), dtype="float32", device="cuda", num_kv_blocks=256)
        runs.append([o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)])
    assert runs[0] == runs[1]


def test_kv_cache_that_does_not_fit_is_a_clear_error(tiny_model_dir):
    # 2^36 bytes of blocks for the tiny model: more than any GPU holds.
    config = EngineConfig(model=str(tiny_model_dir), dtype="float32", device="cuda",
                          enforce_eager=True, kv_cache_memory_bytes=2**36 * 4)
    with pytest.raises(GpuMemoryError, match="out of GPU memory allocating the KV cache"):
        LLMEngine(config)
