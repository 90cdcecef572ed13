"""Prefill/decode disaggregation: do short chats keep their inter-token latency while
another client sends long prompts? (docs/disaggregation.md)

Fleets on the same model, one after the other: 1 prefill + 1 decode engine per KV transport
in `--transports` (shm: same-host shared memory, grpc: bytes over gRPC), then 2 colocated
engines (`--no-colocated` skips them). In each, `--chats` clients stream short chats back to
back while one client (`--long-clients N`: N) sends `--long-tokens`-token prompts back to back,
for `--seconds`.
Printed per fleet: the chats' p50/p99 inter-token latency, their p50/p99 time to first token
and chat tokens streamed, and for
a disaggregated one the KV transfer's cost per block (µs and GB/s, end to end: the prefill
engine's push until the decode engine has the blocks in its cache; from its metrics).

    python -m benchmarks.disagg_bench [--model DIR|FILE.gguf] [--seconds 60] [--chats 4]
                                      [--long-tokens 2000] [--long-clients 1]
                                      [--transports shm,grpc]
                                      [--decode-caps 4,0] [--prefill-nices 0,10]
                                      [--cpu-binds 'all;0|1']
                                      [--prefill-budgets 2048,512] [--rounds 3]

`--decode-caps`: one 1P+1D fleet per transport and cap, its engines started with
`--max-prefill-tokens-per-decode-step` (0: no cap; unset: the engines' default, 4 on a
decode engine), for an A/B of the decode engine's prompt cap in one run.

`--prefill-nices 0,10` and `--cpu-binds 'all;0|1'`: likewise one 1P+1D fleet per value of the
prefill engine's nice increment (FleetConfig.prefill_nice) and of the engines' CPU binding
(kvfleet up --engine-cpus; with engines bound, the router and this client run off the decode
engine's CPUs, as the fleet places its own services).

`--prefill-engine-arg ARG` (repeatable): a flag given to the prefill engine only.
`--prefill-budgets 2048,512,256`: one 1P+1D fleet per value of the prefill engine's
`--max-num-batched-tokens` (its prompt chunk per step; the decode engine keeps its own);
`--rounds N` repeats the whole list N times, interleaved, for A/B runs on a busy machine.
Each fleet also prints the long prompts' time to first token (their prefill).

`--transfer-only N`: instead, the transfer's own cost per block on one idle engine, N pushes
per transport (benchmarks.kv_transfer_cost; no prefill compute in the figure).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import random
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from benchmarks import kv_transfer_cost
from benchmarks.proc_cpu import cpu_seconds
from kvfleet.cli import resolve_model
from kvfleet.fleet import Fleet, FleetConfig
from kvfleet.fleet_config import parse_engine_cpus
from kvfleet.router_client import auth_metadata, build_request, channel
from kvfleet.v1 import common_pb2, router_pb2_grpc


@dataclass
class Gaps:
    seconds: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)  # when each gap ended (monotonic)
    streams: int = 0  # chats with a first token (each has one token more than gaps)
    first_token: list[float] = field(default_factory=list)  # each chat's time to first token
    # Per long prompt, its token times: sent, first token (prefill done), second token (KV
    # handed off and its first decode step), last token.
    long_prompts: list[list[float]] = field(default_factory=list)

    def percentile(self, q: float, of: list[float] | None = None) -> float:
        values = self.seconds if of is None else of
        if not values:
            return float("nan")
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def worst_by_phase(self, share: float = 0.01) -> dict[str, int]:
        """Where the worst `share` of the gaps fell, against the long prompts' phases: the
        handoff (first to second token: transfer, import, admission, first decode step)
        first, then the long prompt's later decode steps, then its prefill."""
        count = max(1, int(share * len(self.seconds)))
        worst = sorted(range(len(self.seconds)), key=lambda i: -self.seconds[i])[:count]
        phases = {"handoff": 0, "imported decode": 0, "prefill": 0, "neither": 0}
        for i in worst:
            end = self.ends[i]
            start = end - self.seconds[i]
            phases[self._phase(start, end)] += 1
        return phases

    def _phase(self, start: float, end: float) -> str:
        # (first, last) token-time indexes of each phase, in the order they are blamed.
        for name, first, last in (("handoff", 1, 2), ("imported decode", 2, -1),
                                  ("prefill", 0, 1)):
            for times in self.long_prompts:
                if len(times) >= 3 and times[first] < end and start < times[last]:
                    return name
        return "neither"


async def _stream(stub: router_pb2_grpc.RouterStub, prompt: list[int], max_tokens: int,
                  gaps: Gaps | None) -> list[float]:
    """Stream one request; the times it was sent and each of its token messages came."""
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    times = [time.monotonic()]
    async for response in stub.Generate(build_request(prompt_token_ids=prompt, params=params),
                                        metadata=auth_metadata(None)):
        now = time.monotonic()
        if response.token_ids and gaps is not None:
            if len(times) > 1:
                gaps.seconds.append(now - times[-1])
                gaps.ends.append(now)
            else:
                gaps.streams += 1
                gaps.first_token.append(now - times[0])
        if response.token_ids:
            times.append(now)
    return times


async def _load(address: str, args: argparse.Namespace) -> Gaps:
    rng = random.Random(0)
    gaps = Gaps()
    deadline = time.monotonic() + args.seconds

    async def chats(stub: router_pb2_grpc.RouterStub) -> None:
        while time.monotonic() < deadline:
            prompt = [rng.randrange(3, 500) for _ in range(args.chat_tokens)]
            await _stream(stub, prompt, args.chat_output, gaps)

    async def long_prompts(stub: router_pb2_grpc.RouterStub) -> None:
        while time.monotonic() < deadline:
            prompt = [rng.randrange(3, 500) for _ in range(args.long_tokens)]
            gaps.long_prompts.append(await _stream(stub, prompt, 4, None))

    async with channel(address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        await asyncio.gather(*(long_prompts(stub) for _ in range(args.long_clients)),
                             *(chats(stub) for _ in range(args.chats)))
    return gaps


def _metric(port: int | None, name: str) -> float:
    if port is None:
        return 0.0
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
        text = page.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name))


def _run(name: str, config: FleetConfig, args: argparse.Namespace) -> None:
    with Fleet(config) as fleet, _bound(config.service_cpus()):
        pids = _processes(config, fleet)
        before, start = {name: cpu_seconds(pid) for name, pid in pids.items()}, time.monotonic()
        gaps = asyncio.run(_load(fleet.router_address, args))
        wall = time.monotonic() - start
        shares = ", ".join(f"{name} {(cpu_seconds(pid) - before[name]) / wall:.0%}"
                           for name, pid in pids.items())
        line = (f"{name:>16}: chats' inter-token latency p50 {gaps.percentile(0.5) * 1e3:.1f} ms"
                f", p99 {gaps.percentile(0.99) * 1e3:.1f} ms ({len(gaps.seconds)} gaps, "
                f"{len(gaps.seconds) + gaps.streams} chat tokens); TTFT p50 "
                f"{gaps.percentile(0.5, gaps.first_token) * 1e3:.0f} ms, p99 "
                f"{gaps.percentile(0.99, gaps.first_token) * 1e3:.0f} ms; "
                f"p99/p50 {gaps.percentile(0.99) / gaps.percentile(0.5):.2f}; "
                f"{_long_ttft(gaps)}")
        if config.prefill_engines:
            line += "; " + _transfer_cost(fleet.engines[0].metrics_port)
        phases = ", ".join(f"{name} {n}" for name, n in gaps.worst_by_phase().items())
        print(f"{line}\n{'':>18}worst 1% of gaps during the long prompts' {phases}\n"
              f"{'':>18}CPU time a second: {shares}", flush=True)


def _long_ttft(gaps: Gaps) -> str:
    """The long prompts' time to first token (their prefill, queueing included)."""
    ttfts = [times[1] - times[0] for times in gaps.long_prompts if len(times) > 1]
    if not ttfts:
        return "no long prompt answered"
    return (f"long prompts' TTFT p50 {gaps.percentile(0.5, ttfts):.2f} s, max "
            f"{max(ttfts):.2f} s ({len(ttfts)} prompts)")


def _processes(config: FleetConfig, fleet: Fleet) -> dict[str, int]:
    """The pids whose CPU time the run reports: this client, the router, each engine."""
    engines = {f"{role} engine" if role != "both" else engine.name: engine.pid
               for role, engine in zip(config.engine_roles, fleet.engines, strict=True)}
    return {"client": os.getpid(), "router": fleet.router.pid if fleet.router else 0,
            **engines}


@contextlib.contextmanager
def _bound(cpus: tuple[int, ...]) -> Iterator[None]:
    """Run this client where the fleet runs its router (off the decode engines' CPUs when
    engines are bound): every thread of this process, gRPC's included, then as before."""
    if not cpus:
        yield
        return
    threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    before = os.sched_getaffinity(0)
    for tid in threads:
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(tid, cpus)
    try:
        yield
    finally:
        for thread in os.listdir("/proc/self/task"):
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(int(thread), before)


def _transfer_cost(port: int | None) -> str:
    sent = _metric(port, "kvfleet:kv_transfer_sent_bytes_total")
    secs = _metric(port, "kvfleet:kv_transfer_seconds_sum")
    count = _metric(port, "kvfleet:kv_transfer_seconds_count")
    blocks = _metric(port, "kvfleet:kv_transfer_blocks_total")
    if not blocks or not secs:
        return "no KV transfer"
    return (f"KV transfer {sent / blocks / 1024:.0f} KiB blocks, {secs / blocks * 1e6:.0f} us "
            f"per block, {sent / secs / 1e9:.2f} GB/s ({count:.0f} transfers, "
            f"{blocks:.0f} blocks)")


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    if args.long_clients < 0:
        parser.error("--long-clients must be 0 or more")
    # What `kvfleet up` serves without --model (the default model's GGUF), unless given.
    model = resolve_model(args.model)
    context = str(args.max_model_len or max(4096, args.long_tokens + 512))
    engine_args = ("--max-model-len", context, *args.engine_arg)
    if args.transfer_only:
        _transfer_only(model, engine_args, args)
        return
    with tempfile.TemporaryDirectory() as work:
        fleets = _fleets(parser, args, model, engine_args, Path(work))
        for round_ in range(args.rounds):
            if args.rounds > 1:
                print(f"round {round_ + 1}, load average {os.getloadavg()}", flush=True)
            for name, config in fleets:
                _run(name, config, args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--chats", type=int, default=4)
    parser.add_argument("--chat-tokens", type=int, default=32)
    parser.add_argument("--chat-output", type=int, default=64)
    parser.add_argument("--long-tokens", type=int, default=2000)
    parser.add_argument("--long-clients", type=int, default=1,
                        help="clients sending long prompts back to back (default: %(default)s; "
                             "2 keeps both colocated engines prefilling)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="default: long prompt + 512, at least 4096")
    parser.add_argument("--engine-arg", action="append", default=[])
    parser.add_argument("--transports", default="shm",
                        help="comma-separated KV transports, a 1P+1D fleet each: shm, grpc")
    parser.add_argument("--decode-caps", default="",
                        help="comma-separated --max-prefill-tokens-per-decode-step values, a "
                             "1P+1D fleet per transport and value (default: the engines' own)")
    parser.add_argument("--prefill-nices", default="",
                        help="comma-separated nice increments for the prefill engine, a "
                             "1P+1D fleet each (default: the fleet's own)")
    parser.add_argument("--cpu-binds", default="all",
                        help="';'-separated engine CPU bindings (kvfleet up --engine-cpus: "
                             "'all', or the prefill engine's CPUs|the decode engine's), a "
                             "1P+1D fleet each, e.g. 'all;0|1' (default: %(default)s)")
    parser.add_argument("--prefill-engine-arg", action="append", default=[],
                        help="a flag of the prefill engine only (repeatable)")
    parser.add_argument("--prefill-budgets", default="",
                        help="comma-separated --max-num-batched-tokens values of the prefill "
                             "engine, a 1P+1D fleet each (default: the engine's own)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every fleet this many times, interleaved")
    parser.add_argument("--colocated", action=argparse.BooleanOptionalAction, default=True,
                        help="also run 2 colocated engines (default: %(default)s)")
    parser.add_argument("--transfer-only", type=int, default=0, metavar="N",
                        help="only the transfer's cost: N pushes per transport to an idle "
                             "engine")
    return parser


def _fleets(parser: argparse.ArgumentParser, args: argparse.Namespace, model: Path,
            engine_args: tuple[str, ...], work: Path) -> list[tuple[str, FleetConfig]]:
    """The fleets to run, in order: a 1P+1D one per transport, cap, nice, binding and
    prefill budget, then the colocated one."""
    threshold = ("--disagg-prefill-threshold", str(max(1, args.long_tokens // 2)))
    caps = _list(parser, "--decode-caps", args.decode_caps, str.isdigit, "a token count")
    nices = _list(parser, "--prefill-nices", args.prefill_nices,
                  lambda nice: nice.isdigit() and int(nice) <= 19, "a nice increment 0-19")
    budgets = _list(parser, "--prefill-budgets", args.prefill_budgets,
                    lambda budget: budget.isdigit() and int(budget) > 0, "a token count > 0")
    binds = [_cpu_bind(parser, bind) for bind in args.cpu_binds.split(";")]
    base = FleetConfig(model_dir=model, num_engines=2, engine_args=engine_args,
                       router_args=threshold, engine_threads=1)
    configs = []
    for transport in args.transports.split(","):
        for cap, nice, bind, budget in itertools.product(caps, nices, binds, budgets):
            name = (f"1P+1D {transport}" + ("" if cap is None else f" cap {cap}")
                    + ("" if nice is None else f" nice {nice}")
                    + ("" if not bind else f" cpus {_bind_label(bind)}")
                    + ("" if budget is None else f" prefill budget {budget}"))
            decode = () if cap is None else ("--max-prefill-tokens-per-decode-step", cap)
            prefill = (*args.prefill_engine_arg,
                       *(() if budget is None else ("--max-num-batched-tokens", budget)))
            config = replace(
                base, prefill_engines=1, decode_engines=1, engine_cpus=bind,
                engine_args=(*engine_args, "--kv-transfer", transport, *decode),
                prefill_engine_args=prefill, log_dir=work / name.replace(" ", "-"))
            configs.append((name, config if nice is None else replace(config,
                                                                      prefill_nice=int(nice))))
    if args.colocated:
        configs.append(("2 colocated", replace(base, log_dir=work / "2-colocated")))
    return configs


Binding = tuple[tuple[int, ...], ...]


def _list(parser: argparse.ArgumentParser, flag: str, value: str,
          valid: Callable[[str], bool], what: str) -> list[str | None]:
    """A comma-separated A/B list; [None] (the fleet's default) when empty."""
    items = [item.strip() for item in value.split(",") if item.strip()]
    for item in items:
        if not valid(item):
            parser.error(f"{flag}: {item!r} is not {what}")
    return list(items) or [None]


def _bind_label(bind: Binding) -> str:
    return "|".join(",".join(map(str, cpus)) for cpus in bind)


def _cpu_bind(parser: argparse.ArgumentParser, bind: str) -> Binding:
    try:
        return parse_engine_cpus(bind)
    except ValueError as exc:
        parser.error(str(exc))


def _transfer_only(model: Path, engine_args: tuple[str, ...], args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as work:
        config = FleetConfig(model_dir=model, num_engines=1, engine_args=engine_args,
                             log_dir=Path(work) / "engine", engine_threads=1)
        with Fleet(config) as fleet:
            costs = kv_transfer_cost.run(
                fleet.engines[0].address, fleet.router_secret_file, model,
                args.transports.split(","), args.long_tokens, args.transfer_only)
    for cost in costs:
        print(cost.line(), flush=True)


if __name__ == "__main__":
    main()
