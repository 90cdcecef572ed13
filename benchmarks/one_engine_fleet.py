"""The one-engine local fleet the serving-path benchmarks start, and its processes' CPU time.

Role: what `benchmarks.stream_overhead` and `benchmarks.defaults_cpu` share: a started
`kvfleet.fleet.Fleet` with one engine whose service logs live in a temporary directory
removed with it, the pid of each of its processes by service name, and a process's (or a
thread's) CPU seconds from /proc (Linux).

Invariant: CPU seconds read 0.0 for a process or thread that is gone, so a benchmark's
after-minus-before never stops on one that exited in between.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvfleet.fleet import Fleet, FleetConfig

TICK = os.sysconf("SC_CLK_TCK")


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


def stat_cpu(path: Path) -> float:
    """utime + stime of one /proc stat file (a process's or a task's), in seconds."""
    try:
        fields = path.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def cpu_seconds(pid: int) -> float:
    """CPU seconds a process has used so far, all its threads."""
    return stat_cpu(Path(f"/proc/{pid}/stat"))
