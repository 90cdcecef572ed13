"""`quantization="int4"`: the tiny model's projections become Q4_1 QuantLinears (group-wise
4-bit, 32 weights a group with an fp16 scale and minimum), holding exactly gguf-py's Q4_1 of
the dense weights, served exactly (greedy equal to the dense model holding the dequantized Q4_1
weights), and a bad quantization value is refused naming the field."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.quant import formats
from engine.quant.gguf_model import QuantLlamaForCausalLM
from engine.quant.qlinear import QuantLinear
from tests.fixtures.family_models import build_family_dir

PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10]}, {"prompt_token_ids": [40, 41, 2]}]


_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _dequantized_copy(model_dir: Path, out_dir: Path) -> Path:
    """`model_dir` with every projection replaced by its Q4_1 weights as dequantized (float32)."""
    shutil.copytree(model_dir, out_dir)
    path = out_dir / "model.safetensors"
    tensors = load_file(str(path))
    for name, weight in tensors.items():
        if name.rsplit(".", 2)[-2] in _PROJECTIONS:
            raw = formats.quantize(weight.float(), formats.Q4_1)
            tensors[name] = formats.dequantize(raw, formats.Q4_1, weight.shape[1])
    save_file(tensors, str(path), metadata={"format": "pt"})
    return out_dir


def test_int4_serves_its_quantized_weights_exactly(tiny_model_dir, tmp_path):
    # int4 is lossy (the random tiny model's first tokens move), so the check is against the
    # dense model holding the very weights int4 holds: greedy equal token for token.
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reference = LLM(_dequantized_copy(tiny_model_dir, tmp_path / "dq"), dtype="float32")
    quant = LLM(tiny_model_dir, dtype="float32", quantization="int4")
    want = reference.generate(PROMPTS, params, use_tqdm=False)
    got = quant.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    model = quant.engine.model
    assert isinstance(model, QuantLlamaForCausalLM)
    dense_layer = LLM(tiny_model_dir, dtype="float32").engine.model.layers[0]
    for name in ("qkv_proj", "o_proj"):
        d, q = getattr(dense_layer.self_attn, name), getattr(model.layers[0].self_attn, name)
        assert isinstance(q, QuantLinear) and q.segments[0].qtype == formats.Q4_1
        # Held exactly as gguf-py's reference Q4_1 of the float32 weight (computed once).
        assert torch.equal(q.segments[0].raw, formats.quantize(d.weight.float(), formats.Q4_1))
        # Q4_1: 20 bytes per 32 weights, against 4 bytes a weight in float32.
        assert q.weight_bytes * 32 == q.in_features * q.out_features * 20
        x = torch.randn(5, q.in_features, generator=torch.Generator().manual_seed(0))
        want_out, got_out = d.forward(x), q.forward(x)
        # 4 bits in groups of 32: about 5% relative error on random weights.
        assert (got_out - want_out).norm() < 0.15 * want_out.norm()


def test_int4_is_a_quantization_value_and_unknown_ones_name_the_field():
    assert EngineConfig(model="x", quantization="int4").quantization == "int4"
    with pytest.raises(ValueError, match="quantization must be None or one of int8, int4"):
        EngineConfig(model="x", quantization="nf4")


@pytest.mark.parametrize("family", ["gemma2", "qwen3"])
def test_int4_on_other_families_serves_its_weights_exactly(tmp_path, family):
    # A Gemma stays a Gemma (its own forward: scaled embedding, soft-capping, four norms) when
    # its projections are re-stored; Qwen3's q/k norms sit between the projections.
    model_dir = build_family_dir(tmp_path / family, family)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    reference = LLM(str(_dequantized_copy(model_dir, tmp_path / "dq")), dtype="float32")
    quant = LLM(str(model_dir), dtype="float32", quantization="int4")
    assert isinstance(quant.engine.model, type(reference.engine.model))
    want = reference.generate(PROMPTS, params, use_tqdm=False)
    got = quant.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
