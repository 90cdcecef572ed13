"""HTTP clients that leave before their first token: the engine drops their requests at once.

Real processes (Redis, tokenizer, one engine, router) over real sockets. The engine runs one
sequence at a time (--max-num-seqs 1) and a "blocker" request streamed straight from the
engine holds that slot for as long as the test needs (a copy of the tiny model with a long
context, so 60k tokens fit). HTTP requests with long prompts and long max_tokens therefore
wait in the engine's queue, with no first token, until their clients disconnect: then they
must leave the queue while the blocker still runs, long before they could have finished,
and in the end every KV block is free.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import grpc
import openai
import pytest
from openai import OpenAI

from kvfleet.fleet import Fleet
from kvfleet.runtime.service_auth import CREDENTIAL_HEADER
from kvfleet.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tests.fixtures.fleets import FleetOptions
from tests.fixtures.router_fleet import API_KEYS, engine_load, wait_until

pytestmark = pytest.mark.timeout(240)

KEY = API_KEYS["tenant-0"]
CONTEXT = 65536
BLOCKER_TOKENS = 60000
# Long prompts: several hundred tokens each.
PROMPT = "The lighthouse keeper counted the ships, one by one, until the fog rolled in. " * 20


@pytest.fixture(scope="module")
def fleet_options() -> FleetOptions:
    return {
        "context": CONTEXT, "num_engines": 1, "api_keys": True,
        "engine_args": ("--max-num-seqs", "1", "--num-kv-blocks", "4200"),
    }


@pytest.fixture
def blocker(fleet: Fleet) -> Iterator[grpc.Call]:
    """A request running on the engine's only slot until the test ends."""
    address = fleet.engines[0].address
    credential = ((CREDENTIAL_HEADER, fleet.router_secret_file.read_text()),)
    with grpc.insecure_channel(address) as channel:
        call = engine_pb2_grpc.EngineStub(channel).Generate(  # as a router would
            engine_pb2.GenerateRequest(
                request_id="blocker", prompt_token_ids=[5, 6, 7, 8],
                sampling_params=common_pb2.SamplingParams(
                    temperature=0.0, max_tokens=BLOCKER_TOKENS, ignore_eos=True),
            ),
            timeout=200, metadata=credential,
        )
        next(call)  # running
        yield call
        call.cancel()
    wait_until(lambda: _idle_and_free(address), 30, what="the engine to be idle, all blocks free")


def _idle_and_free(address: str) -> bool:
    load = engine_load(address)
    return (load.num_running + load.num_waiting == 0
            and load.kv_blocks_free == load.kv_blocks_total)


def _post(port: int, path: str, body: dict[str, object]) -> socket.socket:
    """Send one request and leave the connection open, unread."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data
    )
    return sock


def _bodies(model: str) -> list[tuple[str, dict[str, object]]]:
    common = {"model": model, "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
    chat = {"messages": [{"role": "user", "content": PROMPT}], **common}
    return [
        ("/v1/completions", {"prompt": PROMPT, **common}),
        ("/v1/completions", {"prompt": PROMPT, "stream": True, **common}),
        ("/v1/chat/completions", chat),
        ("/v1/chat/completions", {**chat, "stream": True}),
        ("/v1/completions", {"prompt": [PROMPT, PROMPT + "!"], **common}),  # two prompts
    ]


def test_clients_gone_while_queued_leave_the_engine_queue(
    fleet: Fleet, blocker: grpc.Call
) -> None:
    address = fleet.engines[0].address
    assert fleet.router is not None
    bodies = _bodies(fleet.config.model_dir.name)
    sockets = [_post(fleet.router.http_port, path, body) for path, body in bodies]
    queued = len(bodies) + 1  # the last body has two prompts
    try:
        wait_until(lambda: engine_load(address).num_waiting == queued, 30,
                   what="every request to wait behind the blocker")
    finally:
        for sock in sockets:
            sock.close()  # no first token yet: the client goes away
    wait_until(lambda: engine_load(address).num_waiting == 0, 15,
               what="the abandoned requests to leave the engine's queue")
    load = engine_load(address)
    assert load.num_running == 1, "only the blocker runs: nothing abandoned was scheduled"


def test_sdk_clients_that_time_out_before_the_first_token_cancel(
    fleet: Fleet, blocker: grpc.Call
) -> None:
    address = fleet.engines[0].address
    model = fleet.config.model_dir.name
    failures: list[BaseException] = []

    def client(stream: bool, chat: bool) -> None:
        with OpenAI(base_url=f"{fleet.http_url}/v1", api_key=KEY, max_retries=0,
                    timeout=1.0) as c:
            try:
                if chat:
                    result = c.chat.completions.create(
                        model=model, messages=[{"role": "user", "content": PROMPT}],
                        max_tokens=2000, stream=stream)
                else:
                    result = c.completions.create(model=model, prompt=PROMPT,
                                                  max_tokens=2000, stream=stream)
                if stream:
                    list(result)  # type: ignore[call-overload]
            except BaseException as e:  # noqa: BLE001 - collected for the assertion
                failures.append(e)

    threads = [threading.Thread(target=client, args=(stream, chat))
               for stream in (False, True) for chat in (False, True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(failures) == 4 and all(isinstance(e, openai.APITimeoutError) for e in failures)
    wait_until(lambda: engine_load(address).num_waiting == 0, 15,
               what="the timed-out requests to leave the engine's queue")
    assert engine_load(address).num_running == 1
