"""Helpers for the router/fleet tests: API keys, a sync router client, polling, /proc.

Everything talks to real processes over real sockets: a `kvfleet.fleet.Fleet` (Redis,
tokenizer, engines, router as subprocesses), the generated sync stubs, and redis-py.
Every call passes a timeout so a regression fails instead of hanging.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvfleet.router_client import Completion, auth_metadata, build_request
from kvfleet.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc
from tests.services.polling import wait_until  # noqa: F401 - re-exported

CALL_TIMEOUT_S = 60.0
NUM_TENANTS = 8
API_KEYS = {f"tenant-{i}": f"key-{i}" for i in range(NUM_TENANTS)} | {"other": "key-other"}
# Tiny model's special tokens are ids 0..2: prompts use ids from 3 up.
FIRST_PLAIN_ID = 3


def write_api_keys(path: Path) -> Path:
    path.write_text(json.dumps({"tenants": {t: [k] for t, k in API_KEYS.items()}}))
    return path


def tenant_prefix(index: int, num_tokens: int = 96, vocab_size: int = 512) -> list[int]:
    """A distinct, seeded prefix (the tenant's "system prompt") as token ids."""
    rng = random.Random(1000 + index)
    return [rng.randrange(FIRST_PLAIN_ID, vocab_size) for _ in range(num_tokens)]


def greedy(max_tokens: int = 4, **fields: object) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, **fields)  # type: ignore[arg-type]


@dataclass
class RouterClient:
    """Sync client over one channel to the router."""

    channel: grpc.Channel

    @property
    def stub(self) -> router_pb2_grpc.RouterStub:
        return router_pb2_grpc.RouterStub(self.channel)

    def stream(
        self, request: router_pb2.RouterGenerateRequest, api_key: str | None = None
    ) -> Iterator[router_pb2.RouterGenerateResponse]:
        call: Iterator[router_pb2.RouterGenerateResponse] = self.stub.Generate(
            request, metadata=auth_metadata(api_key), timeout=CALL_TIMEOUT_S
        )
        return call

    def generate(
        self,
        request: router_pb2.RouterGenerateRequest,
        api_key: str | None = None,
    ) -> Completion:
        completion = Completion()
        texts = []
        for response in self.stream(request, api_key):
            completion.request_id = completion.request_id or response.request_id
            completion.num_tokens += len(response.token_ids)
            texts.append(response.text_delta)
            if response.HasField("finish_reason"):
                completion.finish_reason = response.finish_reason
                completion.engine_id = response.engine_id
                completion.num_cached_tokens = response.num_cached_tokens
                completion.usage = {"prompt_tokens": response.usage.prompt_tokens,
                                    "completion_tokens": response.usage.completion_tokens}
        completion.text = "".join(texts)
        return completion

    def generate_ids(self, ids: Sequence[int], api_key: str | None,
                     params: common_pb2.SamplingParams | None = None) -> Completion:
        request = build_request(prompt_token_ids=ids, params=params or greedy())
        return self.generate(request, api_key)


def engine_load(address: str) -> engine_pb2.LoadInfo:
    with grpc.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        load: engine_pb2.LoadInfo = stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=10)
        return load



def child_pids(pid: int) -> set[int]:
    """All live descendants of `pid` (Linux /proc)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
