"""SmolLM2-135M-Instruct (the default model): our model and tokenizer against transformers.

Uses the converted directory from `prepare_default_model()` (converted on first use, then
cached). Float32 logits must match transformers' for chat and plain prompts, through both a
full prefill and decode steps; the tokenizer must equal AutoTokenizer on encode, decode and
the chat template; and greedy decoding must answer a simple question sensibly, which
catches a conversion that is numerically consistent but wrong.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from engine.attention import AttentionMetadata, DecodeBatch, PrefillSegment
from engine.models import LlamaForCausalLM, ModelConfig, load_model
from engine.models.default_model import MARKER_FILE, default_model_dir, prepare_default_model
from kvfleet.text.tokenizer import Tokenizer, load_generation_eos_ids

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
]
PLAIN_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "In 2024, 1,234 people paid $56.78 each — über café naïve 東京 🙂.",
    "<|im_start|>user\nHi<|im_end|>\n<|endoftext|>",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_dir: Path) -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def ours(smollm2_dir: Path) -> tuple[LlamaForCausalLM, ModelConfig]:
    return load_model(smollm2_dir, torch.float32)


@pytest.fixture(scope="module")
def hf_model(smollm2_dir: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)


class PagedRun:
    """One sequence through our model: prefill, then decode steps, in contiguous slots."""

    def __init__(self, model: LlamaForCausalLM, config: ModelConfig, max_tokens: int) -> None:
        self.model = model
        num_blocks = max_tokens // BLOCK_SIZE + 1
        shape = (2, num_blocks, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
        self.caches = [torch.zeros(shape) for _ in range(config.num_hidden_layers)]
        self.length = 0

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> torch.Tensor:
        slots = torch.arange(len(ids))
        meta = AttentionMetadata(slots, (PrefillSegment(0, len(ids), 0, slots),), None, len(ids))
        self.length = len(ids)
        return self.model.compute_logits(self.model(torch.tensor(ids), slots, self.caches, meta))

    @torch.inference_mode()
    def decode(self, token_id: int) -> torch.Tensor:
        position = self.length
        context = position + 1
        # Blocks 0, 1, 2, ... in order, so slot == position as in prefill.
        decode = DecodeBatch(
            torch.tensor([0]),
            torch.arange(-(-context // BLOCK_SIZE), dtype=torch.int32).unsqueeze(0),
            torch.tensor([context], dtype=torch.int32),
            BLOCK_SIZE,
        )
        meta = AttentionMetadata(torch.tensor([position]), (), decode, 1)
        hidden = self.model(torch.tensor([token_id]), torch.tensor([position]), self.caches, meta)
        self.length = context
        return self.model.compute_logits(hidden)[0]


def chat_ids(tokenizer: Tokenizer, chat: list[dict[str, str]]) -> list[int]:
    # Templates emit their own special tokens; encode without adding more, as transformers does.
    return tokenizer.encode(tokenizer.apply_chat_template(chat), add_special_tokens=False)


def hf_logits(model: transformers.PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def assert_logits_match(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert (ours - ref).abs().max().item() < 1e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("prompt", range(len(CHATS) + 2))
def test_prefill_logits_match_transformers(prompt, tokenizer, ours, hf_model) -> None:
    model, config = ours
    if prompt < len(CHATS):
        ids = chat_ids(tokenizer, CHATS[prompt])
    else:
        ids = tokenizer.encode(PLAIN_TEXTS[prompt - len(CHATS)])
    logits = PagedRun(model, config, len(ids)).prefill(ids)
    assert_logits_match(logits, hf_logits(hf_model, ids))


def test_decode_steps_match_transformers(tokenizer, ours, hf_model) -> None:
    model, config = ours
    ids = chat_ids(tokenizer, CHATS[1])
    run = PagedRun(model, config, len(ids) + 4)
    next_id = int(run.prefill(ids)[-1].argmax())
    for _ in range(3):
        ids.append(next_id)
        logits = run.decode(next_id)
        assert_logits_match(logits[None], hf_logits(hf_model, ids)[-1:])
        next_id = int(logits.argmax())


def test_greedy_answer_is_sensible(tokenizer, ours, smollm2_dir) -> None:
    model, config = ours
    eos_ids = set(load_generation_eos_ids(smollm2_dir))
    ids = chat_ids(tokenizer, CHATS[0])
    run = PagedRun(model, config, len(ids) + 16)
    output = [int(run.prefill(ids)[-1].argmax())]
    while output[-1] not in eos_ids and len(output) < 16:
        output.append(int(run.decode(output[-1]).argmax()))
    assert "Paris" in tokenizer.decode(output)


def test_tokenizer_matches_transformers(tokenizer, hf_tokenizer) -> None:
    for text in PLAIN_TEXTS:
        for add_special in (True, False):
            ids = tokenizer.encode(text, add_special_tokens=add_special)
            assert ids == hf_tokenizer.encode(text, add_special_tokens=add_special)
            for skip in (True, False):
                assert tokenizer.decode(ids, skip) == hf_tokenizer.decode(
                    ids, skip_special_tokens=skip
                )
    assert tokenizer.vocab_size == len(hf_tokenizer) == 49152
    assert tokenizer.eos_token_id == hf_tokenizer.eos_token_id
    assert tokenizer.bos_token_id == hf_tokenizer.bos_token_id
    assert tokenizer.all_special_ids == hf_tokenizer.all_special_ids


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tokenizer, hf_tokenizer, add_generation_prompt) -> None:
    for chat in CHATS:
        expected = hf_tokenizer.apply_chat_template(
            chat, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        assert tokenizer.apply_chat_template(chat, add_generation_prompt) == expected
    # SmolLM2's template injects a default system prompt when the chat has none.
    assert "You are a helpful AI assistant named SmolLM" in tokenizer.apply_chat_template(CHATS[0])


def test_converted_directory_is_complete_and_cached(smollm2_dir: Path) -> None:
    config = ModelConfig.from_dir(smollm2_dir)
    assert (config.architecture, config.num_hidden_layers, config.vocab_size) == (
        "LlamaForCausalLM",
        30,
        49152,
    )
    assert config.tie_word_embeddings and config.dtype == "float32"
    assert "quantization_config" not in json.loads((smollm2_dir / "config.json").read_text())
    assert (smollm2_dir / MARKER_FILE).is_file()
    assert load_generation_eos_ids(smollm2_dir) == [2]
    assert prepare_default_model(smollm2_dir) == smollm2_dir  # idempotent, no reconversion


def test_default_model_dir_reads_env_when_called(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVFLEET_CACHE_DIR", str(tmp_path))
    assert default_model_dir() == tmp_path / "models" / "SmolLM2-135M-Instruct"
    monkeypatch.delenv("KVFLEET_CACHE_DIR")
    assert default_model_dir() == Path.home() / ".cache" / "kvfleet" / "models" / (
        "SmolLM2-135M-Instruct"
    )


def test_install_is_atomic_and_replaces_only_stale_copies(tmp_path: Path) -> None:
    from engine.models.default_model import CONVERSION_VERSION, _install

    def staged(name: str, version: int = CONVERSION_VERSION) -> Path:
        path = tmp_path / name
        path.mkdir()
        (path / MARKER_FILE).write_text(json.dumps({"conversion_version": version}))
        (path / "payload").write_text(name)
        return path

    target = tmp_path / "model"
    _install(staged("first"), target)
    assert (target / "payload").read_text() == "first"
    _install(staged("second"), target)  # complete copy present: kept
    assert (target / "payload").read_text() == "first"
    (target / MARKER_FILE).write_text(json.dumps({"conversion_version": -1}))
    _install(staged("third"), target)  # stale conversion: replaced
    assert (target / "payload").read_text() == "third"
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("user data")
    with pytest.raises(FileExistsError):
        _install(staged("fourth"), foreign)
