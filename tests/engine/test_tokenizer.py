"""`kvfleet.text.tokenizer.Tokenizer` against transformers' AutoTokenizer on the tiny tokenizer.

Encode (with and without special tokens), decode (skipping special tokens or not), the chat
template, special-token ids and vocab size must all equal transformers'. Variants check the
rules that are easy to get wrong: tokenizer.json's post-processor (not tokenizer_config's
add_bos_token) decides BOS insertion, chat_template.jinja wins over the config entry, and
special tokens named only in tokenizer_config.json are added. The template sandbox and the
generation eos lookup are checked too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jinja2
import pytest
import transformers
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import processors

from kvfleet.text.tokenizer import Tokenizer, load_generation_eos_ids
from tests.fixtures.tiny_model import CORPUS

TEXTS = [
    *CORPUS,
    "",
    " leading space",
    "trailing spaces   ",
    "<|im_start|>user\nHello<|im_end|>\n",
    "specials glued<|endoftext|>to text<|im_end|>",
    "never seen: Ωmega ∑ 🚀🚀 ﬁ",
]
CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
]


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, dirs_exist_ok=True)
    return dst


def edit_json(path: Path, **updates: Any) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    data.update(updates)
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def assert_same_as_transformers(model_dir: Path) -> Tokenizer:
    ours = Tokenizer.from_dir(model_dir)
    ref = transformers.AutoTokenizer.from_pretrained(model_dir)
    for text in TEXTS:
        for add_special in (True, False):
            ids = ours.encode(text, add_special_tokens=add_special)
            assert ids == ref.encode(text, add_special_tokens=add_special), text
            for skip in (True, False):
                expected = ref.decode(ids, skip_special_tokens=skip)
                assert ours.decode(ids, skip_special_tokens=skip) == expected, text
    assert ours.vocab_size == len(ref)
    assert ours.eos_token_id == ref.eos_token_id
    assert ours.bos_token_id == ref.bos_token_id
    assert ours.pad_token_id == ref.pad_token_id
    assert ours.all_special_ids == ref.all_special_ids
    return ours


def test_matches_transformers(tiny_model_dir: Path) -> None:
    ours = assert_same_as_transformers(tiny_model_dir)
    # The eos entry is an AddedToken dict in tokenizer_config.json.
    assert ours.eos_token_id == ours.token_to_id("<|im_end|>")


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tiny_model_dir: Path, add_generation_prompt: bool
) -> None:
    ours = Tokenizer.from_dir(tiny_model_dir)
    ref = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    for chat in CHATS:
        rendered = ours.apply_chat_template(chat, add_generation_prompt=add_generation_prompt)
        expected = ref.apply_chat_template(
            chat, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        assert rendered == expected
    assert rendered.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_decode_round_trips_text(tiny_model_dir: Path) -> None:
    ours = Tokenizer.from_dir(tiny_model_dir)
    for text in TEXTS:
        assert ours.decode(ours.encode(text, add_special_tokens=False), False) == text


def test_add_bos_token_flag_defers_to_tokenizer_json(tmp_path: Path, tiny_model_dir: Path) -> None:
    model_dir = copy_dir(tiny_model_dir, tmp_path / "tok")
    edit_json(model_dir / "tokenizer_config.json", bos_token="<|endoftext|>", add_bos_token=True)
    ours = assert_same_as_transformers(model_dir)
    assert ours.encode("hi")[0] != ours.bos_token_id

    backend = BackendTokenizer.from_file(str(model_dir / "tokenizer.json"))
    bos_id = backend.token_to_id("<|endoftext|>")
    backend.post_processor = processors.TemplateProcessing(
        single="<|endoftext|>:0 $A:0",
        pair="<|endoftext|>:0 $A:0 <|endoftext|>:1 $B:1",
        special_tokens=[("<|endoftext|>", bos_id)],
    )
    backend.save(str(model_dir / "tokenizer.json"))
    ours = assert_same_as_transformers(model_dir)
    assert ours.encode("hi")[0] == bos_id
    assert ours.encode("hi", add_special_tokens=False)[0] != bos_id


def test_special_tokens_only_in_config_are_added(tmp_path: Path, tiny_model_dir: Path) -> None:
    model_dir = copy_dir(tiny_model_dir, tmp_path / "tok")
    edit_json(
        model_dir / "tokenizer_config.json",
        unk_token="<unk>",
        additional_special_tokens=["<tool_call>"],
    )
    ours = assert_same_as_transformers(model_dir)
    assert ours.vocab_size == 514
    assert ours.encode("a<tool_call>b", add_special_tokens=False)[1] == 513


def test_chat_template_file_wins_over_config(tmp_path: Path, tiny_model_dir: Path) -> None:
    model_dir = copy_dir(tiny_model_dir, tmp_path / "tok")
    template = (
        "{% for m in messages %}[{{ m['role'] }}|{{ m['content'] }}]{% endfor %}{{ eos_token }}"
    )
    (model_dir / "chat_template.jinja").write_text(template, encoding="utf-8")
    ours = Tokenizer.from_dir(model_dir)
    ref = transformers.AutoTokenizer.from_pretrained(model_dir)
    rendered = ours.apply_chat_template(CHATS[0])
    assert rendered == "[user|Hello!]<|im_end|>"
    assert rendered == ref.apply_chat_template(CHATS[0], tokenize=False)


def test_template_helpers_and_sandbox(tiny_model_dir: Path) -> None:
    ours = Tokenizer.from_dir(tiny_model_dir)
    ours.chat_template = "{{ messages[0] | tojson }}"
    assert ours.apply_chat_template([{"role": "user", "content": "café <b>"}]) == (
        '{"role": "user", "content": "café <b>"}'
    )
    ours.chat_template = "{{ raise_exception('no system role') }}"
    with pytest.raises(jinja2.TemplateError, match="no system role"):
        ours.apply_chat_template(CHATS[0])
    ours.chat_template = "{% set _ = messages.append(1) %}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        ours.apply_chat_template(CHATS[0])
    ours.chat_template = "{% set ns = namespace(total=0) %}{% set ns._x = 1 %}{{ ns.total }}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        ours.apply_chat_template(CHATS[0])
    ours.chat_template = "{% set ns = namespace(n=0) %}{% for m in messages %}"
    ours.chat_template += "{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}"
    assert ours.apply_chat_template(CHATS[1]) == "4"


def test_generation_eos_ids_fallbacks(tmp_path: Path, tiny_model_dir: Path) -> None:
    model_dir = copy_dir(tiny_model_dir, tmp_path / "tok")
    im_end, endoftext = 2, 0
    assert load_generation_eos_ids(model_dir) == [im_end, endoftext]
    (model_dir / "generation_config.json").unlink()
    assert load_generation_eos_ids(model_dir) == [im_end]  # config.json's eos_token_id
    edit_json(model_dir / "config.json", eos_token_id=None)
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>"}), encoding="utf-8"
    )
    assert load_generation_eos_ids(model_dir) == [endoftext]
