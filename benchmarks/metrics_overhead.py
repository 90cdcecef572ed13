"""What Prometheus metrics cost an engine: `python -m benchmarks.metrics_overhead`.

Metrics are on by default, so their cost must be negligible. Two parts, in one process:

- Collection: a real `LLMEngine` behind an `AsyncEngine` with `EngineMetrics` attached, as
  the engine service runs it, serves `--requests` concurrent greedy requests of
  `--output-len` tokens; the metric listeners (per step: gauges and counters; per request
  update: histograms) are timed on the engine thread and reported per step and as a share
  of the engine's busy time. By default the model is the tests' tiny model (2 layers), whose
  steps are far cheaper than any real model's, so the share shown is an upper bound.
- Scraping: the populated registry served by the metrics endpoint is fetched `--scrapes`
  times over HTTP; the time of one scrape is CPU the engine process spends per Prometheus
  scrape interval (15-30 s usually). An endpoint nobody scrapes costs nothing.

Figures are noisy on a shared machine; the load average is printed with them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.service.async_engine import AsyncEngine
from engine.service.metrics import EngineMetrics
from kvfleet.contracts.sampling_params import SamplingParams
from kvfleet.runtime.metrics import MetricsEndpoint


class Timed:
    """A listener wrapper adding up the time spent in it (engine thread only)."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self._fn = fn
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, *args: Any) -> None:
        started = time.perf_counter()
        self._fn(*args)
        self.seconds += time.perf_counter() - started
        self.calls += 1


async def serve_requests(engine: AsyncEngine, requests: int, output_len: int) -> float:
    """Start `engine` (on this loop), serve the requests, stop it; the serving wall time."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)

    async def one(index: int) -> None:
        prompt = [3 + (7 * i + index) % 400 for i in range(24)]
        async for _ in engine.generate(f"r{index}", prompt, params):
            pass

    engine.start()
    try:
        started = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(requests)))
        return time.perf_counter() - started
    finally:
        await engine.shutdown()


def measure(model: Path, requests: int, output_len: int, scrapes: int) -> dict[str, Any]:
    llm = LLMEngine(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=1024))
    engine = AsyncEngine(llm)
    metrics = EngineMetrics(model.name, llm.max_model_len)
    on_step, on_updates = Timed(metrics.on_step), Timed(metrics.on_updates)
    # attach() registers the bound methods it finds on the instance: the timed wrappers.
    metrics.on_step = on_step  # type: ignore[method-assign]
    metrics.on_updates = on_updates  # type: ignore[method-assign]
    metrics.attach(engine)
    wall = asyncio.run(serve_requests(engine, requests, output_len))
    steps = engine.progress.iterations
    listener_s = on_step.seconds + on_updates.seconds

    endpoint = MetricsEndpoint(metrics.registry, "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{endpoint.port}/metrics"
        times, size = [], 0
        for _ in range(scrapes):
            started = time.perf_counter()
            with urllib.request.urlopen(url, timeout=10) as reply:
                size = len(reply.read())
            times.append(time.perf_counter() - started)
    finally:
        endpoint.close()
    return {
        "model": model.name, "requests": requests, "output_len": output_len,
        "steps": steps, "wall_s": round(wall, 3),
        "listener_us_per_step": round(1e6 * listener_s / max(1, steps), 1),
        "step_ms_mean": round(1e3 * wall / max(1, steps), 2),
        "listener_share_of_wall_pct": round(100 * listener_s / wall, 3),
        "scrape_ms_median": round(1e3 * statistics.median(times), 2),
        "exposition_bytes": size,
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the tests' tiny model")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--scrapes", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from tests.fixtures.tiny_model import build_tiny_model_dir

            model = build_tiny_model_dir(Path(tmp) / "tiny")
        print(json.dumps(measure(model, args.requests, args.output_len, args.scrapes)))


if __name__ == "__main__":
    main()
