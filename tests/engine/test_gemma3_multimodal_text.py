"""The text model of a multimodal Gemma 3 checkpoint (Gemma3ForConditionalGeneration, as the
4B-27B models ship): config from `text_config`, tensors under `language_model.`, the vision
tower and projector skipped; greedy tokens of text prompts equal transformers' (float32)."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from engine import LLM
from engine.models import ModelConfig
from tests.fixtures.family_exactness import GREEDY, NEW_TOKENS
from tests.fixtures.family_models import FAMILIES, SHAPE, _tokenizer
from tests.fixtures.greedy import run_checked
from tests.fixtures.tiny_model import randomize_weights, save_tokenizer

IMAGE_TOKENS = {"boi_token_index": 509, "eoi_token_index": 510, "image_token_index": 511}


def build(out_dir: Path) -> Path:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tokenizer = _tokenizer()
    save_tokenizer(tokenizer, out_dir)
    text = {**SHAPE, **FAMILIES["gemma3_text"], "vocab_size": 512, "pad_token_id": 0}
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 28, "patch_size": 14}
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          **IMAGE_TOKENS)
    model = Gemma3ForConditionalGeneration(config)
    randomize_weights(model)
    with torch.no_grad():  # as tests/fixtures/family_models.py: layers, not embeddings, decide
        embed = model.get_input_embeddings().weight
        embed.mul_(0.05 / embed.std())
    model.save_pretrained(str(out_dir))
    return out_dir


def test_text_of_multimodal_gemma3_matches_transformers(tmp_path: Path) -> None:
    from transformers import Gemma3ForConditionalGeneration

    model_dir = build(tmp_path)
    assert ModelConfig.from_dir(model_dir).architecture == "Gemma3ForCausalLM"
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 40, 70)]
    model = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    expected = []
    for ids in prompts:
        input_ids = torch.tensor([ids])
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
        expected.append(out[0, len(ids):].tolist())
    llm = LLM(str(model_dir), dtype="float32", linear_backend="dense",
              max_num_batched_tokens=16)
    got, _ = run_checked(llm.engine, prompts, GREEDY)
    assert got == expected
