"""The one-engine local fleet the serving-path benchmarks start, and its processes' CPU time.

Role: what `benchmarks.stream_overhead` and `benchmarks.defaults_cpu` share: a started
`kvfleet.fleet.Fleet` with one engine whose service logs live in a temporary directory
removed with it, and the pid of each of its processes by service name (their CPU seconds:
`benchmarks.proc_cpu`).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvfleet.fleet import Fleet, FleetConfig


@contextlib.contextmanager
def one_engine_fleet(model_dir: Path, prefix: str = "kvfleet-bench-",
                     **fields: Any) -> Iterator[Fleet]:
    """A started fleet of one engine on `model_dir` (other `FleetConfig` fields as given), its
    logs in a temporary directory named `prefix`...; stopped and removed on exit."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        config = FleetConfig(model_dir=model_dir, num_engines=1, log_dir=Path(tmp) / "logs",
                             **fields)
        with Fleet(config) as fleet:
            yield fleet


def service_pids(fleet: Fleet, redis: bool = False) -> dict[str, int]:
    """Service name -> pid: router, tokenizer, engines, and with `redis` the fleet's own Redis
    (none when it was given a URL)."""
    pids = {s.name: s.pid for s in (fleet.router, fleet.tokenizer, *fleet.engines) if s}
    if redis and fleet.redis is not None and fleet.redis._process is not None:
        pids["redis"] = fleet.redis._process.pid
    return pids
