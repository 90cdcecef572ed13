"""The systems the fleet benchmark compares, each started fresh for one case, then stopped.

Fleets of two engines on two cores (one core's worth each), same dtype, KV cache (2 GiB per
engine), context (2,048), batch width and step token budget:
- `kvfleet-prefix`, `kvfleet-round_robin`: kvfleet/fleet.py with 2 engines of one torch
  thread each, the router's `--policy`; served by the router's OpenAI HTTP API;
- `sglang-cache_aware`, `sglang-round_robin`: two `vllm serve` (OpenMP threads bound to CPU 0
  for one, CPU 1 for the other; prefix caching on; stats on, for their Prometheus counters),
  started together, behind sglang-router 0.3.2 with that `--policy`.
One engine with each system's defaults (`--single-engine-defaults`):
- `kvfleet-defaults`: what `kvfleet up --engines 1` starts (router policy prefix, torch
  threads = cores, the engine's own defaults) plus `--dtype`;
- `vllm-defaults`: `vllm serve MODEL` with only host, port, served name and `--dtype`, in
  the CPU environment of the peers notes (OpenMP threads bound to every core, 2 GiB KV).
A `Handle` gives the OpenAI base URL, each engine's /metrics URL with its counter prefix, and
the KV block size (the prefix-cache hit granularity). `warm_up` sends untimed short requests
unrelated to any case's prompts; `scrape` reads every engine's counters.
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from benchmarks import fleet_metrics
from benchmarks.kvfleet_runner import BLOCK_SIZE, MAX_BATCHED_TOKENS, MAX_NUM_SEQS
from benchmarks.online import kvfleet_engine_args
from benchmarks.sglang_serving import VERSION as SGLANG_VERSION
from benchmarks.sglang_serving import SglangRouter
from benchmarks.vllm_runner import PeerConfig
from benchmarks.vllm_serving import VllmServer, wait_http_ok
from kvfleet.cli import default_engine_threads
from kvfleet.fleet import Fleet, FleetConfig

FLEET_SYSTEMS = ("kvfleet-prefix", "kvfleet-round_robin", "sglang-cache_aware",
                 "sglang-round_robin")
DEFAULT_SYSTEMS = ("kvfleet-defaults", "vllm-defaults")
VLLM_DEFAULT_BLOCK_SIZE = 128  # vLLM's CPU platform default, when /metrics does not say


@dataclass
class Handle:
    name: str
    base_url: str
    metrics: dict[str, str]  # engine name -> /metrics URL
    prefix: str  # the counters' name prefix
    block_size: int
    lines: list[str] = field(default_factory=list)  # what was started, for the report
    router_metrics: str | None = None  # kvfleet's router /metrics URL (decision reasons)


def fetch(url: str, timeout_s: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return str(resp.read().decode("utf-8"))


def scrape(handle: Handle) -> fleet_metrics.Snapshot:
    return {name: fleet_metrics.counters(fetch(url), handle.prefix)
            for name, url in handle.metrics.items()}


def warm_up(handle: Handle, model: str, count: int) -> None:
    """`count` short untimed completions, all at once (every engine gets some), unrelated to
    the measured prompts: first-call costs fall on no case, and no case prompt is cached."""
    def one(i: int) -> None:
        body = json.dumps({"model": model, "prompt": f"Warm-up {i}: name a colour and a fruit.",
                           "max_tokens": 4, "temperature": 0}).encode()
        request = urllib.request.Request(f"{handle.base_url}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as resp:
            resp.read()

    if count > 0:
        with ThreadPoolExecutor(count) as pool:
            list(pool.map(one, range(count)))


@contextmanager
def kvfleet_fleet(model_dir: Path, policy: str, args: argparse.Namespace,
                  work: Path) -> Iterator[Handle]:
    config = FleetConfig(model_dir=model_dir, num_engines=2, policy=policy, engine_threads=1,
                         engine_args=(*kvfleet_engine_args(args.dtype, args.kvcache_gib),
                                      *args.kvfleet_engine_arg),
                         log_dir=work / "kvfleet-logs", log_level="WARNING")
    with Fleet(config) as fleet:
        yield _kvfleet_handle(fleet, f"kvfleet-{policy}", BLOCK_SIZE, [
            f"kvfleet-{policy}: 2 engines x 1 torch thread, {args.dtype}, KV "
            f"{args.kvcache_gib} GiB each, {BLOCK_SIZE}-token blocks; router --policy {policy}"
            + _extra(args)])


@contextmanager
def kvfleet_defaults(model_dir: Path, args: argparse.Namespace, work: Path) -> Iterator[Handle]:
    """`kvfleet up --engines 1` (cli.run_up's FleetConfig) with `--engine-arg --dtype`."""
    threads = default_engine_threads(1)
    config = FleetConfig(model_dir=model_dir, num_engines=1, engine_threads=threads,
                         engine_args=("--dtype", args.dtype, *args.kvfleet_engine_arg),
                         log_dir=work / "kvfleet-logs", log_level="WARNING")
    with Fleet(config) as fleet:
        yield _kvfleet_handle(fleet, "kvfleet-defaults", BLOCK_SIZE, [
            f"kvfleet-defaults: kvfleet up --engines 1 (policy {config.policy}, {threads} "
            f"torch threads, engine defaults) --engine-arg --dtype {args.dtype}" + _extra(args)])


def _extra(args: argparse.Namespace) -> str:
    """The report line's note of engine flags added with --kvfleet-engine-arg."""
    extra: list[str] = args.kvfleet_engine_arg
    return f"; extra engine flags: {' '.join(extra)}" if extra else ""


def _kvfleet_handle(fleet: Fleet, name: str, block_size: int, lines: list[str]) -> Handle:
    wait_http_ok(f"{fleet.http_url}/health", 60, what="kvfleet router")
    router = fleet.router.metrics_url if fleet.router and fleet.router.metrics_port_file else None
    return Handle(name, fleet.http_url, {e.name: e.metrics_url for e in fleet.engines},
                  "kvfleet:", block_size, lines, router)


def decision_reasons(handle: Handle) -> dict[str, float]:
    """kvfleet's router decisions so far by reason (cached, pending, spill, hash, ...);
    empty for systems without our router."""
    if handle.router_metrics is None:
        return {}
    return fleet_metrics.labelled_counter(fetch(handle.router_metrics),
                                          "kvfleet:router_routing_decisions", "reason")


def decision_holds(handle: Handle) -> dict[str, float]:
    """kvfleet's router decision-to-send holds so far: count, sum (s) and how many were
    within 10 ms; empty for systems without our router."""
    if handle.router_metrics is None:
        return {}
    name = "kvfleet:router_decision_hold_seconds"
    holds: dict[str, float] = {}
    for line in fetch(handle.router_metrics).splitlines():
        if line.startswith((f"{name}_count ", f"{name}_sum ")):
            holds[line.split()[0].rsplit("_", 1)[1]] = float(line.split()[1])
        elif line.startswith(f'{name}_bucket{{le="0.01"}}'):
            holds["within_10ms"] = float(line.split()[-1])
    return holds


def _start_all(starters: list[Callable[[], VllmServer]]) -> list[VllmServer]:
    """Start servers together (start-up is mostly one core each); all or none. Interrupted
    (Ctrl-C), it waits for the starts to end and closes what came up: none is left unowned."""
    pool = ThreadPoolExecutor(len(starters))
    futures = [pool.submit(s) for s in starters]
    try:
        wait(futures)
    except BaseException:
        pool.shutdown(wait=True)
        _close_started(futures)
        raise
    pool.shutdown()
    errors = [e for f in futures if (e := f.exception()) is not None]
    if errors:
        _close_started(futures)
        raise errors[0]
    return [f.result() for f in futures]


def _close_started(futures: list[Future[VllmServer]]) -> None:
    for f in futures:
        if f.done() and f.exception() is None:
            f.result().close()


def _vllm_block_size(server: VllmServer) -> int:
    return fleet_metrics.block_size(fetch(server.metrics_url)) or VLLM_DEFAULT_BLOCK_SIZE


@contextmanager
def sglang_fleet(model_dir: Path, policy: str, args: argparse.Namespace, cfg: PeerConfig,
                 work: Path) -> Iterator[Handle]:
    one_core = replace(cfg, threads=1)

    def starter(cpu: int) -> Callable[[], VllmServer]:
        return lambda: VllmServer(
            model_dir, model_dir.name, args.dtype, one_core, work / f"vllm-serve-{cpu}.log",
            max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_BATCHED_TOKENS,
            log_stats=True, env={"VLLM_CPU_OMP_THREADS_BIND": str(cpu)})

    with ExitStack() as stack:
        servers = [stack.enter_context(s) for s in _start_all([starter(0), starter(1)])]
        router = stack.enter_context(SglangRouter([s.base_url for s in servers], policy, cfg,
                                                  work / "sglang-router.log"))
        size = _vllm_block_size(servers[0])
        yield Handle(f"sglang-{policy}", router.base_url,
                     {f"vllm-{i}": s.metrics_url for i, s in enumerate(servers)}, "vllm:", size,
                     [f"sglang-{policy}: sglang-router {SGLANG_VERSION} --policy {policy} over "
                      f"2 x vllm serve (OpenMP bound to CPU 0 / CPU 1), {args.dtype}, KV "
                      f"{cfg.kvcache_space_gib} GiB each, {size}-token blocks, prefix caching, "
                      f"{'eager' if cfg.enforce_eager else 'torch.compile'}"])


@contextmanager
def vllm_defaults(model_dir: Path, args: argparse.Namespace, cfg: PeerConfig,
                  work: Path) -> Iterator[Handle]:
    with VllmServer(model_dir, model_dir.name, args.dtype, cfg, work / "vllm-serve.log",
                    max_num_seqs=None, max_num_batched_tokens=None, max_model_len=None,
                    prefix_caching=None, log_stats=True) as server:
        size = _vllm_block_size(server)
        yield Handle("vllm-defaults", server.base_url, {"vllm": server.metrics_url}, "vllm:",
                     size, [f"vllm-defaults: vllm serve with --dtype {args.dtype} (defaults "
                            f"otherwise: {size}-token blocks), OpenMP bound to CPUs "
                            f"0-{cfg.threads - 1}, KV {cfg.kvcache_space_gib} GiB"])


def start(system: str, model_dir: Path, args: argparse.Namespace, cfg: PeerConfig,
          work: Path) -> AbstractContextManager[Handle]:
    """A fresh `system` (a context manager yielding its Handle)."""
    kind, _, policy = system.partition("-")
    if system == "kvfleet-defaults":
        return kvfleet_defaults(model_dir, args, work)
    if system == "vllm-defaults":
        return vllm_defaults(model_dir, args, cfg, work)
    if kind == "kvfleet" and system in FLEET_SYSTEMS:
        return kvfleet_fleet(model_dir, policy, args, work)
    if kind == "sglang" and system in FLEET_SYSTEMS:
        return sglang_fleet(model_dir, policy, args, cfg, work)
    raise ValueError(f"unknown system {system!r}")
