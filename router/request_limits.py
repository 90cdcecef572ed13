"""Request limits of the router's front doors: the flags, and the checks made before any work.

Role: one frozen `RequestLimits`, parsed once from the router's flags, shared by the gRPC
servicer and the HTTP API through `GenerationPipeline`. Each check raises
`kvfleet.contracts.errors.InvalidFieldError` naming the field (gRPC INVALID_ARGUMENT, HTTP 400; 413
for a body over `max_body_bytes`), so a request that could only waste compute or stall
other tenants costs nothing beyond reading it.

Order, cheapest first: the HTTP body (bytes and read deadline, `router.http.body`); then
sizes known without tokenizing (characters, messages, stop strings, choices); then, after
tokenizing, the prompt's token count (`max_input_tokens`, and the served model's
max_model_len once an engine is chosen, `router.engines.context_window`).

Defaults follow TGI where it has the limit (`--payload-limit` 2 MB, `--max-input-tokens`,
`--max-stop-sequences`); the others are sized so that the worst request still tokenizes
in well under a second and fits a 4 MiB gRPC message to the tokenizer service.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from kvfleet.contracts.errors import InvalidFieldError
from kvfleet.v1 import common_pb2, router_pb2

# gRPC's default maximum message size, which the tokenizer service receives with; a prompt
# must leave room for the rest of the message.
TOKENIZER_MAX_MESSAGE_BYTES = 4 * 1024 * 1024 - 64 * 1024


@dataclass(frozen=True)
class RequestLimits:
    # HTTP request body, in bytes (TGI's --payload-limit).
    max_body_bytes: int = 2_000_000
    # Seconds to receive a whole HTTP body once its headers are in (slow or lying clients).
    body_read_timeout_s: float = 30.0
    # Prompt characters (a chat: every message's role and content), checked before tokenizing.
    max_input_chars: int = 1_000_000
    # Prompt tokens; None: the served model's max_model_len - 1 (TGI's --max-input-tokens).
    max_input_tokens: int | None = None
    # Chat messages per request.
    max_messages: int = 2048
    # Stop strings per request, and characters per stop string.
    max_stop_sequences: int = 16
    max_stop_chars: int = 256
    # Completions per request: n x the number of prompts (each one is an engine request).
    max_choices: int = 128

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_input_chars", "max_messages", "max_stop_sequences",
                     "max_stop_chars", "max_choices"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.body_read_timeout_s <= 0:
            raise ValueError(
                f"body_read_timeout_s must be positive, got {self.body_read_timeout_s}"
            )
        if self.max_input_tokens is not None and self.max_input_tokens < 1:
            raise ValueError(f"max_input_tokens must be at least 1, got {self.max_input_tokens}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RequestLimits:
        return cls(
            max_body_bytes=args.payload_limit,
            body_read_timeout_s=args.body_read_timeout,
            max_input_chars=args.max_input_chars,
            max_input_tokens=args.max_input_tokens,
            max_messages=args.max_messages,
            max_stop_sequences=args.max_stop_sequences,
            max_stop_chars=args.max_stop_chars,
            max_choices=args.max_choices,
        )

    def check_request(self, request: router_pb2.RouterGenerateRequest) -> None:
        """Everything checkable before tokenizing: prompt size, messages, stop strings, n."""
        kind = request.WhichOneof("input")
        if kind == "prompt":
            self._check_chars("prompt", len(request.prompt), len(request.prompt.encode()))
        elif kind == "messages":
            self._check_messages(request.messages.messages, request.messages.tools_json)
        elif kind == "prompt_token_ids":
            self.check_prompt_tokens(len(request.prompt_token_ids.ids), "prompt")
        self.check_stop(request.sampling_params)
        n = request.sampling_params.n if request.sampling_params.HasField("n") else 1
        self.check_choices(n, 1)

    def check_stop(self, params: common_pb2.SamplingParams) -> None:
        if len(params.stop) > self.max_stop_sequences:
            raise InvalidFieldError(
                "stop", f"stop has {len(params.stop)} strings; at most "
                f"{self.max_stop_sequences} are allowed",
            )
        for index, stop in enumerate(params.stop):
            if len(stop) > self.max_stop_chars:
                raise InvalidFieldError(
                    "stop", f"stop[{index}] is {len(stop)} characters long; at most "
                    f"{self.max_stop_chars} are allowed",
                )

    def check_choices(self, n: int, num_prompts: int) -> None:
        if n * num_prompts > self.max_choices:
            what = f"n ({n}) x prompts ({num_prompts})" if num_prompts > 1 else f"n ({n})"
            raise InvalidFieldError(
                "n" if num_prompts == 1 else "prompt",
                f"{what} asks for {n * num_prompts} completions; at most {self.max_choices} "
                "are allowed per request",
            )

    def check_prompt_tokens(self, num_tokens: int, param: str) -> None:
        if self.max_input_tokens is not None and num_tokens > self.max_input_tokens:
            raise InvalidFieldError(
                param, f"{param} is {num_tokens} tokens long; at most {self.max_input_tokens} "
                "input tokens are allowed",
            )

    def _check_messages(
        self, messages: Sequence[common_pb2.ChatMessage], tools_json: str = ""
    ) -> None:
        if len(messages) > self.max_messages:
            raise InvalidFieldError(
                "messages", f"messages has {len(messages)} entries; at most "
                f"{self.max_messages} are allowed",
            )
        # Tool definitions and calls are rendered into the prompt too.
        texts = [m.role + m.content + "".join(c.name + c.arguments for c in m.tool_calls)
                 for m in messages] + [tools_json]
        chars = sum(map(len, texts))
        encoded = sum(len(t.encode()) + 8 for t in texts)
        self._check_chars("messages", chars, encoded)

    def _check_chars(self, param: str, chars: int, encoded_bytes: int) -> None:
        if chars > self.max_input_chars:
            raise InvalidFieldError(
                param, f"{param} is {chars} characters long; at most {self.max_input_chars} "
                "are allowed",
            )
        if encoded_bytes > TOKENIZER_MAX_MESSAGE_BYTES:
            raise InvalidFieldError(
                param, f"{param} is {encoded_bytes} bytes in UTF-8; at most "
                f"{TOKENIZER_MAX_MESSAGE_BYTES} can be tokenized",
            )


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """The router's request-limit flags (see `RequestLimits` for the defaults' reasons)."""
    d = RequestLimits()
    group = parser.add_argument_group("request limits (refused with HTTP 400/413 or "
                                      "INVALID_ARGUMENT before any work)")
    group.add_argument("--payload-limit", type=int, default=d.max_body_bytes,
                       help="largest HTTP request body, in bytes; 413 above it "
                       "(default: %(default)s)")
    group.add_argument("--body-read-timeout", type=float, default=d.body_read_timeout_s,
                       help="seconds to receive an HTTP body after its headers; 408 after "
                       "(default: %(default)s)")
    group.add_argument("--max-input-chars", type=int, default=d.max_input_chars,
                       help="prompt characters (chat: all messages), checked before tokenizing "
                       "(default: %(default)s)")
    group.add_argument("--max-input-tokens", type=int, default=d.max_input_tokens,
                       help="prompt tokens (default: the served model's max_model_len - 1)")
    group.add_argument("--max-messages", type=int, default=d.max_messages,
                       help="chat messages per request (default: %(default)s)")
    group.add_argument("--max-stop-sequences", type=int, default=d.max_stop_sequences,
                       help="stop strings per request (default: %(default)s)")
    group.add_argument("--max-stop-chars", type=int, default=d.max_stop_chars,
                       help="characters per stop string (default: %(default)s)")
    group.add_argument("--max-choices", type=int, default=d.max_choices,
                       help="completions per request: n x the number of prompts "
                       "(default: %(default)s)")
