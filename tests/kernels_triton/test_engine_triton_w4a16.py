"""An AWQ and a GPTQ int4 checkpoint (tests/fixtures/int4_checkpoints.py) served through the
Triton backend (interpreted on CPU, compiled on a GPU): projections are W4A16Linear layers
running kernels/triton/w4a16.py, and greedy tokens equal transformers running the
checkpoint's dequantized dense weights in float32. Tiny shapes keep the interpreter fast."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.quant.w4a16_model import W4A16Linear, W4A16LlamaForCausalLM
from kernels.triton import runtime
from tests.fixtures.greedy import random_prompts, transformers_greedy
from tests.fixtures.int4_checkpoints import build_int4_checkpoint

HAS_CUDA = torch.cuda.is_available()


@pytest.mark.parametrize(("method", "group", "sym"), [("awq", 64, False), ("gptq", 32, True)])
def test_int4_checkpoint_through_triton_equals_transformers(tiny_model_dir, tmp_path, method,
                                                            group, sym):
    ckpt, reference = build_int4_checkpoint(tiny_model_dir, tmp_path / method, method, group,
                                            sym=sym, v1=sym)
    prompts = random_prompts(tiny_model_dir, [3, 17], seed=5)
    want = transformers_greedy(reference, prompts, new_tokens=5)
    llm = LLM(str(ckpt), dtype="float32", attention_backend="triton",
              device="cuda" if HAS_CUDA else "cpu", num_kv_blocks=32, enforce_eager=True)
    model = llm.engine.model
    assert isinstance(model, W4A16LlamaForCausalLM)
    assert isinstance(model.layers[0].mlp.gate_up_proj, W4A16Linear)
    before = runtime.launch_counts["w4a16_gemm"]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert runtime.launch_counts["w4a16_gemm"] > before
