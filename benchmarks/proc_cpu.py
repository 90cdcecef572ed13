"""CPU seconds of a process or one of its threads, from /proc (Linux), for the benchmarks that
report where a serving path spends CPU (defaults_cpu, stream_overhead, disagg_bench).

Invariant: a process or thread that is gone reads 0.0, so a benchmark's after-minus-before
never stops on one that exited in between.
"""

from __future__ import annotations

import os
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


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
