"""Fault scenarios on a real local fleet, shared by `tests/faults` and `make chaos`.

Role: each scenario runs client load (`tests.faults.load.Load`) against a running
`kvfleet.fleet.Fleet` (real Redis, tokenizer, engines and router processes, tiny model),
injects one fault, heals it, and returns a `ScenarioResult`: what the clients saw, how many
requests the router retried on another engine, how long until requests succeeded again, and
the problems found at the end (KV blocks still held, requests still running, lost requests).

Invariants:
- Bounded: every client call has a deadline; every wait has a timeout.
- A scenario leaves the fleet as it found it (killed processes are restarted), except
  `router_sigterm`, which restarts the router on a new port; run it last.
- Recovery time: from the fault until the first request *started after it* succeeded.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import grpc

from kvfleet.fleet import Fleet
from kvfleet.v1 import engine_pb2, engine_pb2_grpc
from tests.faults.load import Load, LoadConfig, Outcome, tally

IDLE_TIMEOUT_S = 30.0


@dataclass
class ScenarioResult:
    name: str
    outcomes: list[Outcome]
    retried: int = 0
    recovery_s: float | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        return dict(tally(self.outcomes))

    def row(self) -> dict[str, object]:
        counts = self.counts
        return {
            "scenario": self.name,
            "requests": len(self.outcomes),
            "succeeded": counts.get("ok", 0),
            "retried": self.retried,
            "failed (clear error)": counts.get("error", 0),
            "cancelled by client": counts.get("cancelled", 0),
            "unclear": counts.get("unclear", 0) + counts.get("lost", 0),
            "hung": counts.get("hung", 0),
            "recovery s": "-" if self.recovery_s is None else f"{self.recovery_s:.1f}",
        }


# -- fleet probes ------------------------------------------------------------------------------


def engine_load(address: str, timeout_s: float = 2.0) -> engine_pb2.LoadInfo | None:
    with grpc.insecure_channel(address) as channel:
        try:
            load: engine_pb2.LoadInfo = engine_pb2_grpc.EngineStub(channel).GetLoad(
                engine_pb2.GetLoadRequest(), timeout=timeout_s
            )
            return load
        except grpc.RpcError:
            return None


def _idle(load: engine_pb2.LoadInfo | None) -> bool:
    return (
        load is not None and load.num_running == 0 and load.num_waiting == 0
        and load.kv_blocks_free == load.kv_blocks_total
    )


def wait_fleet_idle(fleet: Fleet, timeout_s: float = IDLE_TIMEOUT_S) -> list[str]:
    """Problems left once the load is over: engines with requests or KV blocks still held."""
    deadline = time.monotonic() + timeout_s
    problems: list[str] = []
    for engine in fleet.engines:
        load = engine_load(engine.address)
        while not _idle(load) and time.monotonic() < deadline:
            time.sleep(0.1)
            load = engine_load(engine.address)
        if not _idle(load):
            problems.append(f"{engine.name} not idle after the load: {load}")
    return problems


def metric_total(host: str, port: int, name: str) -> float:
    """Sum of every sample of one Prometheus metric (all label sets) on a /metrics port."""
    url = f"http://{host}:{port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - loopback
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def router_retries(fleet: Fleet) -> float:
    """The router's retry counter (0 when the fleet serves no metrics)."""
    assert fleet.router is not None
    if not fleet.config.metrics:
        return 0.0
    return metric_total(fleet.config.host, fleet.router.metrics_port,
                        "kvfleet:router_retries_total")


def recovery_after(outcomes: Sequence[Outcome], fault_at: float) -> float | None:
    ends = [o.ended for o in outcomes if o.kind == "ok" and o.started >= fault_at]
    return None if not ends else min(ends) - fault_at


def _problems_of(outcomes: Sequence[Outcome]) -> list[str]:
    problems = []
    for outcome in outcomes:
        if outcome.kind in ("hung", "lost", "unclear"):
            problems.append(f"{outcome.kind}: {outcome.code} {outcome.message!r}")
    return problems[:10]


# -- the scenario frame ------------------------------------------------------------------------


def run_with_fault(
    fleet: Fleet,
    name: str,
    load_config: LoadConfig,
    fault: Callable[[Fleet, Load], None],
    settle_s: float = 2.0,
    after_s: float = 3.0,
) -> ScenarioResult:
    """Load -> wait for steady traffic -> fault (which heals before returning) -> more load."""
    retries_before = router_retries(fleet)
    load = Load(fleet.router_address, load_config).start()
    try:
        if not load.wait_for(lambda done: any(o.kind == "ok" for o in done), timeout_s=60):
            raise AssertionError(f"{name}: no request succeeded before the fault")
        time.sleep(settle_s)
        fault_at = time.monotonic()
        fault(fleet, load)
        load.wait_for(lambda done: recovery_after(done, fault_at) is not None, timeout_s=60)
        time.sleep(after_s)
    finally:
        load.stop()
    result = ScenarioResult(name, load.outcomes)
    result.recovery_s = recovery_after(load.outcomes, fault_at)
    result.retried = int(router_retries(fleet) - retries_before)
    result.problems = _problems_of(load.outcomes) + wait_fleet_idle(fleet)
    if result.recovery_s is None:
        result.problems.append("no request succeeded after the fault")
    return result


def _signal(pid: int, sig: signal.Signals) -> None:
    os.kill(pid, sig)


# -- faults ------------------------------------------------------------------------------------


def busiest_engine(fleet: Fleet) -> int:
    """Index of an engine with requests running (the one whose streams a fault will cut)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for index, engine in enumerate(fleet.engines):
            load = engine_load(engine.address)
            if load is not None and load.num_running > 0:
                return index
        time.sleep(0.005)
    return 0


def kill_engine(fleet: Fleet, load: Load) -> None:
    """kill -9 an engine mid-stream, then start it again (a new epoch, same id)."""
    index = busiest_engine(fleet)
    victim = fleet.engines[index]
    victim.kill()
    victim.process.wait(10)
    fleet.engines[index] = fleet.start_engine_process(index)
    fleet.wait_ready([fleet.engines[index]])


def stop_engine(fleet: Fleet, load: Load, stopped_s: float = 6.0) -> None:
    """SIGSTOP a busy engine for longer than the router's stall deadlines, then SIGCONT."""
    pid = fleet.engines[busiest_engine(fleet)].pid
    _signal(pid, signal.SIGSTOP)
    try:
        time.sleep(stopped_s)
    finally:
        _signal(pid, signal.SIGCONT)


def restart_redis(fleet: Fleet, load: Load, down_s: float = 3.0) -> None:
    assert fleet.redis is not None
    fleet.redis.stop()
    time.sleep(down_s)
    fleet.redis.start()


def restart_tokenizer(fleet: Fleet, load: Load) -> None:
    """kill -9 the tokenizer mid-stream and start it again on the same port."""
    fleet.restart_tokenizer(kill=True)


# -- scenarios ---------------------------------------------------------------------------------


# Streams long enough that a fault finds some of them mid-way.
LONG_STREAM_TOKENS = 200


def engine_kill9(fleet: Fleet, config: LoadConfig) -> ScenarioResult:
    config = replace(config, max_tokens=max(config.max_tokens, LONG_STREAM_TOKENS))
    return run_with_fault(fleet, "engine kill -9", config, kill_engine)


def engine_sigstop(fleet: Fleet, config: LoadConfig) -> ScenarioResult:
    config = replace(config, max_tokens=max(config.max_tokens, LONG_STREAM_TOKENS))
    return run_with_fault(fleet, "engine SIGSTOP/SIGCONT", config, stop_engine, after_s=4.0)


def redis_restart(fleet: Fleet, config: LoadConfig) -> ScenarioResult:
    return run_with_fault(fleet, "redis kill+restart", config, restart_redis)


def tokenizer_restart(fleet: Fleet, config: LoadConfig) -> ScenarioResult:
    return run_with_fault(fleet, "tokenizer kill+restart", config, restart_tokenizer)


def burst(fleet: Fleet, config: LoadConfig, num_requests: int = 500) -> ScenarioResult:
    """`num_requests` requests at once (one thread each), then nothing."""
    burst_config = replace(config, concurrency=num_requests, total_requests=num_requests,
                           max_tokens=min(config.max_tokens, 8))
    retries_before = router_retries(fleet)
    started = time.monotonic()
    load = Load(fleet.router_address, burst_config).start()
    load.join()
    result = ScenarioResult(f"burst of {num_requests}", load.outcomes)
    result.retried = int(router_retries(fleet) - retries_before)
    result.problems = _problems_of(load.outcomes) + wait_fleet_idle(fleet)
    result.recovery_s = 0.0 if all(o.kind == "ok" for o in load.outcomes) else None
    if result.recovery_s is None:
        result.problems.append(f"not every burst request succeeded: {result.counts}")
    del started
    return result


# Far more than a request can generate before its cancellation lands (the fleet's model has
# an 8k context: tests.faults.chaos.FAULT_CONTEXT).
VANISH_MAX_TOKENS = 4000


def finish_reasons(fleet: Fleet) -> Counter[str]:
    """Requests every engine finished so far, by finish reason (Prometheus counters)."""
    reasons: Counter[str] = Counter()
    for engine in fleet.engines:
        url = f"http://{fleet.config.host}:{engine.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - loopback
            for line in response.read().decode().splitlines():
                if line.startswith("kvfleet:request_success_total{"):
                    reason = line.split('finished_reason="', 1)[1].split('"', 1)[0]
                    reasons[reason] += int(float(line.rsplit(" ", 1)[1]))
    return reasons


@contextlib.contextmanager
def frozen_engines(fleet: Fleet) -> Iterator[None]:
    pids = [engine.pid for engine in fleet.engines]
    for pid in pids:
        _signal(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            _signal(pid, signal.SIGCONT)


def vanishing_clients(fleet: Fleet, config: LoadConfig, num_each: int = 4) -> ScenarioResult:
    """Clients that go away after their first token (gRPC cancel, HTTP socket closed) and
    before it, over gRPC and HTTP, beside steady load. The engines are frozen (SIGSTOP) while
    the clients vanish, so an abandoned request cannot run to its end before the cancellation
    reaches its engine, whatever the machine's speed: every one must end as "abort" on its
    engine (none as "length"), and every block must end free."""
    prompt = [3 + (i * 7) % 500 for i in range(100)]
    abandon = replace(config, max_tokens=VANISH_MAX_TOKENS, deadline_s=60.0)
    reasons_before = finish_reasons(fleet)
    abandoned: list[Outcome] = []
    lock = threading.Lock()
    vanish_now = threading.Event()
    num_streaming = threading.Semaphore(0)

    def hold() -> None:
        num_streaming.release()
        vanish_now.wait(60)

    def vanish(via_http: bool, after_first_token: bool) -> None:
        started = time.monotonic()
        if via_http:
            http_vanish(fleet, prompt, VANISH_MAX_TOKENS, hold if after_first_token else None)
            outcome = Outcome("cancelled", started, time.monotonic())
        else:
            sender = Load(fleet.router_address, abandon)
            if after_first_token:
                outcome = sender.send(prompt, cancel_after_tokens=1, hold=hold)
            else:
                outcome = sender.send(prompt, cancel_after_s=0.5)
            sender.join()
        with lock:
            abandoned.append(outcome)

    def wave(after_first_token: bool) -> list[threading.Thread]:
        threads = [
            threading.Thread(target=vanish, args=(via_http, after_first_token), daemon=True)
            for via_http in (False, True) for _ in range(num_each)
        ]
        for thread in threads:
            thread.start()
        return threads

    load = Load(fleet.router_address, config).start()
    try:
        streaming = wave(after_first_token=True)
        for _ in streaming:  # every abandoning client holds a stream with a token in it
            if not num_streaming.acquire(timeout=60):
                break
    finally:
        load.stop()
    with frozen_engines(fleet):
        vanish_now.set()
        for thread in streaming:
            thread.join(70)
        for thread in wave(after_first_token=False):
            thread.join(70)
        time.sleep(1.0)  # the router cancels the engine calls while the engines sleep
    result = ScenarioResult("clients vanish", [*load.outcomes, *abandoned])
    result.problems = _problems_of(result.outcomes) + wait_fleet_idle(fleet)
    reasons = finish_reasons(fleet) - reasons_before
    background = sum(1 for o in load.outcomes if o.kind == "ok")
    if reasons["length"] != background:
        result.problems.append(
            f"{reasons['length'] - background} abandoned request(s) ran to max_tokens: {reasons}"
        )
    if reasons["abort"] < 2 * num_each:
        result.problems.append(f"abandoned streams were not aborted on their engine: {reasons}")
    result.recovery_s = 0.0
    return result


def http_vanish(
    fleet: Fleet, prompt: Sequence[int], max_tokens: int, hold: Callable[[], None] | None
) -> None:
    """POST a streamed completion, then close the socket: with `hold`, once the first SSE
    chunk with text arrived and `hold()` returned; without, after 0.5 s reading nothing."""
    assert fleet.router is not None
    body = json.dumps({"model": "", "prompt": list(prompt), "max_tokens": max_tokens,
                       "stream": True, "ignore_eos": True}).encode()
    with socket.create_connection((fleet.config.host, fleet.router.http_port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
        if hold is None:
            time.sleep(0.5)
            return
        received = b""
        while b"data: {" not in received:
            chunk = sock.recv(4096)
            if not chunk:
                return
            received += chunk
        hold()


def router_sigterm(fleet: Fleet, config: LoadConfig) -> ScenarioResult:
    """SIGTERM the router mid-stream: streams in flight finish, the router exits 0, and a new
    router serves. Requests sent while it drains may be refused (UNAVAILABLE), never hung."""
    assert fleet.router is not None
    long_config = replace(config, max_tokens=200)
    load = Load(fleet.router_address, long_config).start()
    try:
        load.wait_for(lambda done: any(o.kind == "ok" for o in done), timeout_s=60)
        time.sleep(1.0)
        fault_at = time.monotonic()
        fleet.router.terminate()
        code = fleet.router.process.wait(60)
    finally:
        load.stop()
    result = ScenarioResult("router SIGTERM", load.outcomes)
    result.problems = _problems_of(load.outcomes)
    if code != 0:
        result.problems.append(f"router exited with {code}")
    cut = [o for o in load.outcomes if o.started < fault_at and o.first_token is not None
           and o.kind != "ok"]
    if cut:
        result.problems.append(f"{len(cut)} stream(s) in flight at SIGTERM did not finish")
    fleet.start_router()
    after = Load(fleet.router_address, replace(config, total_requests=4, concurrency=2))
    after.start().join()
    result.outcomes.extend(after.outcomes)
    result.recovery_s = recovery_after(result.outcomes, fault_at)
    result.problems += _problems_of(after.outcomes) + wait_fleet_idle(fleet)
    return result
