"""Pre-quantized AWQ and GPTQ int4 checkpoints (tests/fixtures/int4_checkpoints.py packs the
tiny model from the formats' specifications): unpacking returns the packer's codes, zeros and
scales; the Q4_1 repack equals the checkpoint's (q - z) * s, exactly or by the predicted fp16
rounding of the zero term; served through `LLM`, greedy tokens equal transformers running the
dequantized dense weights in float32 (and through the engine service over gRPC); bad
quantization_configs are refused naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.config import ModelConfig
from engine.quant import formats
from engine.quant.gguf_model import QuantLlamaForCausalLM
from engine.quant.int4_repack import to_q4_1, zero_term_error
from engine.quant.int4_unpack import unpack_int4
from engine.quant.prequant_config import parse_prequant_config
from engine.quant.qlinear import QuantLinear
from kvfleet.v1 import engine_pb2_grpc
from tests.fixtures.engine_harness import (
    EngineHarness,
    engine_options,
    gen_request,
    run,
    tokens_of,
)
from tests.fixtures.greedy import random_prompts, transformers_greedy
from tests.fixtures.int4_checkpoints import (
    awq_config,
    awq_tensors,
    build_int4_checkpoint,
    gptq_config,
    gptq_tensors,
    quantize,
)

# (method, group size, symmetric, GPTQ's original z - 1 format)
CASES = [("awq", 64, False, False), ("gptq", 32, True, True), ("gptq", 64, False, False)]


def _weight(out: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(out, k, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize(("method", "group", "sym", "v1"), CASES)
def test_unpack_returns_the_packers_values_and_q4_1_its_dequantization(method, group, sym, v1):
    qz = quantize(_weight(48, 128, seed=group), group, sym)
    packed = awq_tensors(qz) if method == "awq" else gptq_tensors(qz, group, v1)
    config = parse_prequant_config(
        awq_config(group) if method == "awq" else gptq_config(group, sym, v1))
    w = unpack_int4("p", packed, config)
    assert torch.equal(w.q.long(), qz.q) and torch.equal(w.z.long(), qz.z)
    assert torch.equal(w.s, qz.s)
    reference = qz.dequantize(group)
    assert torch.equal(w.dequantize(), reference)
    raw = to_q4_1(w)
    got = formats.dequantize(raw.raw, formats.Q4_1, raw.k)
    # Q4_1's minimum is -z * s rounded to fp16: each weight differs by exactly that rounding.
    predicted = zero_term_error(w).repeat_interleave(group, 0).T
    assert torch.equal(got - reference, predicted)
    if sym:  # z = 8: -8 s is an fp16, so the repack is bit-exact
        assert torch.equal(got, reference)
    else:  # asymmetric: the rounding is real somewhere, and within |s| / 128
        assert predicted.abs().max() > 0
        bound = qz.s.float().abs().repeat_interleave(group, 0).T / 128
        assert bool((predicted.abs() <= bound).all())


@pytest.mark.parametrize(("method", "group", "sym", "v1"), CASES)
def test_served_greedy_equals_transformers_on_the_dequantized_weights(
        tiny_model_dir, tmp_path, method, group, sym, v1):
    ckpt, reference = build_int4_checkpoint(tiny_model_dir, tmp_path / method, method, group,
                                            sym=sym, v1=v1)
    prompts = random_prompts(tiny_model_dir, [5, 17, 33], seed=7)
    want = transformers_greedy(reference, prompts, new_tokens=10)
    llm = LLM(str(ckpt), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    model = llm.engine.model
    assert isinstance(model, QuantLlamaForCausalLM)
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear) and [s.qtype for s in qkv.segments] == [formats.Q4_1]
    # Kept 4-bit: 20 bytes per 32 weights.
    assert qkv.weight_bytes * 32 == qkv.in_features * qkv.out_features * 20


def test_quantization_option_must_match_the_checkpoint(tiny_model_dir, tmp_path):
    ckpt, _ = build_int4_checkpoint(tiny_model_dir, tmp_path / "awq", "awq", 64)
    with pytest.raises(ValueError, match="quantization='gptq' does not match"):
        LLM(str(ckpt), dtype="float32", quantization="gptq")
    with pytest.raises(ValueError, match="quantization='awq' does not match"):
        LLM(str(tiny_model_dir), dtype="float32", quantization="awq")


@pytest.mark.parametrize(("change", "field"), [
    ({"quant_method": "bitsandbytes"}, "quantization_config.quant_method"),
    ({"bits": 8}, "quantization_config.bits"),
    ({"group_size": 48}, "quantization_config.group_size"),
    ({"version": "gemv"}, "quantization_config.version"),
    ({"zero_point": False}, "quantization_config.zero_point"),
    ({"modules_to_not_convert": ["q_proj"]}, "quantization_config.modules_to_not_convert"),
])
def test_bad_awq_config_is_refused_naming_the_field(tiny_model_dir, change, field):
    raw = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    raw["quantization_config"] = {**awq_config(128), **change}
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize(("change", "field"), [
    ({"checkpoint_format": "marlin"}, "quantization_config.checkpoint_format"),
    ({"lm_head": True}, "quantization_config.lm_head"),
    ({"bits": 3}, "quantization_config.bits"),
])
def test_bad_gptq_config_is_refused_naming_the_field(change, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        parse_prequant_config({**gptq_config(128, True, True), **change})


def test_act_order_g_idx_is_refused_naming_it():
    qz = quantize(_weight(16, 64, seed=3), 32, True)
    tensors = gptq_tensors(qz, 32, v1=True)
    tensors["g_idx"] = tensors["g_idx"].flip(0)
    config = parse_prequant_config({**gptq_config(32, True, True), "desc_act": True})
    with pytest.raises(ValueError, match="g_idx.*desc_act"):
        unpack_int4("model.layers.0.mlp.up_proj", tensors, config)
    # The plain order under desc_act=true (what a checkpoint without reordering holds) loads.
    plain = gptq_tensors(qz, 32, v1=True)
    assert torch.equal(unpack_int4("p", plain, config).q.long(), qz.q)


def test_engine_over_grpc_serves_a_gptq_checkpoint(tiny_model_dir, tmp_path, redis_server):
    # The engine service (real gRPC over loopback, real Redis) on a GPTQ checkpoint: the
    # streamed tokens equal transformers on the dequantized weights.
    ckpt, reference = build_int4_checkpoint(tiny_model_dir, tmp_path / "gptq", "gptq", 32,
                                            sym=True, v1=True)
    prompt = random_prompts(tiny_model_dir, [21], seed=11)[0]
    want = transformers_greedy(reference, [prompt], new_tokens=8)[0]
    harness = EngineHarness(engine_options(ckpt, redis_server.url, "gptq-0")).start()
    try:
        with grpc.insecure_channel(harness.address) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            assert tokens_of(run(stub, gen_request("g-1", prompt, 8))) == want
    finally:
        harness.stop()
