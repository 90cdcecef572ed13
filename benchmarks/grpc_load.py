"""The router's own cost (part of `make bench` D): one engine driven directly over gRPC vs the
same engine through the router's gRPC API, same client, same workload, alternated.

Workload: `num_prompts` prompts of `input_len` random token ids (ids in [100, vocab - 100),
fresh ids every round so no round gets prefix-cache hits from an earlier one), `output_len`
greedy tokens each, EOS ignored, every request sent at once (rate inf). The client is one
asyncio process (grpc.aio); it counts a token when its message arrives.

Per round and mode: req/s (completed requests over the wall time from the first send to the
last final message), TTFT (send to first token) and TPOT ((last token - first token) / (tokens
- 1)) mean / p50 / p99 in ms. Modes alternate over the rounds so that a slow phase of a shared
machine hits both; the report takes the median req/s and mean latencies over rounds.
"""

from __future__ import annotations

import asyncio
import functools
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from benchmarks.workload import random_prompts
from kvfleet.router_client import build_request
from kvfleet.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2_grpc

Row = dict[str, Any]
Metadata = tuple[tuple[str, str], ...]
MODES = ("engine", "router")


def _params(output_len: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


async def _one(call: Any) -> tuple[float, list[float]]:
    sent = time.perf_counter()
    arrivals: list[float] = []
    async for message in call:
        if message.token_ids:
            now = time.perf_counter()
            arrivals.extend([now] * len(message.token_ids))
    return sent, arrivals


async def _round(address: str, mode: str, prompts: Sequence[Sequence[int]], output_len: int,
                 tag: str, engine_metadata: Metadata = ()) -> Row:
    async with grpc.aio.insecure_channel(address) as channel:
        calls: list[Callable[[], Any]] = []
        if mode == "engine":
            stub = engine_pb2_grpc.EngineStub(channel)
            for i, p in enumerate(prompts):
                req = engine_pb2.GenerateRequest(request_id=f"{tag}-{i}",
                                                 prompt_token_ids=list(p),
                                                 sampling_params=_params(output_len))
                calls.append(functools.partial(stub.Generate, req, timeout=1800,
                                               metadata=engine_metadata))
        else:
            rstub = router_pb2_grpc.RouterStub(channel)
            for p in prompts:
                rreq = build_request(prompt_token_ids=list(p), params=_params(output_len))
                calls.append(functools.partial(rstub.Generate, rreq, timeout=1800))
        start = time.perf_counter()
        results = await asyncio.gather(*(_one(c()) for c in calls))
        wall = time.perf_counter() - start
    ttft = [1000 * (a[0] - s) for s, a in results if a]
    tpot = [1000 * (a[-1] - a[0]) / (len(a) - 1) for _, a in results if len(a) > 1]
    done = sum(1 for _, a in results if len(a) == output_len)
    return {"mode": mode, "completed": done, "wall_s": wall, "req_per_s": done / wall,
            **_stats("ttft", ttft), **_stats("tpot", tpot)}


def _stats(name: str, values: list[float]) -> Row:
    if not values:
        return {f"{name}_mean_ms": None, f"{name}_median_ms": None, f"{name}_p99_ms": None}
    ordered = sorted(values)
    return {f"{name}_mean_ms": statistics.fmean(values),
            f"{name}_median_ms": statistics.median(values),
            f"{name}_p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]}


def measure(engine_address: str, router_address: str, *, vocab: int, num_prompts: int,
            input_len: int, output_len: int, rounds: int, seed: int,
            engine_metadata: Metadata = ()) -> Row:
    """Alternate engine/router for `rounds` rounds each (after one small warm-up of each).
    `engine_metadata`: what the engine requires of callers (the fleet's router credential)."""
    rng = random.Random(seed)
    address = {"engine": engine_address, "router": router_address}
    for mode in MODES:  # warm-up: connections, first-step costs
        asyncio.run(_round(address[mode], mode, random_prompts(rng, 2, 16, 16, vocab, set()),
                           4, f"warm-{mode}", engine_metadata))
    samples: dict[str, list[Row]] = {m: [] for m in MODES}
    for r in range(rounds):
        order = MODES if r % 2 == 0 else MODES[::-1]
        for mode in order:
            prompts = random_prompts(rng, num_prompts, input_len, input_len, vocab, set())
            samples[mode].append(asyncio.run(
                _round(address[mode], mode, prompts, output_len, f"r{r}-{mode}",
                       engine_metadata)))
    summary: Row = {}
    for mode, rows in samples.items():
        summary[mode] = {
            "req_per_s": statistics.median(x["req_per_s"] for x in rows),
            "completed": [x["completed"] for x in rows],
            **{k: statistics.fmean(x[k] for x in rows if x[k] is not None)
               for k in ("ttft_mean_ms", "ttft_median_ms", "ttft_p99_ms",
                         "tpot_mean_ms", "tpot_median_ms", "tpot_p99_ms")},
            "rounds": rows,
        }
    eng, rou = summary["engine"]["req_per_s"], summary["router"]["req_per_s"]
    summary["router_over_engine"] = rou / eng if eng else None
    return summary
