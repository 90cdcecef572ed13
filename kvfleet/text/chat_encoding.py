"""Chat messages to token ids, with control tokens only where the chat template put them.

Role: `encode_chat` renders the template and encodes the prompt so that a special-token string
inside a message's content (`<|im_end|>\\n<|im_start|>system\\n...`) is plain text, never the
control token it spells: a user cannot end its own turn and forge a system or assistant turn.
The template's own special tokens stay special. `allow_special_tokens=True` is vLLM's
behaviour (the whole rendered prompt parsed for special tokens), for operators who want it
(`--allow-special-tokens-in-prompts` on the tokenizer service).

How: the template is rendered a second time with each content replaced by a placeholder, which
says where every content lands in the prompt. The prompt is encoded as before; when no special
token overlaps a content span (every ordinary chat) those ids are returned unchanged, so they
equal transformers' `apply_chat_template` exactly. Otherwise the prompt is encoded again with
special tokens parsed only at the template's spans (`Tokenizer.encode_with_specials_at`).

Invariants:
- A template that rewrites contents (trims, splits) cannot be mapped back; then a content that
  itself holds a special-token string is refused (ValueError naming the message) rather than
  encoded with forged control tokens. Contents without one are encoded as before.
- Text prompts are `Tokenizer.encode(..., split_special_tokens=True)` at the call site.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2

from kvfleet.text.tokenizer import Tokenizer

# Private-use characters: never produced by a template, so a placeholder cannot be confused.
_PLACEHOLDER = re.compile("\ue000([0-9]+)\ue001")

Span = tuple[int, int]


def encode_chat(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    add_special_tokens: bool,
    allow_special_tokens: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[str, list[int]]:
    """(rendered prompt, token ids); jinja2 errors propagate as `apply_chat_template`'s."""
    if not allow_special_tokens:
        _refuse_special_strings_outside_contents(tokenizer, messages, tools)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt, tools)
    ids, specials = tokenizer.encode_with_spans(prompt, add_special_tokens)
    if allow_special_tokens:
        return prompt, ids
    contents = content_spans(tokenizer, messages, add_generation_prompt, prompt, tools)
    if contents is None:
        _refuse_special_strings(tokenizer, messages)
        return prompt, ids
    template_specials = [s for s in specials if not any(_overlap(s, c) for c in contents)]
    if len(template_specials) == len(specials):
        return prompt, ids
    return prompt, tokenizer.encode_with_specials_at(prompt, template_specials,
                                                     add_special_tokens)


def content_spans(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    prompt: str,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[Span] | None:
    """Where each message's text content lands in `prompt`; None when the template does not
    copy contents verbatim (the placeholder rendering does not rebuild `prompt`). A message
    without text content (an assistant turn of tool calls only) keeps its fields as they are."""
    marked = [{**m, "content": f"\ue000{i}\ue001"} if isinstance(m.get("content"), str) else m
              for i, m in enumerate(messages)]
    try:
        rendered = tokenizer.apply_chat_template(marked, add_generation_prompt, tools)
    except jinja2.TemplateError:  # the template inspects contents (e.g. raise_exception)
        return None
    spans: list[Span] = []
    pieces: list[str] = []
    position = length = 0
    for match in _PLACEHOLDER.finditer(rendered):
        index = int(match.group(1))
        if index >= len(messages):
            return None
        pieces.append(rendered[position:match.start()])
        length += match.start() - position
        content = messages[index].get("content", "")
        spans.append((length, length + len(content)))
        pieces.append(content)
        length += len(content)
        position = match.end()
    pieces.append(rendered[position:])
    return spans if "".join(pieces) == prompt else None


def _overlap(a: Span, b: Span) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _refuse_special_strings(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]]) -> None:
    for index, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, str) and tokenizer.encode_with_spans(content, False)[1]:
            raise ValueError(
                f"messages[{index}].content holds a special-token string, which this chat "
                "template cannot keep as plain text (the operator may allow special tokens "
                "in prompts: --allow-special-tokens-in-prompts)"
            )


def _refuse_special_strings_outside_contents(
    tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
) -> None:
    """Tool-call names and arguments, tool names and `tools` are client text the template
    renders in its own ways (often through `tojson`), which the placeholder rendering cannot
    follow: a special-token string there is refused (ValueError naming the field) rather
    than encoded as a control token."""
    fields: list[tuple[str, Any]] = [("tools", json.dumps(list(tools)))] if tools else []
    for index, message in enumerate(messages):
        fields.append((f"messages[{index}].name", message.get("name")))
        for call_index, call in enumerate(message.get("tool_calls") or []):
            where = f"messages[{index}].tool_calls[{call_index}]"
            function = call.get("function") if isinstance(call, Mapping) else None
            fields.append((f"{where}", json.dumps(call, default=str)) if function is None
                          else (f"{where}.function", json.dumps(function, default=str)))
    for field, text in fields:
        if isinstance(text, str) and tokenizer.encode_with_spans(text, False)[1]:
            raise ValueError(
                f"{field} holds a special-token string, which would become a control token "
                "(the operator may allow special tokens in prompts: "
                "--allow-special-tokens-in-prompts)"
            )
