"""What a streamed token costs through the router: `python -m benchmarks.stream_overhead`.

Set-up: one local fleet (Redis, the tokenizer service, one engine, the router, metrics on),
by default on the tests' tiny model (a 2-layer random Llama, so the model step is cheap and
the serving path's own cost shows). Each mode streams `--requests` greedy requests,
`--concurrency` at a time, `--output-len` tokens each (EOS ignored): straight from the
engine (gRPC), through the router's gRPC API, and through its OpenAI HTTP API with
`--logprobs` top logprobs.

Reported per mode: output tokens per second over the mode's wall time, inter-token time per
stream (median), CPU time per token of each process (router, tokenizer, engine; from
/proc), and tokenizer RPCs per request by method (the tokenizer's Prometheus counter; a
DetokenizeStream call carries one message per token). The router's per-token overhead is a
router row minus the engine row. Timings are noisy on a shared machine: the load average
is printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

from benchmarks.one_engine_fleet import one_engine_fleet
from benchmarks.proc_cpu import cpu_seconds
from kvfleet.fleet import Fleet
from kvfleet.router_client import build_request
from kvfleet.runtime.service_auth import credential_metadata, read_secret
from kvfleet.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2_grpc

PROMPT_IDS = [3 + (7 * i) % 400 for i in range(24)]
Stream = Callable[[int], list[float]]


def tokenizer_calls(fleet: Fleet) -> Counter[str]:
    assert fleet.tokenizer is not None
    url = f"http://{fleet.config.host}:{fleet.tokenizer.metrics_port}/metrics"
    calls: Counter[str] = Counter()
    with urllib.request.urlopen(url, timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("kvfleet:tokenizer_requests_total{"):
                labels, value = line.rsplit(" ", 1)
                method = labels.split('method="', 1)[1].split('"', 1)[0].rsplit("/", 1)[-1]
                calls[method] += int(float(value))
    return calls


def sampling(output_len: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


def arrival_times(messages: Iterable[Any], has_tokens: Callable[[Any], bool]) -> list[float]:
    return [time.perf_counter() for message in messages if has_tokens(message)]


def engine_stream(address: str, output_len: int, metadata: tuple[tuple[str, str], ...]) -> Stream:
    """Straight to the engine, presenting the router credential (engines serve routers only)."""

    def run(index: int) -> list[float]:
        with grpc.insecure_channel(address) as channel:
            request = engine_pb2.GenerateRequest(
                request_id=f"bench-{index}", prompt_token_ids=PROMPT_IDS,
                sampling_params=sampling(output_len),
            )
            call = engine_pb2_grpc.EngineStub(channel).Generate(
                request, timeout=300, metadata=metadata)
            return arrival_times(call, lambda m: bool(m.token_ids))

    return run


def router_stream(address: str, output_len: int) -> Stream:
    def run(index: int) -> list[float]:
        with grpc.insecure_channel(address) as channel:
            request = build_request(prompt_token_ids=PROMPT_IDS, params=sampling(output_len))
            call = router_pb2_grpc.RouterStub(channel).Generate(request, timeout=300)
            return arrival_times(call, lambda m: bool(m.token_ids))

    return run


def http_stream(base_url: str, output_len: int, logprobs: int) -> Stream:
    body = json.dumps({
        "prompt": PROMPT_IDS, "max_tokens": output_len, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "logprobs": logprobs,
    }).encode()

    def run(index: int) -> list[float]:
        request = urllib.request.Request(
            f"{base_url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            lines = (line for line in response if line.startswith(b"data: {"))
            return arrival_times(lines, lambda line: b'"token_logprobs": [' in line
                                 and b'"token_logprobs": []' not in line)

    return run


def run_mode(fleet: Fleet, name: str, stream: Stream, args: argparse.Namespace) -> dict:
    services = [s for s in (fleet.router, fleet.tokenizer, fleet.engines[0]) if s]
    calls_before = tokenizer_calls(fleet)
    cpu_before = [cpu_seconds(s.pid) for s in services]
    started = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        streams = list(pool.map(stream, range(args.requests)))
    elapsed = time.perf_counter() - started
    num_tokens = sum(len(times) for times in streams)
    calls = tokenizer_calls(fleet)
    calls.subtract(calls_before)
    return {
        "mode": name,
        "tokens_per_s": round(num_tokens / elapsed, 1),
        "ms_per_token_per_stream": round(1000 * statistics.median(
            (t[-1] - t[0]) / (len(t) - 1) for t in streams), 3),
        "cpu_ms_per_token": {
            s.name: round(1000 * (cpu_seconds(s.pid) - before) / num_tokens, 3)
            for s, before in zip(services, cpu_before, strict=True)
        },
        "tokenizer_calls_per_request": {
            method: count / args.requests for method, count in sorted(calls.items()) if count
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the tests' tiny model")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--logprobs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvfleet-bench-") as tmp:
        model_dir = args.model
        if model_dir is None:
            from tests.fixtures.tiny_model import build_tiny_model_dir

            model_dir = build_tiny_model_dir(Path(tmp) / "tiny")
        with one_engine_fleet(model_dir, metrics=True, engine_threads=1) as fleet:
            router_stream(fleet.router_address, 8)(0)  # warm-up
            modes = {
                "engine grpc": engine_stream(
                    fleet.engines[0].address, args.output_len,
                    credential_metadata(read_secret(fleet.router_secret_file))),
                "router grpc": router_stream(fleet.router_address, args.output_len),
                f"router http logprobs={args.logprobs}": http_stream(
                    fleet.http_url, args.output_len, args.logprobs),
            }
            print(json.dumps({"load_average": os.getloadavg(), "args": vars(args)}, default=str))
            for name, stream in modes.items():
                print(json.dumps(run_mode(fleet, name, stream, args)))
            print(json.dumps({"load_average": os.getloadavg()}))


if __name__ == "__main__":
    main()
