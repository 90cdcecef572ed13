"""Our Llama-family model against transformers, same weights, float32.

Every test runs one full prefill of ~40 tokens through the paged-attention path (or a decode
step after it) and compares logits with transformers' forward on the same directory:
max abs difference < 1e-4 and identical argmax. Variants cover Qwen2 (q/k/v bias, tied
embeddings), Mistral (sliding-window config), Llama with attention_bias, llama3 RoPE
scaling, both RoPE config spellings, and sharded checkpoints. Config parsing, dtype
resolution and weight-loading errors are checked here too. In bfloat16, the fused C++
elementwise kernels are held to the PyTorch ops bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from engine.attention import AttentionMetadata, DecodeBatch, PrefillSegment
from engine.models import LlamaForCausalLM, ModelConfig, load_model, resolve_dtype
from engine.models.loader import iter_safetensors, safetensors_files
from tests.fixtures.tiny_model import save_random_model, tiny_llama_config

BLOCK_SIZE = 16
PROMPT_LEN = 40
VOCAB = 512
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so the tiny head_dim's wavelengths fall in all three llama3 bands.
    "original_max_position_embeddings": 64,
}
TINY_SHAPE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


def prompt_ids(length: int = PROMPT_LEN, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (length,), generator=generator).tolist()


def empty_caches(config: ModelConfig, num_tokens: int, dtype: torch.dtype) -> list[torch.Tensor]:
    num_blocks = num_tokens // BLOCK_SIZE + 1
    shape = (2, num_blocks, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    return [torch.zeros(shape, dtype=dtype) for _ in range(config.num_hidden_layers)]


def prefill_meta(num_tokens: int) -> AttentionMetadata:
    slots = torch.arange(num_tokens)
    segment = PrefillSegment(0, num_tokens, 0, slots)
    return AttentionMetadata(
        slot_mapping=slots, prefills=(segment,), decode=None, num_tokens=num_tokens
    )


def decode_meta(position: int) -> AttentionMetadata:
    context = position + 1
    # Blocks 0, 1, 2, ... in order: slot == position, as in prefill_meta.
    num_blocks = -(-context // BLOCK_SIZE)
    decode = DecodeBatch(
        query_indices=torch.tensor([0]),
        block_tables=torch.arange(num_blocks, dtype=torch.int32).unsqueeze(0),
        context_lens=torch.tensor([context], dtype=torch.int32),
        block_size=BLOCK_SIZE,
    )
    return AttentionMetadata(
        slot_mapping=torch.tensor([position]), prefills=(), decode=decode, num_tokens=1
    )


def our_prefill(
    model: LlamaForCausalLM, ids: list[int], caches: list[torch.Tensor]
) -> torch.Tensor:
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), caches, prefill_meta(len(ids)))
        return model.compute_logits(hidden)


def hf_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def assert_logits_match(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == torch.float32
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def check_prefill_matches(model_dir: Path) -> None:
    model, config = load_model(model_dir, torch.float32)
    ids = prompt_ids()
    ours = our_prefill(model, ids, empty_caches(config, len(ids), torch.float32))
    assert_logits_match(ours, hf_logits(model_dir, ids))


def make_model_dir(path: Path, config: Any) -> Path:
    save_random_model(config, path)
    return path


# -- transformers parity -------------------------------------------------------------------


def test_tiny_llama_prefill_matches_transformers(tiny_model_dir: Path) -> None:
    check_prefill_matches(tiny_model_dir)


def test_decode_step_after_prefill_matches_transformers(tiny_model_dir: Path) -> None:
    model, config = load_model(tiny_model_dir, torch.float32)
    ids = prompt_ids()
    caches = empty_caches(config, len(ids) + 1, torch.float32)
    next_id = int(our_prefill(model, ids, caches)[-1].argmax())
    with torch.inference_mode():
        position = len(ids)
        hidden = model(
            torch.tensor([next_id]), torch.tensor([position]), caches, decode_meta(position)
        )
        ours = model.compute_logits(hidden)
    ref = hf_logits(tiny_model_dir, [*ids, next_id])[-1:]
    assert_logits_match(ours, ref)


@pytest.mark.parametrize("backend", ["panel", "dense"])
def test_kept_rows_equal_the_full_forwards_rows_and_write_the_same_cache(
    tiny_model_dir: Path, backend: str
) -> None:
    """`keep_rows` runs the last layer's o_proj and MLP on those rows only. Rows are
    independent in every op, so the kept rows' hidden states are the full forward's, and the
    KV cache (written for every row) is bit for bit the same. With the panel GEMM a row's
    value does not depend on how many rows the call has (exact equality); a dense (BLAS)
    GEMM may block 3 rows differently from 40, hence its ulp-level tolerance."""
    from kernels.cpu import load

    if backend == "panel" and not load():
        pytest.skip("needs the C++ CPU kernels")
    model, config = load_model(tiny_model_dir, torch.float32)
    model.prepack(backend)
    ids = prompt_ids()
    rows = torch.tensor([len(ids) - 1, 3, 17])
    full_caches = empty_caches(config, len(ids), torch.float32)
    kept_caches = empty_caches(config, len(ids), torch.float32)
    none_caches = empty_caches(config, len(ids), torch.float32)
    with torch.inference_mode():
        args = (torch.tensor(ids), torch.arange(len(ids)))
        full = model(*args, full_caches, prefill_meta(len(ids)))
        kept = model(*args, kept_caches, prefill_meta(len(ids)), keep_rows=rows)
        none = model(*args, none_caches, prefill_meta(len(ids)), keep_rows=rows[:0])
    assert kept.shape == (3, config.hidden_size) and none.shape == (0, config.hidden_size)
    if backend == "panel":
        assert torch.equal(kept, full[rows])
    else:
        torch.testing.assert_close(kept, full[rows], rtol=1e-6, atol=1e-6)
    for caches in (kept_caches, none_caches):
        assert all(torch.equal(a, b) for a, b in zip(full_caches, caches, strict=True))


@pytest.mark.parametrize(
    "variant",
    ["qwen2", "mistral", "llama_attention_bias", "llama3_rope"],
)
def test_variant_prefill_matches_transformers(tmp_path: Path, variant: str) -> None:
    make_model_dir(tmp_path, variant_config(variant))
    check_prefill_matches(tmp_path)


def variant_config(variant: str) -> Any:
    if variant == "qwen2":
        # Qwen2 always has q/k/v bias (randomized, so a dropped bias would show).
        return transformers.Qwen2Config(**TINY_SHAPE, tie_word_embeddings=True)
    if variant == "mistral":
        return transformers.MistralConfig(**TINY_SHAPE, sliding_window=4096)
    if variant == "llama_attention_bias":
        return tiny_llama_config(VOCAB, attention_bias=True)
    return tiny_llama_config(VOCAB, rope_parameters=dict(LLAMA3_ROPE))


def test_legacy_rope_spelling_matches_transformers(tmp_path: Path) -> None:
    """transformers 4 wrote `rope_theta` + `rope_scaling` at top level; both must load."""
    make_model_dir(tmp_path, tiny_llama_config(VOCAB, rope_parameters=dict(LLAMA3_ROPE)))
    config_path = tmp_path / "config.json"
    raw = json.loads(config_path.read_text())
    new_style = ModelConfig.from_dict(raw)
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    raw["rope_scaling"] = params
    config_path.write_text(json.dumps(raw))
    assert ModelConfig.from_dir(tmp_path) == new_style
    check_prefill_matches(tmp_path)


def test_sharded_checkpoint_loads(tmp_path: Path, tiny_model_dir: Path) -> None:
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(safetensors_files(tmp_path)) > 1
    check_prefill_matches(tmp_path)


def test_bfloat16_load_runs(tiny_model_dir: Path) -> None:
    model, config = load_model(tiny_model_dir, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert not any(p.requires_grad for p in model.parameters())
    ids = prompt_ids()
    logits = our_prefill(model, ids, empty_caches(config, len(ids), torch.bfloat16))
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    ref = hf_logits(tiny_model_dir, ids)
    # bf16 rounding moves logits; the fixture's wide margins keep most argmaxes in place.
    agreement = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agreement >= 0.8


def test_bfloat16_fused_kernels_leave_prefill_and_decode_logits_bit_identical(
    tiny_model_dir: Path,
) -> None:
    """The bf16 C++ elementwise kernels round where the PyTorch ops do, so switching them on
    changes no bit of a prefill's or the following decode step's logits."""
    from kernels.cpu import load

    assert load()
    model, config = load_model(tiny_model_dir, torch.bfloat16)
    ids = prompt_ids()
    results = []
    for fused in (False, True):
        model.use_fused_ops(fused)
        caches = empty_caches(config, len(ids) + 1, torch.bfloat16)
        prefill = our_prefill(model, ids, caches)
        position = len(ids)
        with torch.inference_mode():
            hidden = model(
                torch.tensor([int(prefill[-1].argmax())]), torch.tensor([position]), caches,
                decode_meta(position),
            )
        results.append((prefill, model.compute_logits(hidden), caches))
    (prefill_a, decode_a, caches_a), (prefill_b, decode_b, caches_b) = results
    assert torch.equal(prefill_a, prefill_b) and torch.equal(decode_a, decode_b)
    assert all(torch.equal(a, b) for a, b in zip(caches_a, caches_b, strict=True))


def test_fixture_logits_are_well_separated(tiny_model_dir: Path) -> None:
    """Greedy comparisons need top-1/top-2 margins far above float noise, and the model
    must not collapse into repeating one token."""
    ids = prompt_ids(8)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=48,
            min_new_tokens=48,
            do_sample=False,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    top2 = torch.stack([s[0].topk(2).values for s in out.scores])
    margins = top2[:, 0] - top2[:, 1]
    assert margins.median().item() > 0.1
    assert margins.min().item() > 1e-4
    assert len(set(out.sequences[0, len(ids) :].tolist())) > 10


# -- config, dtype and loading errors ------------------------------------------------------


def base_config_dict(**overrides: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], **TINY_SHAPE}
    raw.update(overrides)
    return raw


def test_config_defaults_and_spellings() -> None:
    raw = base_config_dict(num_key_value_heads=None, rope_theta=5e5, eos_token_id=[7, 9])
    config = ModelConfig.from_dict(raw)
    assert config.num_key_value_heads == 4
    assert config.head_dim == 16
    assert config.rope_theta == 5e5
    assert config.rope_scaling is None
    assert config.eos_token_ids == (7, 9)
    assert not config.qkv_bias
    assert config.max_model_len == 512
    new_style = base_config_dict(rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    assert ModelConfig.from_dict(new_style).rope_theta == 5e5


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0}}, "dynamic"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"mlp_bias": True}, "mlp_bias"),
    ],
)
def test_config_rejects_unsupported(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(base_config_dict(**overrides))


def test_sliding_window_resolution() -> None:
    qwen = {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 128, "max_window_layers": 1}
    assert ModelConfig.from_dict(base_config_dict(**qwen)).sliding_window is None
    sliding = ModelConfig.from_dict(base_config_dict(**qwen, use_sliding_window=True))
    assert sliding.sliding_window == 128
    assert sliding.max_model_len == 128
    assert sliding.qkv_bias
    mistral = base_config_dict(architectures=["MistralForCausalLM"])
    assert ModelConfig.from_dict(mistral).sliding_window == 4096
    assert ModelConfig.from_dict({**mistral, "sliding_window": None}).sliding_window is None


def test_resolve_dtype() -> None:
    config = ModelConfig.from_dict(base_config_dict(dtype="bfloat16"))
    assert resolve_dtype("auto", config) == torch.bfloat16
    assert resolve_dtype("float32", config) == torch.float32
    assert resolve_dtype("float16", config) == torch.bfloat16
    assert resolve_dtype("float16", config, device="cuda") == torch.float16
    assert resolve_dtype("auto", ModelConfig.from_dict(base_config_dict())) == torch.float32
    legacy = ModelConfig.from_dict(base_config_dict(torch_dtype="float16"))
    assert resolve_dtype("auto", legacy) == torch.bfloat16
    with pytest.raises(ValueError, match="float64"):
        resolve_dtype("float64", config)


def test_load_weights_rejects_missing_and_unknown(tiny_model_dir: Path) -> None:
    config = ModelConfig.from_dir(tiny_model_dir)
    weights = dict(iter_safetensors(safetensors_files(tiny_model_dir)))
    missing = {k: v for k, v in weights.items() if "layers.1.self_attn.k_proj" not in k}
    with pytest.raises(ValueError, match="k_proj|qkv_proj"):
        LlamaForCausalLM(config).load_weights(missing.items())
    unknown = {**weights, "model.layers.0.self_attn.rotary_extra.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match="rotary_extra"):
        LlamaForCausalLM(config).load_weights(unknown.items())
