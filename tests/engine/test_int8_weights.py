"""`quantization="int8"`: the tiny model's projections become Q8_0 QuantLinears, the weights
shrink, the logits stay close to the dense model's (int8 with a scale per 32 weights), and
LoRA adapters (kept in float32) run on the quantized base."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.lora.request import LoRARequest
from engine.models.gemm_select import fastest
from engine.models.linear import apply_linear, backend_supported, pack_weight
from engine.quant.dense_head import choose_head_backend
from engine.quant.gguf_model import QuantLlamaForCausalLM
from engine.quant.qlinear import QuantLinear

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10]}, {"prompt_token_ids": [40, 41, 2]}]


def _first(outs: list) -> list[tuple[int, float]]:
    return [(o.outputs[0].token_ids[0],
             o.outputs[0].logprobs[0][o.outputs[0].token_ids[0]].logprob) for o in outs]


def test_int8_weights_serve_close_to_dense(tiny_model_dir, tiny_lora_dirs):
    name = next(iter(tiny_lora_dirs))
    lora = LoRARequest(name, 1, str(tiny_lora_dirs[name]))
    dense = LLM(tiny_model_dir, dtype="float32", enable_lora=True)
    quant = LLM(tiny_model_dir, dtype="float32", quantization="int8", enable_lora=True)
    model = quant.engine.model
    assert isinstance(model, QuantLlamaForCausalLM)
    for request in (None, lora):
        want = _first(dense.generate(PROMPTS, PARAMS, use_tqdm=False, lora_request=request))
        got = _first(quant.generate(PROMPTS, PARAMS, use_tqdm=False, lora_request=request))
        # The random tiny model's logits are large (tens): int8's ~0.3% error moves a
        # logprob by about a tenth.
        for (token_w, lp_w), (token_g, lp_g) in zip(want, got, strict=True):
            assert token_g == token_w
            assert lp_g == pytest.approx(lp_w, abs=0.25)
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    dense_qkv = dense.engine.model.layers[0].self_attn.qkv_proj
    quant_qkv = model.layers[0].self_attn.qkv_proj
    dense_qkv = getattr(dense_qkv, "base", dense_qkv)  # under the LoRA wrapper
    quant_qkv = getattr(quant_qkv, "base", quant_qkv)
    assert isinstance(quant_qkv, QuantLinear)
    want_out, got_out = dense_qkv.forward(x), quant_qkv.forward(x)
    assert (got_out - want_out).norm() < 0.01 * want_out.norm()
    # Q8_0: 34 bytes per 32 weights, against 4 bytes a weight in float32.
    assert quant_qkv.weight_bytes * 32 == quant_qkv.in_features * quant_qkv.out_features * 34
    assert model.weight_bytes < dense.engine.model.config.num_parameters * 4


def test_dense_head_backend_is_requested_or_measured():
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(1))
    assert choose_head_backend(w, "dense") == "dense"
    assert choose_head_backend(w, "no-such-backend") == "dense"
    chosen = choose_head_backend(w, "auto")
    assert backend_supported(chosen, w.dtype)
    x = torch.randn(3, 64)
    got = apply_linear(x, w, None, chosen, pack_weight(w, chosen))
    torch.testing.assert_close(got, x @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not backend_supported("panel", torch.float32), reason="no CPU kernels")
def test_int8_model_packs_its_dense_head(tiny_model_dir):
    # The head stays dense; a named backend packs it as the dense model's head is packed.
    model = LLM(tiny_model_dir, dtype="float32", quantization="int8",
                linear_backend="panel").engine.model
    assert model.quant_head is None
    assert model._lm_head_backend == "panel" and model._packed_lm_head is not None


def test_quantization_flag_is_checked():
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model="x", quantization="int3")


def test_head_choice_counts_every_row_count_alike():
    # Summed ratios to the fastest at each row count: a backend 10% behind at 32 rows but 3x
    # ahead at 1 row wins, though its summed seconds are larger.
    times = {"a": [1.0, 11.0], "b": [3.0, 10.0]}
    assert fastest(times) == "a"
    assert fastest({"a": [2.0], "b": [1.0]}) == "b"
