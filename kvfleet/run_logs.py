"""Where `kvfleet up` keeps its services' logs, and `kvfleet logs` reading them back.

Layout: `<cache>/logs/<run>/<service>.log` with `<cache>` = $KVFLEET_CACHE_DIR or
~/.cache/kvfleet (read when called, never on import) and `<run>` = `YYYYmmdd-HHMMSS-<pid>`,
one directory per `kvfleet up`; `<cache>/logs/latest` points at the newest run.

Rotation is by run: starting a run deletes all but the newest `KEEP_RUNS - 1` older ones.
A service writes its log through its own stdout, so a file is never cut while its
service runs; one run's logs are bounded by what its services print.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

KEEP_RUNS = 10
LATEST = "latest"
LOG_SUFFIX = ".log"
# How often `follow` looks for new lines.
FOLLOW_POLL_S = 0.25


def logs_root() -> Path:
    """$KVFLEET_CACHE_DIR/logs (default ~/.cache/kvfleet/logs)."""
    cache = os.environ.get("KVFLEET_CACHE_DIR") or str(Path.home() / ".cache" / "kvfleet")
    return Path(cache) / "logs"


def new_run_dir(root: Path | None = None, keep: int = KEEP_RUNS) -> Path:
    """A fresh run directory under `root`, `latest` pointed at it, old runs pruned."""
    root = root if root is not None else logs_root()
    root.mkdir(parents=True, exist_ok=True)
    run = root / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    run.mkdir()
    _prune(root, keep)
    _point_latest(root, run)
    return run


def latest_run_dir(root: Path | None = None) -> Path | None:
    """The newest run directory under `root`, or None when there is none."""
    root = root if root is not None else logs_root()
    runs = _runs(root)
    return runs[-1] if runs else None


def service_logs(run: Path) -> dict[str, Path]:
    """{service name: log file} of a run, in name order."""
    return {p.name[: -len(LOG_SUFFIX)]: p for p in sorted(run.glob(f"*{LOG_SUFFIX}"))}


def tail_lines(path: Path, num_lines: int) -> list[str]:
    """The last `num_lines` lines of `path` (reads the whole file: logs of one run)."""
    if num_lines <= 0:
        return []
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    return lines[-num_lines:]


def print_tails(logs: dict[str, Path], num_lines: int, out: TextIO | None = None) -> None:
    """Each log's last lines; with several logs, each line prefixed by its service."""
    out = out or sys.stdout  # looked up per call: sys.stdout may be replaced
    for name, path in logs.items():
        for line in tail_lines(path, num_lines):
            out.write(_prefixed(name, line, len(logs) > 1))
    out.flush()


def follow(logs: dict[str, Path], out: TextIO | None = None,
           stop_after_s: float | None = None) -> None:
    """Print lines appended to `logs` from now on, until interrupted (or `stop_after_s`)."""
    out = out or sys.stdout
    files = {name: open(path, encoding="utf-8", errors="replace")  # noqa: SIM115
             for name, path in logs.items()}
    deadline = None if stop_after_s is None else time.monotonic() + stop_after_s
    try:
        for f in files.values():
            f.seek(0, os.SEEK_END)
        while deadline is None or time.monotonic() < deadline:
            wrote = False
            for name, f in files.items():
                for line in iter(f.readline, ""):
                    out.write(_prefixed(name, line, len(files) > 1))
                    wrote = True
            if wrote:
                out.flush()
            time.sleep(FOLLOW_POLL_S)
    finally:
        for f in files.values():
            f.close()


def select_logs(run: Path, services: Sequence[str]) -> dict[str, Path]:
    """The run's logs for `services` (all when empty); KeyError naming an unknown one."""
    logs = service_logs(run)
    if not services:
        return logs
    unknown = [s for s in services if s not in logs]
    if unknown:
        raise KeyError(f"no log for {', '.join(unknown)} in {run}; "
                       f"services: {', '.join(logs) or 'none'}")
    return {s: logs[s] for s in services}


def _prefixed(name: str, line: str, prefix: bool) -> str:
    line = line if line.endswith("\n") else line + "\n"
    return f"{name:<10}| {line}" if prefix else line


def _runs(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    # Names start with the start time, so name order is age order.
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink())


def _prune(root: Path, keep: int) -> None:
    runs = _runs(root)
    for old in runs[: max(0, len(runs) - max(1, keep))]:
        shutil.rmtree(old, ignore_errors=True)


def _point_latest(root: Path, run: Path) -> None:
    link = root / LATEST
    staged = root / f".{LATEST}-{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        staged.unlink()
    staged.symlink_to(run.name)
    os.replace(staged, link)  # atomic: a concurrent `kvfleet logs` sees old or new
