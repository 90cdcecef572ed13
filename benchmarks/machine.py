"""What the benchmark ran on: the CPU, its ISA flags that decide the kernels, the allocator.

Read once per run from /proc (Linux); on other systems the fields say "unknown" rather than
fail, since the figures are still worth having.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

# The flags that select the matmul / attention kernels of torch, kvfleet and vLLM on x86.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
TCMALLOC_SONAME = "libtcmalloc_minimal.so.4"
_ALLOCATORS = (("tcmalloc", "tcmalloc"), ("jemalloc", "jemalloc"), ("mimalloc", "mimalloc"))


def cpu_info() -> dict[str, Any]:
    """Model name, logical CPU count, the ISA flags present (and those absent)."""
    text = ""
    with contextlib.suppress(OSError):
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8")
    name = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    flags_line = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
    flags = set(flags_line.group(1).split()) if flags_line else set()
    return {
        "model_name": name.group(1).strip() if name else platform.processor() or "unknown",
        "logical_cpus": os.cpu_count(),
        "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "isa": {f: f in flags for f in ISA_FLAGS},
    }


def allocator_of(pid: int | str = "self") -> str:
    """The malloc the process has mapped: tcmalloc/jemalloc/mimalloc if loaded, else glibc."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text(encoding="utf-8")
    except OSError:
        return "unknown"
    for needle, name in _ALLOCATORS:
        if needle in maps:
            return name
    return "glibc malloc"


def find_tcmalloc() -> str | None:
    """Full path of libtcmalloc_minimal.so.4 from the dynamic linker's cache, or None."""
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=False,
                             timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    for line in out.splitlines():
        if line.strip().startswith(TCMALLOC_SONAME) and "=>" in line:
            path = line.split("=>", 1)[1].strip()
            if Path(path).exists():
                return path
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib"):
        if (Path(d) / TCMALLOC_SONAME).exists():
            return str(Path(d) / TCMALLOC_SONAME)
    return None

