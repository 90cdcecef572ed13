"""Text <-> token ids and chat templates, on the `tokenizers` library and jinja2 alone.

This is the engine's (and tokenizer_svc's) tokenizer; it deliberately avoids importing
transformers (slow import, large dependency) while producing the same results as
transformers 5's `AutoTokenizer` for tokenizer.json-based checkpoints:

- tokenizer.json is authoritative for normalisation, pre-tokenisation and post-processing
  (BOS/EOS insertion). transformers 5 likewise ignores tokenizer_config.json's
  `add_bos_token`/`add_eos_token` whenever tokenizer.json exists, so we do too: a checkpoint
  that prepends BOS says so in tokenizer.json's post_processor. (Model-specific transformers
  classes that rebuild the pipeline from vocab/merges, e.g. `LlamaTokenizer`, are not
  emulated.)
- Named special tokens from tokenizer_config.json (strings or AddedToken dicts) that are not
  yet added tokens are added as special tokens, as transformers does, which can grow
  `vocab_size`.
- Chat templates render in a sandboxed jinja2 environment configured like transformers'
  (trim_blocks, lstrip_blocks, loopcontrols, `raise_exception`, `tojson`, `strftime_now`,
  a `namespace` that refuses underscore attributes),
  with the named special tokens (`bos_token`, `eos_token`, ...) as variables.
- `split_special_tokens=True` encodes special-token strings as the plain text they spell
  (transformers' flag of that name; a second backend with `encode_special_tokens` set once at
  load, so no call mutates shared state); `encode_with_spans` and
  `encode_with_specials_at` let `kvfleet.text.chat_encoding` parse control tokens only where
  the chat template put them.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Encoding
from tokenizers import Tokenizer as BackendTokenizer

# transformers' SPECIAL_TOKENS_ATTRIBUTES, in its order (it defines `all_special_ids`' order).
NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class Tokenizer:
    """A loaded tokenizer; construct with `Tokenizer.from_dir`. encode/decode never mutate it."""

    def __init__(
        self,
        backend: BackendTokenizer,
        special_tokens: Mapping[str, str],
        extra_special_tokens: Sequence[str] = (),
        chat_template: str | None = None,
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        self._backend = backend
        # The same pipeline with special-token strings left as text (set once, here).
        self._text_backend = BackendTokenizer.from_str(backend.to_str())
        self._text_backend.encode_special_tokens = True
        self._special_ids = frozenset(
            i for i, t in backend.get_added_tokens_decoder().items() if t.special
        )
        self.special_tokens = dict(special_tokens)
        self.extra_special_tokens = list(extra_special_tokens)
        self.chat_template = chat_template
        self._clean_up_spaces = clean_up_tokenization_spaces

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        backend = BackendTokenizer.from_file(str(model_dir / "tokenizer.json"))
        # transformers resets these per call; encode must never truncate or pad.
        backend.no_truncation()
        backend.no_padding()
        config = _read_json(model_dir / "tokenizer_config.json")
        special: dict[str, AddedToken] = {}
        for attr in NAMED_SPECIAL_TOKENS:
            token = _as_added_token(config.get(attr))
            if token is not None:
                special[attr] = token
        extras = [
            t for t in map(_as_added_token, _extra_special_token_entries(config)) if t is not None
        ]
        _add_missing_special_tokens(backend, [*special.values(), *extras])
        return cls(
            backend,
            {attr: token.content for attr, token in special.items()},
            [t.content for t in extras],
            _load_chat_template(model_dir, config),
            bool(config.get("clean_up_tokenization_spaces", False)),
        )

    # -- ids -------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (transformers' `len(tokenizer)`)."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def to_json(self) -> str:
        """tokenizer.json as loaded, added special tokens included (grammar backends read it)."""
        return str(self._backend.to_str())

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def _special_id(self, attr: str) -> int | None:
        token = self.special_tokens.get(attr)
        return None if token is None else self._backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of the named then extra special tokens, deduplicated, as transformers lists them."""
        ids: list[int] = []
        for token in [*self.special_tokens.values(), *self.extra_special_tokens]:
            token_id = self._backend.token_to_id(token)
            if token_id is not None and token_id not in ids:
                ids.append(token_id)
        return ids

    # -- text ------------------------------------------------------------------------------

    def encode(
        self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False
    ) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds BOS/EOS as the post-processor says,
        `split_special_tokens` encodes `<|im_end|>` & co. as plain text, never as control
        tokens."""
        backend = self._text_backend if split_special_tokens else self._backend
        return list(backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_with_spans(
        self, text: str, add_special_tokens: bool = True
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode(text)`, and the character spans of `text` that became special tokens (in
        order; those the post-processor adds, e.g. BOS, span nothing and are left out)."""
        encoding = self._backend.encode(text, add_special_tokens=add_special_tokens)
        spans = [(start, end) for token, (start, end) in zip(encoding.ids, encoding.offsets,
                                                             strict=True)
                 if token in self._special_ids and start < end]
        return list(encoding.ids), spans

    def encode_with_specials_at(
        self, text: str, spans: Sequence[tuple[int, int]], add_special_tokens: bool
    ) -> list[int]:
        """`text` with special tokens parsed only inside `spans` (sorted, disjoint, from
        `encode_with_spans`); everything else is encoded as plain text. Special tokens
        split the input into separately encoded pieces anyway, so cutting there changes
        nothing else."""
        pieces: list[Encoding] = []
        position = 0
        for start, end in spans:
            if position < start:
                pieces.append(self._text_backend.encode(text[position:start],
                                                        add_special_tokens=False))
            pieces.append(self._backend.encode(text[start:end], add_special_tokens=False))
            position = end
        if position < len(text) or not pieces:
            pieces.append(self._text_backend.encode(text[position:], add_special_tokens=False))
        merged = Encoding.merge(pieces, growing_offsets=True)
        return list(self._backend.post_process(merged, None, add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text: str = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        # transformers skips this cleanup for BPE models because it corrupts their output.
        if self._clean_up_spaces and type(self._backend.model).__name__ != "BPE":
            text = clean_up_tokenization(text)
        return text

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` to the prompt string (not tokenized; encode it with
        add_special_tokens=False, as transformers does, since templates emit BOS themselves)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        template = compile_chat_template(self.chat_template)
        # Like transformers: drop None-valued keys, which templates tend to render as "None".
        chat = [{k: _plain(v) for k, v in m.items() if v is not None} for m in messages]
        variables = {**self.special_tokens, **_plain(template_kwargs)}
        return template.render(
            messages=chat,
            tools=_plain(tools),
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )


def load_generation_eos_ids(model_dir: str | Path) -> list[int]:
    """Stop token ids: generation_config.json, else config.json, else the tokenizer's eos."""
    model_dir = Path(model_dir)
    for name in ("generation_config.json", "config.json"):
        value = _read_json(model_dir / name).get("eos_token_id")
        if value is not None:
            return [int(value)] if isinstance(value, int) else [int(v) for v in value]
    eos = Tokenizer.from_dir(model_dir).eos_token_id
    return [] if eos is None else [eos]


@functools.lru_cache(maxsize=32)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a (possibly untrusted) template in an immutable sandbox, transformers-style."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def clean_up_tokenization(text: str) -> str:
    """transformers' `clean_up_tokenization` (WordPiece-era spacing fixes)."""
    replacements = [
        (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
        (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
    ]  # fmt: skip
    for old, new in replacements:
        text = text.replace(old, new)
    return text


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's `namespace` minus underscore attributes (defence in depth, as transformers)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature trick
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore attributes on a namespace: {name!r}"
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson HTML-escapes; templates expect plain JSON, as transformers renders it.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _plain(value: Any) -> Any:
    """Rebuild template inputs from plain JSON types, so the sandbox sees no rich objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    for base in (bool, int, float, str):
        if isinstance(value, base):
            return base(value)
    return f"<{type(value).__name__}>"


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _as_added_token(entry: Any) -> AddedToken | None:
    """A tokenizer_config entry (string or AddedToken dict) as a special AddedToken."""
    if entry is None:
        return None
    if isinstance(entry, str):
        return AddedToken(entry, special=True, normalized=False)
    if isinstance(entry, dict) and "content" in entry:
        return AddedToken(
            entry["content"],
            single_word=bool(entry.get("single_word", False)),
            lstrip=bool(entry.get("lstrip", False)),
            rstrip=bool(entry.get("rstrip", False)),
            normalized=bool(entry.get("normalized", False)),
            special=True,
        )
    raise ValueError(f"unrecognised special token entry in tokenizer_config.json: {entry!r}")


def _extra_special_token_entries(config: Mapping[str, Any]) -> list[Any]:
    # transformers 5 calls them extra_special_tokens; 4.x saved additional_special_tokens.
    entries = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    if isinstance(entries, dict):  # model-specific named extras: {"image_token": "<image>"}
        entries = list(entries.values())
    return list(entries)


def _add_missing_special_tokens(backend: BackendTokenizer, tokens: list[AddedToken]) -> None:
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    missing = []
    for token in tokens:
        if token.content not in added:
            missing.append(token)
            added.add(token.content)
    if missing:
        backend.add_special_tokens(missing)


def _load_chat_template(model_dir: Path, config: Mapping[str, Any]) -> str | None:
    """chat_template.jinja wins over tokenizer_config.json (as in transformers 5)."""
    template_file = model_dir / "chat_template.jinja"
    if template_file.exists():
        return template_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        return named.get("default")
    return template if isinstance(template, str) else None
