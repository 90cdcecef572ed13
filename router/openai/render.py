"""Router responses -> OpenAI JSON: whole completions, SSE chunks, usage and logprobs.

Role: `Choices` accumulates the router's messages (from every prompt and sample) into
OpenAI choices; `completion_chunk` / `chat_chunk` render one message as a streaming chunk.
Both kinds of response share one accumulation, so streamed deltas always add up to the
non-streamed text.

Invariants:
- Choice index = prompt index * n + sample index (vLLM's numbering for batched prompts).
- usage.prompt_tokens counts each prompt once however many samples it has;
  completion_tokens adds up every sample.
- Logprob token strings are the engine's decoded_token (each id decoded on its own, no
  tokenizer call here); the completions shape carries text_offset into the choice's text
  (echoed prompt included).
  With echo and logprobs the prompt's tokens come first (the first with logprob None), from
  the engine's prompt logprobs.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvfleet.v1 import common_pb2, router_pb2

Json = dict[str, Any]


@dataclass
class Choice:
    index: int
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    completion_tokens: int = 0
    # Completions' text_offset of the next token; chat's logprob entries.
    offset: int = 0
    completion_logprobs: Json | None = None
    chat_logprobs: list[Json] | None = None


@dataclass
class Choices:
    """Every choice of one OpenAI request, filled message by message."""

    n: int
    kind: str  # "completion" or "chat"
    logprobs: bool = False
    choices: dict[int, Choice] = field(default_factory=dict)
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)

    def choice(self, prompt_index: int, response: router_pb2.RouterGenerateResponse) -> Choice:
        index = prompt_index * self.n + response.index
        choice = self.choices.get(index)
        if choice is None:
            choice = self.choices[index] = Choice(index)
            if self.logprobs:
                if self.kind == "chat":
                    choice.chat_logprobs = []
                else:
                    choice.completion_logprobs = {
                        "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []
                    }
        return choice

    def add(
        self,
        prompt_index: int,
        response: router_pb2.RouterGenerateResponse,
        prefix: str = "",
    ) -> tuple[Choice, Json | list[Json] | None]:
        """Fold one message in; returns its choice and this message's logprobs (rendered)."""
        choice = self.choice(prompt_index, response)
        choice.text += prefix + response.text_delta
        with_prompt = bool(prefix) and bool(response.prompt_logprobs)
        if not with_prompt:  # echoed prompt tokens advance the offset themselves
            choice.offset += len(prefix)
        choice.completion_tokens += len(response.token_ids)
        rendered = self._logprobs(choice, response, with_prompt)
        if response.HasField("finish_reason"):
            choice.finish_reason = response.finish_reason
            choice.stop_reason = stop_reason(response)
            self.prompt_tokens[prompt_index] = response.usage.prompt_tokens
            self.cached_tokens[prompt_index] = max(
                self.cached_tokens.get(prompt_index, 0), response.num_cached_tokens
            )
        return choice, rendered

    def _logprobs(
        self,
        choice: Choice,
        response: router_pb2.RouterGenerateResponse,
        with_prompt: bool = False,
    ) -> Json | list[Json] | None:
        if not self.logprobs:
            return None
        if self.kind == "chat":
            entries = [_chat_entry(lp) for lp in response.logprobs]
            assert choice.chat_logprobs is not None
            choice.chat_logprobs.extend(entries)
            return entries
        delta: Json = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if with_prompt:
            # echo + logprobs: the prompt's tokens come first; the first has no logprob.
            if response.prompt_token_ids:
                _completion_entry(choice, delta, response.first_prompt_token_text, None)
            for lp in response.prompt_logprobs:
                _completion_entry(choice, delta, lp.sampled.decoded_token, lp)
        for lp in response.logprobs:
            _completion_entry(choice, delta, lp.sampled.decoded_token, lp)
        assert choice.completion_logprobs is not None
        for key, values in delta.items():
            choice.completion_logprobs[key].extend(values)
        return delta

    def usage(self) -> Json:
        prompt = sum(self.prompt_tokens.values())
        completion = sum(c.completion_tokens for c in self.choices.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())},
        }

    def completion_body(self, response_id: str, model: str, created: int) -> Json:
        return {
            "id": response_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": c.index,
                    "text": c.text,
                    "logprobs": c.completion_logprobs,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for c in self.sorted()
            ],
            "usage": self.usage(),
        }

    def chat_body(self, response_id: str, model: str, created: int) -> Json:
        return {
            "id": response_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": None if c.chat_logprobs is None else {"content": c.chat_logprobs},
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for c in self.sorted()
            ],
            "usage": self.usage(),
        }

    def sorted(self) -> list[Choice]:
        return [self.choices[i] for i in sorted(self.choices)]


def completion_chunk(
    response_id: str, model: str, created: int, choice: Choice, text: str,
    logprobs: Json | list[Json] | None, final: bool,
) -> Json:
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{
            "index": choice.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": choice.finish_reason if final else None,
            "stop_reason": choice.stop_reason if final else None,
        }],
    }


def chat_chunk(
    response_id: str, model: str, created: int, choice: Choice, delta: Json,
    logprobs: Json | list[Json] | None, final: bool,
) -> Json:
    return {
        "id": response_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{
            "index": choice.index,
            "delta": delta,
            "logprobs": None if logprobs is None else {"content": logprobs},
            "finish_reason": choice.finish_reason if final else None,
            "stop_reason": choice.stop_reason if final else None,
        }],
    }


def usage_chunk(response_id: str, model: str, created: int, obj: str, usage: Json) -> Json:
    return {
        "id": response_id, "object": obj, "created": created, "model": model,
        "choices": [], "usage": usage,
    }


def _completion_entry(
    choice: Choice, delta: Json, token: str, lp: common_pb2.TokenLogprobs | None
) -> None:
    top: dict[str, float] | None = None
    if lp is not None:
        # Tokens can decode to the same string (byte pieces): keep the likelier entry.
        top = {}
        for alternative in lp.top:
            top.setdefault(alternative.decoded_token, alternative.logprob)
        top.setdefault(token, lp.sampled.logprob)
    delta["tokens"].append(token)
    delta["token_logprobs"].append(None if lp is None else lp.sampled.logprob)
    delta["top_logprobs"].append(top)
    delta["text_offset"].append(choice.offset)
    choice.offset += len(token)


def stop_reason(response: router_pb2.RouterGenerateResponse) -> int | str | None:
    if not response.HasField("stop_reason"):
        return None
    which = response.stop_reason.WhichOneof("reason")
    if which == "token_id":
        return int(response.stop_reason.token_id)
    if which == "stop_string":
        return str(response.stop_reason.stop_string)
    return None


def new_id(prefix: str) -> tuple[str, int]:
    return f"{prefix}-{uuid.uuid4().hex}", int(time.time())


def _chat_entry(lp: common_pb2.TokenLogprobs) -> Json:
    token = lp.sampled.decoded_token
    return {
        "token": token,
        "logprob": lp.sampled.logprob,
        "bytes": list(token.encode("utf-8")),
        "top_logprobs": [
            {
                "token": t.decoded_token,
                "logprob": t.logprob,
                "bytes": list(t.decoded_token.encode("utf-8")),
            }
            for t in lp.top
        ],
    }
