"""Shared-memory segments for same-host KV transfers (engine.disagg.shm_connector).

Role: a segment is one file in the shared-memory directory (/dev/shm), created by the
prefill engine, mapped by both engines: the prefill engine writes a request's blocks into
it, the decode engine copies them into its cache. This module names, creates, opens,
removes and sweeps segments, keeps a prefill engine's few idle ones for reuse
(`SegmentPool`: a fresh segment's pages cost more to fault in than the blocks to copy), and
says which host a process runs on.

Invariants:
- Names are `kvfleet-kv.<host tag>.<creator pid>.<32 hex>`: a receiver opens only a name
  of that form inside its own shared-memory directory (never a caller's path).
- A segment is reused only after the transfer that used it succeeded (the receiver has
  copied everything); one whose transfer failed is unlinked at once. A one-shot segment is
  unlinked by the receiver right after mapping it (the mapping outlives the name).
- The pool unlinks what it does not keep and everything at close; segments of an engine
  killed meanwhile are removed by its host's next sweep (at an engine's start: their
  creator pid is gone).
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import re
import socket
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_SHM_DIR = Path("/dev/shm")
# Idle segments a sender keeps for reuse (each as large as the largest transfer it served).
DEFAULT_MAX_IDLE = 2
PREFIX = "kvfleet-kv"
_NAME = re.compile(rf"^{PREFIX}\.([0-9a-f]{{8}})\.([0-9]+)\.[0-9a-f]{{32}}$")
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def host_id() -> str:
    """This machine's identity for the same-host check: hostname and kernel boot id (two
    containers of one pod share both; two machines never share the boot id)."""
    try:
        boot = _BOOT_ID.read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _host_tag() -> str:
    return hashlib.sha256(host_id().encode()).hexdigest()[:8]


def check_name(name: str) -> None:
    """ValueError naming the field unless `name` is a segment name (no path, our form)."""
    if not _NAME.match(name):
        raise ValueError(f"shm.name: {name[:80]!r} is not a KV segment name")


@dataclass
class Segment:
    """One mapped segment of `capacity` bytes; `tensor` views its start without copying."""

    path: Path
    capacity: int
    _map: mmap.mmap | None

    @property
    def name(self) -> str:
        return self.path.name

    def tensor(self, num_bytes: int) -> torch.Tensor:
        if self._map is None:
            raise ValueError(f"segment {self.name} is closed")
        return torch.frombuffer(self._map, dtype=torch.uint8, count=num_bytes)

    def close(self) -> None:
        """Let the mapping go: it is unmapped once no tensor views it any more. Never
        unmapped here: a torch.frombuffer tensor keeps the mmap object alive but holds no
        buffer export on it, so mmap.close() would succeed under a live tensor (an export
        still referenced, say) and leave it reading unmapped memory."""
        self._map = None

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def create(directory: Path, capacity: int) -> Segment:
    """A new segment of `capacity` bytes (at least 1), readable and writable by this user
    only; OSError if the directory has no room (nothing is left behind)."""
    capacity = max(1, capacity)
    name = f"{PREFIX}.{_host_tag()}.{os.getpid()}.{uuid.uuid4().hex}"
    path = directory / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        # Allocated now: a full /dev/shm (64 MB in a default Docker container) is an OSError
        # here, not a SIGBUS when the pages are first written.
        os.posix_fallocate(fd, 0, capacity)
        mapped = mmap.mmap(fd, capacity)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        raise
    os.close(fd)
    return Segment(path, capacity, mapped)


def open_segment(directory: Path, name: str, num_bytes: int, unlink: bool) -> Segment:
    """Map an existing segment (all of it), and remove its name at once if `unlink` (a
    one-shot segment). FileNotFoundError if it is not here; ValueError if it is smaller
    than `num_bytes`."""
    check_name(name)
    path = directory / name
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if size < max(1, num_bytes):
            raise ValueError(f"shm.num_bytes: {num_bytes}, the segment has {size} bytes")
        mapped = mmap.mmap(fd, size)
    finally:
        os.close(fd)
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    return Segment(path, size, mapped)


class MappedSegments:
    """A receiver's mappings of senders' reused segments, kept across transfers: mapping a
    segment afresh faults every page in again on each transfer. A mapping is dropped once
    its sender unlinked the segment (names are never reused), or when more than `max_kept`
    are held (the least recently used goes)."""

    def __init__(self, directory: Path, max_kept: int = 8) -> None:
        self.directory = directory
        self._max_kept = max_kept
        self._kept: dict[str, Segment] = {}

    def open(self, name: str, num_bytes: int, reused: bool) -> tuple[Segment, bool]:
        """The segment, and whether the caller owns it (closes it when done): a one-shot
        one it does; a kept one it does not."""
        if not reused:
            return open_segment(self.directory, name, num_bytes, unlink=True), True
        for gone in [n for n, seg in self._kept.items() if not seg.path.exists()]:
            self._kept.pop(gone).close()
        segment = self._kept.pop(name, None)
        if segment is None or segment.capacity < num_bytes:
            if segment is not None:
                segment.close()
            segment = open_segment(self.directory, name, num_bytes, unlink=False)
        self._kept[name] = segment  # the most recently used last
        while len(self._kept) > self._max_kept:
            self._kept.pop(next(iter(self._kept))).close()
        return segment, False

    def __len__(self) -> int:
        return len(self._kept)

    def close(self) -> None:
        for segment in self._kept.values():
            segment.close()
        self._kept.clear()


class SegmentPool:
    """A sender's segments: `take` one that fits (a kept one if any), then `keep` it after a
    successful transfer or `discard` it after a failed one. At most `max_idle` are kept.
    Any thread (the engine thread takes segments for exports, the event loop returns them)."""

    def __init__(self, directory: Path, max_idle: int = DEFAULT_MAX_IDLE) -> None:
        self._dir = directory
        self._max_idle = max_idle
        self._idle: list[Segment] = []
        self._lock = threading.Lock()
        self._closed = False

    def take(self, num_bytes: int) -> Segment:
        with self._lock:
            fitting = [s for s in self._idle if s.capacity >= num_bytes]
            if fitting:
                segment = min(fitting, key=lambda s: s.capacity)
                self._idle.remove(segment)
                return segment
        return create(self._dir, num_bytes)

    def keep(self, segment: Segment) -> None:
        with self._lock:
            if self._closed:  # an export's transfer that ended after close
                dropped = [segment]
            else:
                self._idle.append(segment)
                self._idle.sort(key=lambda s: s.capacity)
                dropped = self._idle[: max(0, len(self._idle) - self._max_idle)]
                del self._idle[: len(dropped)]  # the smallest go first
        for old in dropped:
            self.discard(old)

    @staticmethod
    def discard(segment: Segment) -> None:
        segment.close()
        segment.unlink()

    def close(self) -> None:
        with self._lock:
            idle, self._idle, self._closed = self._idle, [], True
        for segment in idle:
            self.discard(segment)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def sweep(directory: Path) -> list[str]:
    """Remove this host's segments whose creator is dead (an engine killed mid-transfer);
    the names removed."""
    tag = _host_tag()
    removed: list[str] = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for path in entries:
        match = _NAME.match(path.name)
        if match is None or match.group(1) != tag or _alive(int(match.group(2))):
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path.name)
    return removed


def segments_of(directory: Path, pid: int) -> list[str]:
    """The names of the segments `pid` created here (tests: none may be left over)."""
    return sorted(p.name for p in directory.iterdir()
                  if (m := _NAME.match(p.name)) is not None and int(m.group(2)) == pid)
