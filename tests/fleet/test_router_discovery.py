"""Where a router finds engines, on a real fleet: without Redis, and when a heartbeat goes stale.

One module-scoped fleet (Redis, tokenizer, 2 engines on the tiny model, a router) plus
routers started here with other flags: one whose Redis URL points at a port nothing listens
on and that knows the engines from `--engines`, one with no Redis at all and `--engine-dns`.
Engines are paused with SIGSTOP to make them hang (and always resumed): a hung engine still
accepts connections, so its RPCs neither fail nor answer.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.contracts import redis_schema
from kvfleet.fleet import Fleet, ServiceProcess, wait_until_serving
from kvfleet.redis_server import free_port
from kvfleet.router_client import Completion, build_request
from tests.fixtures.fleets import FleetOptions
from tests.fixtures.router_fleet import (
    API_KEYS,
    RouterClient,
    engine_load,
    greedy,
    tenant_prefix,
    wait_until,
)

pytestmark = pytest.mark.timeout(240)

KEY = API_KEYS["tenant-0"]
START_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def fleet_options() -> FleetOptions:
    return {
        "num_engines": 2,
        "api_keys": True,
        "engine_threads": 1,
    }


def start_router(fleet: Fleet, name: str, *flags: str) -> ServiceProcess:
    """A router process beside the fleet's, with its own flags (and a metrics port)."""
    assert fleet.tokenizer is not None and fleet.config.api_keys is not None
    port_file = fleet.log_dir / f"{name}.port"
    metrics_port_file = fleet.log_dir / f"{name}.metrics-port"
    log_path = fleet.log_dir / f"{name}.log"
    command = [sys.executable, "-m", "router.server", "--tokenizer", fleet.tokenizer.address,
               "--api-keys", str(fleet.config.api_keys), "--host", "127.0.0.1", "--port", "0",
               "--port-file", str(port_file), "--metrics-port", "0",
               "--metrics-port-file", str(metrics_port_file), "--no-http",
               # The fleet's engines serve only callers holding its router credential.
               "--router-secret-file", str(fleet.router_secret_file), *flags]
    with open(log_path, "ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=log)
    router = ServiceProcess(name, process, port_file, log_path, "127.0.0.1",
                            metrics_port_file=metrics_port_file)
    try:
        wait_until_serving(router, time.monotonic() + START_TIMEOUT_S)
    except BaseException:
        router.kill()
        raise
    return router


def stop(router: ServiceProcess) -> None:
    router.terminate()
    router.wait(15)


@pytest.fixture(scope="module")
def static_router(fleet: Fleet) -> Iterator[ServiceProcess]:
    """Redis configured but down since before it started; engines from --engines."""
    engines = ",".join(e.address for e in fleet.engines)
    router = start_router(fleet, "static-router", "--redis-url",
                          f"redis://127.0.0.1:{free_port()}/0", "--engines", engines)
    yield router
    stop(router)


def generate(router: ServiceProcess, ids: list[int], model: str = "") -> Completion:
    request = build_request(prompt_token_ids=ids, params=greedy(max_tokens=2))
    request.model = model
    with grpc.insecure_channel(router.address) as channel:
        return RouterClient(channel).generate(request, KEY)


def metric(router: ServiceProcess, name: str, **labels: str) -> float:
    url = f"http://127.0.0.1:{router.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


def model_name(fleet: Fleet) -> str:
    return engine_load(fleet.engines[0].address).model_name


def served_by(router: ServiceProcess, num_prompts: int = 12) -> dict[int, str]:
    """Prompt number -> engine id, for distinct prompts sent one after another."""
    return {i: generate(router, tenant_prefix(200 + i, 40)).engine_id
            for i in range(num_prompts)}


def test_without_redis_a_router_serves_from_its_static_engine_list(
    static_router: ServiceProcess,
) -> None:
    assert set(served_by(static_router).values()) == {"engine-0", "engine-1"}
    assert metric(static_router, "kvfleet:router_routing_decisions_total",
                  policy="least_load") == 12


def test_the_model_filter_applies_without_redis(
    fleet: Fleet, static_router: ServiceProcess
) -> None:
    served = model_name(fleet)
    with pytest.raises(grpc.RpcError) as info:
        generate(static_router, tenant_prefix(300, 40), model="no-such-model")
    error: Any = info.value  # a grpc.Call as well as an RpcError
    assert error.code() is grpc.StatusCode.NOT_FOUND
    assert "no-such-model" in error.details() and served in error.details()
    assert generate(static_router, tenant_prefix(300, 40), model=served).num_tokens == 2


def test_a_dns_name_finds_engines_without_redis(fleet: Fleet) -> None:
    engine = fleet.engines[1]
    assert engine.port is not None
    router = start_router(fleet, "dns-router", "--engine-dns", f"localhost:{engine.port}")
    try:
        served = {generate(router, tenant_prefix(400 + i, 40)).engine_id for i in range(4)}
    finally:
        stop(router)
    assert served == {engine.name}


def test_a_slow_load_poll_does_not_make_an_engine_suspect(
    fleet: Fleet, static_router: ServiceProcess
) -> None:
    """A hung engine times out GetLoad: it keeps its place and serves once it resumes."""
    homes = served_by(static_router)
    number = next(n for n, engine in homes.items() if engine == "engine-0")
    hung = fleet.engines[0]
    timeouts = metric(static_router, "kvfleet:router_engine_load_polls_total", outcome="timeout")
    result: dict[str, Completion | BaseException] = {}

    def request() -> None:
        try:
            result["done"] = generate(static_router, tenant_prefix(200 + number, 40))
        except BaseException as e:  # surfaced below
            result["done"] = e

    os.kill(hung.pid, signal.SIGSTOP)
    try:
        thread = threading.Thread(target=request, daemon=True)
        thread.start()
        wait_until(lambda: metric(static_router, "kvfleet:router_engine_load_polls_total",
                                  outcome="timeout") > timeouts, 30,
                   what="a GetLoad timeout on the hung engine")
    finally:
        os.kill(hung.pid, signal.SIGCONT)
    thread.join(60)
    done = result["done"]
    assert isinstance(done, Completion), done
    assert done.engine_id == hung.name
    assert "failed; avoiding it" not in static_router.log_tail(1_000_000)


def test_an_engine_with_a_stale_heartbeat_gets_no_requests(fleet: Fleet) -> None:
    store = redis.Redis.from_url(fleet.redis_url)
    ids = tenant_prefix(500, 40)
    with grpc.insecure_channel(fleet.router_address) as channel:
        client = RouterClient(channel)
        home = client.generate_ids(ids, KEY).engine_id
        hung = next(e for e in fleet.engines if e.name == home)
        key = redis_schema.engine_key(home)
        os.kill(hung.pid, signal.SIGSTOP)
        try:
            # The hung engine's entry stays (no expiry) with a heartbeat from a minute ago.
            seconds, _ = store.time()
            store.persist(key)
            store.hset(key, "updated_at", repr(float(seconds) - 60))
            started = time.monotonic()
            done = client.generate_ids(ids, KEY)
            assert done.engine_id != home
            assert time.monotonic() - started < 30
        finally:
            os.kill(hung.pid, signal.SIGCONT)
    # Its next heartbeat makes it live again.
    wait_until(lambda: float(store.hget(key, "updated_at") or 0) > float(seconds),
               10, what=f"{home} to heartbeat again")
    store.close()
