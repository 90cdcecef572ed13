"""A named thread shows its name in /proc (kvfleet.runtime.thread_names), cut to 15 bytes."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from kvfleet.runtime.thread_names import name_os_thread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux comm")


def _comm_in_thread(name: str, explicit: str | None) -> str:
    seen: list[str] = []

    def work() -> None:
        name_os_thread(explicit)
        seen.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip())

    thread = threading.Thread(target=work, name=name)
    thread.start()
    thread.join()
    return seen[0]


def test_the_python_name_becomes_the_os_name() -> None:
    assert _comm_in_thread("engine-loop", None) == "engine-loop"


def test_an_explicit_name_wins_and_long_names_are_cut_to_fifteen_bytes() -> None:
    assert _comm_in_thread("ignored", "redis-publisher-extra") == "redis-publisher"
