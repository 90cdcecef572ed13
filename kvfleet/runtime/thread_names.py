"""Give the calling thread its Python name at the OS level too (Linux `comm`, 15 bytes).

Role: `top -H`, `/proc/PID/task/*/comm` and `benchmarks.defaults_cpu` then tell a service's
threads apart (the engine loop, the Redis publisher, torch's compute threads, the event
loop), which is how CPU time spent outside the model is found. Invariant: best effort, never
raises (other platforms, a libc without prctl: the OS name just stays the process's).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading

_PR_SET_NAME = 15  # linux/prctl.h
_COMM_LEN = 15  # TASK_COMM_LEN - 1 (the kernel keeps 16 bytes with the NUL)


def name_os_thread(name: str | None = None) -> None:
    """Set the calling thread's OS name to `name` (default: its Python name)."""
    if not sys.platform.startswith("linux"):
        return
    label = (name or threading.current_thread().name).encode("ascii", "replace")[:_COMM_LEN]
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(label), 0, 0, 0)
    except (OSError, AttributeError):
        return
