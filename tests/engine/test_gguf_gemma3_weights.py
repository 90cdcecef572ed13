"""A tiny gemma3 GGUF written by gguf-py (Q8_0, Q5_0, Q4_K and Q6_K tensors, as a Q4_K_M file
has) loads into our quantized Gemma 3 with every weight equal, bit for bit, to what
transformers' GGUF loader makes of the same file: names, the norms' `1 + w` offset, no q/k
row permutation. The full model against transformers token for token is
tests/slow/test_gemma3_gguf.py (it needs the 250 MB Gemma 3 270M package)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter

from engine.models.config import ModelConfig
from engine.quant import formats
from engine.quant.gguf_file import config_dict, metadata
from engine.quant.gguf_model import QuantGemmaForCausalLM, load_gguf_model
from engine.quant.qlinear import QuantLinear

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS, VOCAB = 256, 2, 1, 128, 512, 2, 64
_HALVES = {formats.Q4_K: (0, 2), formats.Q6_K: (208,)}


def _kquant_rows(qtype: int, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    nb, size = k // 256, formats.type_size(qtype)
    blocks = rng.integers(0, 256, size=(n, nb, size), dtype=np.uint8)
    for offset in _HALVES[qtype]:
        scale = rng.uniform(1e-4, 1e-3, size=(n, nb)).astype(np.float16)
        blocks[..., offset:offset + 2] = scale.view(np.uint8).reshape(n, nb, 2)
    return blocks.reshape(n, nb * size)


def _write(path: Path) -> None:
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "gemma3")
    for key, value in (("context_length", 512), ("embedding_length", HIDDEN),
                       ("block_count", LAYERS), ("feed_forward_length", FFN),
                       ("attention.head_count", HEADS), ("attention.head_count_kv", KV_HEADS),
                       ("attention.key_length", HEAD_DIM), ("attention.value_length", HEAD_DIM),
                       ("attention.sliding_window", 8), ("vocab_size", VOCAB)):
        writer.add_uint32(f"gemma3.{key}", value)
    writer.add_float32("gemma3.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32("gemma3.rope.freq_base", 1e6)

    def quantized(name: str, n: int, k: int, qtype: int) -> None:
        if qtype in _HALVES:
            data = _kquant_rows(qtype, n, k, rng)
        else:
            data = formats.quantize(torch.from_numpy(rng.standard_normal((n, k)) * 0.05),
                                    qtype).numpy()
        writer.add_tensor(name, data, raw_dtype=GGMLQuantizationType(qtype))

    def norm(name: str, size: int) -> None:
        writer.add_tensor(name, (1.0 + rng.standard_normal(size) * 0.1).astype(np.float32))

    quantized("token_embd.weight", VOCAB, HIDDEN, formats.Q8_0)
    norm("output_norm.weight", HIDDEN)
    for i in range(LAYERS):
        quantized(f"blk.{i}.attn_q.weight", HEADS * HEAD_DIM, HIDDEN, formats.Q5_0)
        quantized(f"blk.{i}.attn_k.weight", KV_HEADS * HEAD_DIM, HIDDEN, formats.Q5_0)
        quantized(f"blk.{i}.attn_v.weight", KV_HEADS * HEAD_DIM, HIDDEN, formats.Q8_0)
        quantized(f"blk.{i}.attn_output.weight", HIDDEN, HEADS * HEAD_DIM, formats.Q4_K)
        quantized(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN, formats.Q5_0)
        quantized(f"blk.{i}.ffn_up.weight", FFN, HIDDEN, formats.Q5_0)
        quantized(f"blk.{i}.ffn_down.weight", HIDDEN, FFN, formats.Q6_K)
        for name, size in (("attn_norm", HIDDEN), ("post_attention_norm", HIDDEN),
                           ("ffn_norm", HIDDEN), ("post_ffw_norm", HIDDEN),
                           ("attn_q_norm", HEAD_DIM), ("attn_k_norm", HEAD_DIM)):
            norm(f"blk.{i}.{name}.weight", size)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gemma3") / "tiny-gemma3.gguf"
    _write(path)
    return path


def test_weights_equal_transformers_gguf_loader(gguf):
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM

    reader = GGUFReader(str(gguf))
    config = ModelConfig.from_dict(config_dict(metadata(reader), {t.name for t in reader.tensors}))
    ours = load_gguf_model(gguf, config, torch.float32)
    assert isinstance(ours, QuantGemmaForCausalLM)
    theirs = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).state_dict()

    def same(got: torch.Tensor, name: str) -> None:
        assert torch.equal(got, theirs[f"model.{name}"]), name

    same(ours.embed_tokens.table.dequantize(), "embed_tokens.weight")
    same(ours.norm.weight, "norm.weight")
    for i, layer in enumerate(ours.layers):
        attn, mlp, p = layer.self_attn, layer.mlp, f"layers.{i}."
        assert isinstance(attn.qkv_proj, QuantLinear) and attn.qkv_proj.use_kernel
        qkv = attn.qkv_proj.dequantized_weight()
        same(qkv[:HEADS * HEAD_DIM], p + "self_attn.q_proj.weight")
        same(qkv[HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM], p + "self_attn.k_proj.weight")
        same(qkv[(HEADS + KV_HEADS) * HEAD_DIM:], p + "self_attn.v_proj.weight")
        same(attn.o_proj.dequantized_weight(), p + "self_attn.o_proj.weight")
        gate_up = mlp.gate_up_proj.dequantized_weight()
        same(gate_up[:FFN], p + "mlp.gate_proj.weight")
        same(gate_up[FFN:], p + "mlp.up_proj.weight")
        same(mlp.down_proj.dequantized_weight(), p + "mlp.down_proj.weight")
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            same(layer.get_submodule(norm).weight, p + norm + ".weight")
    kinds = {s.qtype for m in ours.modules() if isinstance(m, QuantLinear) for s in m.segments}
    assert kinds == {formats.Q5_0, formats.Q8_0, formats.Q4_K, formats.Q6_K}
