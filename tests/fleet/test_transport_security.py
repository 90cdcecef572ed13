"""Transport security of a real fleet (`kvfleet up --tls`): Redis needs its password, every gRPC
hop is mutual TLS, the HTTP API is HTTPS, and an engine entry planted in Redis gets nothing.

One fleet (one engine, TLS on) for the module; the attack listeners run in this process.
"""

from __future__ import annotations

import contextlib
import ssl
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import httpx2
import pytest
import redis
from openai import OpenAI

from kvfleet.contracts import redis_schema
from kvfleet.fleet import Fleet
from kvfleet.fleet_tls import issue_fleet_certificates
from kvfleet.router_client import build_request
from kvfleet.runtime.tls import ENGINE_ROLE, name_options
from kvfleet.v1 import engine_pb2, engine_pb2_grpc, router_pb2_grpc
from tests.fixtures.fleets import FleetOptions
from tests.fixtures.router_fleet import RouterClient, greedy


@pytest.fixture(scope="module")
def fleet_options() -> FleetOptions:
    # Attempts enough to try every planted entry, then the real engine.
    return {"num_engines": 1, "tls": True, "engine_threads": 1,
            "router_args": ("--max-attempts", "5")}


def test_redis_refuses_a_client_without_the_password(fleet: Fleet) -> None:
    assert fleet.redis is not None
    anonymous = redis.Redis(host=fleet.redis.host, port=fleet.redis.port, socket_timeout=5)
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    anonymous.close()
    with redis.Redis.from_url(fleet.redis_url, socket_timeout=5) as authenticated:
        assert authenticated.ping()


def test_no_secret_is_on_a_command_line(fleet: Fleet) -> None:
    assert fleet.redis is not None and fleet.redis.password
    secrets = [fleet.redis.password, fleet.router_secret_file.read_text().strip()]
    pids = [s.pid for s in fleet.processes()]
    redis_process = fleet.redis._process  # the Redis server's own argv too
    assert redis_process is not None
    for pid in [*pids, redis_process.pid]:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        assert not [s for s in secrets if s in argv], pid


def test_https_and_grpc_over_tls_serve_end_to_end(fleet: Fleet) -> None:
    assert fleet.http_url.startswith("https://") and fleet.ca_file is not None
    trust = ssl.create_default_context(cafile=str(fleet.ca_file))
    with httpx2.Client(verify=trust, timeout=60) as http, OpenAI(
        base_url=f"{fleet.http_url}/v1", api_key="none", http_client=http, max_retries=0,
    ) as sdk:
        completion = sdk.completions.create(model=sdk.models.list().data[0].id,
                                            prompt="hello there", max_tokens=4, temperature=0)
    assert completion.usage is not None and completion.usage.completion_tokens == 4
    credentials = grpc.ssl_channel_credentials(root_certificates=fleet.ca_file.read_bytes())
    with grpc.secure_channel(fleet.router_address, credentials,
                             name_options("kvfleet-router")) as channel:
        result = RouterClient(channel).generate(build_request("hello there", params=greedy(3)))
    assert result.num_tokens == 3
    # No plaintext anywhere: the router's gRPC front door refuses a plaintext client.
    with grpc.insecure_channel(fleet.router_address) as channel, pytest.raises(grpc.RpcError):
        router_pb2_grpc.RouterStub(channel).Generate(
            build_request("hi", params=greedy(1)), timeout=5).next()


def test_an_engine_serves_only_holders_of_a_fleet_certificate(fleet: Fleet) -> None:
    assert fleet.ca_file is not None
    engine = fleet.engines[0].address
    server_only = grpc.ssl_channel_credentials(root_certificates=fleet.ca_file.read_bytes())
    for channel in (grpc.insecure_channel(engine),
                    grpc.secure_channel(engine, server_only, name_options(ENGINE_ROLE))):
        with channel, pytest.raises(grpc.RpcError) as refused:
            engine_pb2_grpc.EngineStub(channel).GetLoad(engine_pb2.GetLoadRequest(), timeout=5)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE


class _Recorder(grpc.GenericRpcHandler):
    """Any RPC that reaches it: the method and its metadata (a router secret would be there)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, str]]] = []

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> None:
        metadata = {k: str(v) for k, v in handler_call_details.invocation_metadata}
        self.calls.append((handler_call_details.method, metadata))
        return None


@contextlib.contextmanager
def _listener(credentials: grpc.ServerCredentials | None) -> Iterator[tuple[str, _Recorder]]:
    recorder = _Recorder()
    server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[recorder])
    port = (server.add_insecure_port("127.0.0.1:0") if credentials is None
            else server.add_secure_port("127.0.0.1:0", credentials))
    server.start()
    try:
        yield f"127.0.0.1:{port}", recorder
    finally:
        server.stop(0)


@contextlib.contextmanager
def _planted(store: redis.Redis, template: dict[bytes, bytes],
             entries: dict[str, str]) -> Iterator[None]:
    """Registry entries naming `entries` (id -> address), kept fresh and the best choice."""
    stop = threading.Event()

    def write() -> None:
        for engine_id, address in entries.items():
            fields = {**template, b"address": address.encode(), b"epoch": engine_id.encode(),
                      b"prefill_tokens_per_s": b"1e12", b"updated_at": repr(time.time()).encode()}
            key = redis_schema.engine_key(engine_id)
            store.hset(key, mapping=fields)  # type: ignore[arg-type]
            store.expire(key, redis_schema.REGISTRY_TTL_S)
            store.sadd(redis_schema.ENGINES_SET, engine_id)

    def refresh() -> None:
        while not stop.wait(0.3):
            write()

    write()
    thread = threading.Thread(target=refresh, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        for engine_id in entries:
            store.delete(redis_schema.engine_key(engine_id))
            store.srem(redis_schema.ENGINES_SET, engine_id)


def test_an_engine_entry_planted_in_redis_gets_no_request(fleet: Fleet, tmp_path: Path) -> None:
    """A listener without a fleet certificate, one with a certificate of another CA that
    even carries the right names, and a real engine's address under another id: the
    router finishes no handshake with any of them, sends them nothing (so never its
    secret), logs each, and serves the request on the real engine."""
    assert fleet.ca_file is not None
    other = issue_fleet_certificates(tmp_path / "other-ca", {"impostor-tls": [ENGINE_ROLE]})
    cert = other.services["impostor-tls"]
    foreign = grpc.ssl_server_credentials([(cert.key_file.read_bytes(),
                                            cert.cert_file.read_bytes())])
    secret = fleet.router_secret_file.read_text().strip()
    with redis.Redis.from_url(fleet.redis_url, socket_timeout=5) as store, \
            _listener(None) as (plain, plain_calls), \
            _listener(foreign) as (tls, tls_calls):
        template = store.hgetall(redis_schema.engine_key("engine-0"))
        entries = {"impostor-plain": plain, "impostor-tls": tls,
                   "impostor-id": fleet.engines[0].address}
        log = fleet.router.log_path if fleet.router is not None else Path("/nonexistent")
        with _planted(store, template, entries):
            credentials = grpc.ssl_channel_credentials(fleet.ca_file.read_bytes())
            with grpc.secure_channel(fleet.router_address, credentials,
                                     name_options("kvfleet-router")) as channel:
                # Each request tries the best-looking entry first; a failed one is avoided
                # for a while, so a few requests reach every planted entry.
                for attempt in range(8):
                    result = RouterClient(channel).generate(
                        build_request(f"a planted engine {attempt}", params=greedy(2)))
                    assert result.engine_id == "engine-0"
                    if all(_refused(log, name) for name in entries):
                        break
    assert plain_calls.calls == [] and tls_calls.calls == []
    assert not [c for c in plain_calls.calls + tls_calls.calls if secret in str(c)]
    assert [name for name in entries if not _refused(log, name)] == []


def _refused(router_log: Path, engine_id: str) -> bool:
    """Whether the router logged that `engine_id` failed to prove its identity."""
    return any(f"engine {engine_id} at" in line and "did not prove its identity" in line
               for line in router_log.read_text().splitlines())
