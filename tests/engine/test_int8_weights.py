"""`quantization="int8"`: the tiny model's projections become Q8_0 QuantLinears, the weights
shrink, and the logits stay close to the dense model's (int8 with a scale per 32 weights)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.quant.gguf_model import QuantLlamaForCausalLM
from engine.quant.qlinear import QuantLinear


def test_int8_weights_serve_close_to_dense(tiny_model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10]}, {"prompt_token_ids": [40, 41, 2]}]
    dense = LLM(tiny_model_dir, dtype="float32").generate(prompts, params, use_tqdm=False)
    llm = LLM(tiny_model_dir, dtype="float32", quantization="int8")
    model = llm.engine.model
    assert isinstance(model, QuantLlamaForCausalLM)
    assert isinstance(model.layers[0].mlp.down_proj, QuantLinear)
    quant = llm.generate(prompts, params, use_tqdm=False)
    for d, q in zip(dense, quant, strict=True):
        first_d, first_q = d.outputs[0], q.outputs[0]
        assert first_q.token_ids[0] == first_d.token_ids[0]
        token = first_d.token_ids[0]
        # The random tiny model's logits are large (tens): int8's ~0.3% error moves a
        # logprob by about a tenth.
        assert first_q.logprobs[0][token].logprob == pytest.approx(
            first_d.logprobs[0][token].logprob, abs=0.25)
    reference = LLM(tiny_model_dir, dtype="float32").engine.model
    x = torch.randn(5, reference.config.hidden_size, generator=torch.Generator().manual_seed(0))
    dense_out = reference.layers[0].self_attn.qkv_proj.forward(x)
    quant_out = model.layers[0].self_attn.qkv_proj.forward(x)
    assert (quant_out - dense_out).norm() < 0.01 * dense_out.norm()


def test_quantization_flag_is_checked():
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model="x", quantization="int4")
