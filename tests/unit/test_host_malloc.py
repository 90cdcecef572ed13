"""engine.worker.host_malloc: glibc takes the settings (the engine calls this once at start)."""

from __future__ import annotations

import platform

import pytest

from engine.worker.host_malloc import tune_for_reuse


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_glibc_accepts_every_setting() -> None:
    assert tune_for_reuse() is True
