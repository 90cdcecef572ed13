"""A small async client for the Router service (used by `kvfleet client`, the demo, the bench).

Role: build a RouterGenerateRequest from plain Python values, attach the API key as
`authorization: Bearer KEY`, stream the response, hand each text delta to a callback, and
return one `Completion` with the final message's fields and client-side timings.

Invariant: timings are measured on the client's monotonic clock: `ttft_s` is the time to the
first message carrying text or token ids, `latency_s` the time to the last message.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from kvfleet.v1 import common_pb2, router_pb2, router_pb2_grpc

TextCallback = Callable[[str], None]


@dataclass
class Completion:
    request_id: str = ""
    text: str = ""
    num_tokens: int = 0
    finish_reason: str = ""
    engine_id: str = ""
    num_cached_tokens: int = 0
    usage: dict[str, int] = field(default_factory=dict)
    ttft_s: float | None = None
    latency_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        """The JSON line `kvfleet client` prints after the text."""
        return {
            "request_id": self.request_id,
            "engine_id": self.engine_id,
            "num_cached_tokens": self.num_cached_tokens,
            "finish_reason": self.finish_reason,
            "usage": self.usage,
        }


def build_request(
    prompt: str | None = None,
    *,
    messages: Sequence[tuple[str, str]] = (),
    prompt_token_ids: Sequence[int] = (),
    params: common_pb2.SamplingParams | None = None,
    request_id: str = "",
) -> router_pb2.RouterGenerateRequest:
    """Exactly one of prompt / messages (role, content) / prompt_token_ids."""
    request = router_pb2.RouterGenerateRequest(request_id=request_id)
    if params is not None:
        request.sampling_params.CopyFrom(params)
    if prompt is not None:
        request.prompt = prompt
    elif messages:
        for role, content in messages:
            request.messages.messages.add(role=role, content=content)
    else:
        request.prompt_token_ids.SetInParent()  # selects the oneof even for an empty list
        request.prompt_token_ids.ids.extend(prompt_token_ids)
    return request


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


async def generate(
    stub: router_pb2_grpc.RouterStub,
    request: router_pb2.RouterGenerateRequest,
    *,
    api_key: str | None = None,
    on_text: TextCallback | None = None,
    timeout_s: float | None = None,
) -> Completion:
    """Stream one request to the end; raises grpc.aio.AioRpcError on failure."""
    started = time.monotonic()
    completion = Completion()
    parts: list[str] = []
    call = stub.Generate(request, metadata=auth_metadata(api_key), timeout=timeout_s)
    async for response in call:
        if completion.ttft_s is None and (response.text_delta or response.token_ids):
            completion.ttft_s = time.monotonic() - started
        if response.request_id:
            completion.request_id = response.request_id
        completion.num_tokens += len(response.token_ids)
        if response.text_delta:
            parts.append(response.text_delta)
            if on_text is not None:
                on_text(response.text_delta)
        if response.HasField("finish_reason"):
            _take_final(completion, response)
    completion.text = "".join(parts)
    completion.latency_s = time.monotonic() - started
    return completion


def _take_final(completion: Completion, response: router_pb2.RouterGenerateResponse) -> None:
    completion.finish_reason = response.finish_reason
    completion.engine_id = response.engine_id
    completion.num_cached_tokens = response.num_cached_tokens
    completion.usage = {
        "prompt_tokens": response.usage.prompt_tokens,
        "completion_tokens": response.usage.completion_tokens,
        "total_tokens": response.usage.total_tokens,
    }


def channel(address: str, ca_file: Path | None = None) -> grpc.aio.Channel:
    """A channel to the router: plaintext, or TLS verifying its certificate against
    `ca_file` (the router's front door asks no client certificate)."""
    if ca_file is None:
        return grpc.aio.insecure_channel(address)
    credentials = grpc.ssl_channel_credentials(root_certificates=ca_file.read_bytes())
    return grpc.aio.secure_channel(address, credentials)
