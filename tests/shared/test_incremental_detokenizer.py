"""IncrementalDetokenizer on real tokenizers (tiny byte-level BPE; SmolLM2 in the slow tier).

Properties checked: fed one token (or a random chunk) at a time, the deltas concatenate to
exactly `decode(all ids)`; no delta contains U+FFFD (a split character) when the full text
has none; only a small window is decoded per step; truly invalid byte sequences still
concatenate exactly.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from kvfleet.text.incremental import REPLACEMENT_CHAR, IncrementalDetokenizer
from kvfleet.text.tokenizer import Tokenizer

# Multi-byte UTF-8 of every length: accents (2 bytes), CJK (3), emoji and math letters (4),
# plus ZWJ sequences, skin tones and flags (several code points per visible glyph).
TEXTS = [
    "Hello, world! The quick brown fox.",
    "café naïve Zürich façade crème brûlée",
    "東京は日本の首都です。北京、上海と深圳。",
    "emoji 🙂🎉👍🏽 family 👨\u200d👩\u200d👧 flags 🇫🇷🇯🇵",
    "mixed: ½ ∑ ∞ — “quotes” 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ok",
    "Tabs\tand\nnewlines  double  spaces ",
    "🙂",
]


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


def stream(
    detokenizer: IncrementalDetokenizer, ids: Sequence[int], chunk_sizes: Sequence[int] = ()
) -> list[str]:
    """Feed ids in chunks (default: one at a time); deltas, the flush included."""
    deltas, position, sizes = [], 0, iter(chunk_sizes)
    while position < len(ids):
        size = next(sizes, 1)
        deltas.append(detokenizer.add_tokens(ids[position : position + size]))
        position += size
    deltas.append(detokenizer.flush())
    return deltas


def assert_streams_exactly(tokenizer: Tokenizer, text: str, chunk_sizes: Sequence[int] = ()):
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = stream(IncrementalDetokenizer(tokenizer), ids, chunk_sizes)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert not any(REPLACEMENT_CHAR in d for d in deltas), deltas
    return ids, deltas


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_concatenates_to_full_decode(tiny_tokenizer, text):
    ids, deltas = assert_streams_exactly(tiny_tokenizer, text)
    if any(ord(ch) > 0x7F for ch in text):
        # The tiny vocabulary splits these characters over several tokens, so some
        # characters really were held back (otherwise this test would prove nothing).
        assert "" in deltas[:-1]


@pytest.mark.parametrize("seed", range(5))
def test_random_chunks_concatenate_to_full_decode(tiny_tokenizer, seed):
    rng = random.Random(seed)
    text = " ".join(TEXTS)
    assert_streams_exactly(tiny_tokenizer, text, [rng.randint(1, 4) for _ in range(1000)])


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_follow_skip_flag(tiny_tokenizer, skip_special_tokens):
    ids = tiny_tokenizer.encode("<|im_start|>user\nhé 🙂 東京<|im_end|>\n", False)
    assert tiny_tokenizer.token_to_id("<|im_end|>") in ids
    detokenizer = IncrementalDetokenizer(tiny_tokenizer, skip_special_tokens)
    deltas = stream(detokenizer, ids)
    assert "".join(deltas) == tiny_tokenizer.decode(ids, skip_special_tokens)
    assert ("<|im_end|>" in "".join(deltas)) is not skip_special_tokens
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_prompt_context_is_not_emitted(tiny_tokenizer):
    prompt_ids = tiny_tokenizer.encode("Le café ", False)
    generated_ids = tiny_tokenizer.encode("crème 🙂 brûlée", False)
    detokenizer = IncrementalDetokenizer(tiny_tokenizer, prompt_token_ids=prompt_ids)
    deltas = stream(detokenizer, generated_ids)
    assert "".join(deltas) == "crème 🙂 brûlée"
    assert detokenizer.num_generated_tokens == len(generated_ids)


def test_truncated_character_is_flushed_at_end(tiny_tokenizer):
    ids = tiny_tokenizer.encode("ok 🙂", False)[:-1]  # the emoji's last byte never comes
    detokenizer = IncrementalDetokenizer(tiny_tokenizer)
    deltas = [detokenizer.add_tokens([t]) for t in ids]
    assert "".join(deltas) == "ok "  # the partial character is held back...
    tail = detokenizer.flush()  # ...until the stream ends, then it is what decode gives
    assert "".join(deltas) + tail == tiny_tokenizer.decode(ids)
    assert tail.endswith(REPLACEMENT_CHAR)


@pytest.mark.parametrize("seed", range(20))
def test_arbitrary_ids_concatenate_to_full_decode(tiny_tokenizer, seed):
    # Random ids make invalid UTF-8 mid-stream; exactness must hold all the same.
    rng = random.Random(seed)
    ids = [rng.randrange(tiny_tokenizer.vocab_size) for _ in range(rng.randint(1, 40))]
    for skip in (True, False):
        deltas = stream(IncrementalDetokenizer(tiny_tokenizer, skip), ids)
        assert "".join(deltas) == tiny_tokenizer.decode(ids, skip)


class RecordingDecoder:
    """Wraps a tokenizer, recording how many ids each decode call received."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.window_sizes: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.window_sizes.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens)


def test_decodes_a_small_window_not_the_whole_sequence(tiny_tokenizer):
    text = " ".join(TEXTS * 5)
    ids = tiny_tokenizer.encode(text, False)
    recorder = RecordingDecoder(tiny_tokenizer)
    deltas = stream(IncrementalDetokenizer(recorder), ids)
    assert "".join(deltas) == text
    assert len(ids) > 500
    # A window spans the previous emit and the pending tokens: a couple of characters'
    # worth of byte tokens (4 bytes per emoji, ZWJ sequences), never the whole sequence.
    assert max(recorder.window_sizes) <= 16
    assert sum(recorder.window_sizes) < 12 * len(ids)


class SentencePieceStyle:
    """A Llama-2/Mistral-style tokenizer: Metaspace pre-tokenizer, BPE with byte fallback
    (<0xNN> tokens) and the decoder that strips the first token's leading space."""

    def __init__(self, tmp_path: Path) -> None:
        corpus = ["The quick brown fox jumps over the lazy dog.", "Hello world, café, 東京."]
        trained = BackendTokenizer(models.BPE(unk_token="<unk>"))
        trained.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        special = ["<unk>", "<s>", "</s>"]
        trainer = trainers.BpeTrainer(vocab_size=150, special_tokens=special, show_progress=False)
        trained.train_from_iterator(corpus * 4, trainer)
        trained.model.save(str(tmp_path))
        vocab = json.loads((tmp_path / "vocab.json").read_text(encoding="utf-8"))
        for byte in range(256):  # byte-fallback tokens, as SentencePiece vocabularies have
            vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
        merge_lines = (tmp_path / "merges.txt").read_text(encoding="utf-8").splitlines()
        pairs = [line.split() for line in merge_lines if line and line[0] != "#"]
        merges = [(left, right) for left, right in pairs]
        model = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True)
        self.backend = BackendTokenizer(model)
        self.backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        self.backend.decoder = decoders.Sequence(
            [
                decoders.Replace("\u2581", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
        self.backend.add_special_tokens(special)

    def encode(self, text: str) -> list[int]:
        return list(self.backend.encode(text).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))


@pytest.mark.parametrize("text", [*TEXTS, "  leading spaces", "</s> special"])
def test_sentencepiece_style_byte_fallback_and_leading_space(tmp_path, text):
    tokenizer = SentencePieceStyle(tmp_path)
    ids = tokenizer.encode(text)
    pieces = [tokenizer.backend.id_to_token(i) or "" for i in ids]
    assert any(p.startswith("<0x") for p in pieces) or text.isascii()  # byte fallback used
    for chunks in ([], [3, 1, 2] * 50):
        deltas = stream(IncrementalDetokenizer(tokenizer), ids, chunks)
        # Word boundaries come out right although each window starts mid-sentence.
        assert "".join(deltas) == tokenizer.decode(ids)
        assert not any(REPLACEMENT_CHAR in d for d in deltas)


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_one_token_at_a_time(smollm2_dir, text):
    tokenizer = Tokenizer.from_dir(smollm2_dir)
    assert_streams_exactly(tokenizer, text)
    assert_streams_exactly(tokenizer, text, [2, 3, 1] * 100)
