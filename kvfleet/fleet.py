"""A local kvfleet: Redis, a tokenizer, N engines and a router, each its own process.

Role: what `kvfleet up` (and the tests and the serving benchmark) run. Every service is
started with `--port 0 --port-file F`, so ports are discovered, never guessed; a service is
ready once its port file exists and the gRPC health check answers SERVING.

Invariants:
- Start order: Redis (a real `redis-server` on a free port unless a URL is given), tokenizer,
  engines (launched together, then awaited), router. A failure at any step stops what was
  started and raises `FleetError` with the failing service's log tail.
- Stop order: router, engines, tokenizer, Redis: each gets SIGTERM (graceful drain), then
  SIGKILL after `stop_timeout_s`. Engines deregister from Redis while it is still up.
- No orphans: every child (Redis too) runs in its own session, so a terminal's Ctrl-C
  reaches only `kvfleet up`, which then stops them in order, and on Linux gets SIGTERM if
  the process that started it dies, even by SIGKILL (PR_SET_PDEATHSIG; see `_CHILD_SHIM`).
- Each service's stdout/stderr go to `<log_dir>/<name>.log`.
- Engines serve only the fleet's routers: a random secret in `<log_dir>/router-secret`
  (mode 0600, deleted at stop) is given to both as `--router-secret-file`.
- The fleet's own Redis requires a generated password (`<log_dir>/redis-password`, 0600,
  deleted at stop), which services get as `--redis-password-file`: no secret is ever on a
  service's command line. `redis_url` (with the password) is for clients in this process.
- With `tls`, every gRPC hop is mutual TLS and the router's HTTP API is HTTPS, with
  certificates from a throwaway CA (kvfleet.fleet_credentials, docs/tls.md).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvfleet.fleet_config import (
    DEFAULT_START_TIMEOUT_S,
    DEFAULT_STOP_TIMEOUT_S,
    FleetConfig,
    engine_command,
    engine_id,
    format_host,
    router_command,
    tokenizer_command,
)
from kvfleet.fleet_credentials import FleetCredentials
from kvfleet.redis_server import RedisServer, find_redis_server
from kvfleet.runtime.tls import ROUTER_ROLE, TOKENIZER_ROLE, name_options

# Re-exported: callers import the fleet's configuration and command lines from here.
__all__ = [
    "DEFAULT_START_TIMEOUT_S", "DEFAULT_STOP_TIMEOUT_S", "Fleet", "FleetConfig", "FleetError",
    "ServiceProcess", "engine_command", "engine_id", "router_command", "tokenizer_command",
    "wait_until_serving",
]
# Every child starts through this shim, then execs the real program (same pid):
# - its own session, so a terminal's Ctrl-C reaches only the fleet's owner, which then stops
#   the services in order (Redis included: it would otherwise quit first);
# - on Linux, PR_SET_PDEATHSIG: SIGTERM when the owner dies, even by SIGKILL (no orphans);
# - its CPU priority (nice) and CPU set, if the fleet gives them, before exec: every thread the
#   service later starts (torch's OpenMP pool, gRPC's) inherits them.
# Done after fork in a fresh interpreter rather than with Popen(preexec_fn=...): running
# Python between fork and exec in a process with gRPC threads can deadlock.
_CHILD_SHIM = """\
import os, signal, sys
parent = os.getppid()
os.setsid()
if sys.platform == "linux":
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)
    if parent == 1 or os.getppid() != parent:
        sys.exit(1)  # the owner died before the death signal was armed
if NICE:
    os.nice(NICE)
if CPUS:
    os.sched_setaffinity(0, CPUS)
argv = TARGET + sys.argv[1:]
os.execv(argv[0], argv)
"""
_POLL_S = 0.05


class FleetError(RuntimeError):
    """A service did not come up (the message carries its log tail)."""


@dataclass
class ServiceProcess:
    """One started service: its process, its port file and log."""

    name: str
    process: subprocess.Popen[bytes]
    port_file: Path
    log_path: Path
    host: str
    port: int | None = None
    metrics_port_file: Path | None = None
    http_port_file: Path | None = None
    # TLS fleets: what health checks dial with, and the name the certificate must carry.
    credentials: grpc.ChannelCredentials | None = None
    tls_name: str | None = None

    @property
    def http_port(self) -> int:
        """The bound OpenAI HTTP API port (routers, once ready)."""
        if self.http_port_file is None:
            raise RuntimeError(f"{self.name} serves no HTTP API")
        return int(self.http_port_file.read_text().strip())

    @property
    def metrics_port(self) -> int:
        """The bound /metrics port (fleets started with metrics=True, once ready)."""
        if self.metrics_port_file is None:
            raise RuntimeError(f"{self.name} serves no metrics")
        return int(self.metrics_port_file.read_text().strip())

    @property
    def metrics_url(self) -> str:
        return f"http://{format_host(self.host)}:{self.metrics_port}/metrics"

    @property
    def address(self) -> str:
        if self.port is None:
            raise RuntimeError(f"{self.name} is not ready")
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, num_chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return "(no log)"

    def terminate(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()

    def wait(self, timeout_s: float, force: threading.Event | None = None) -> None:
        """Wait for exit; SIGKILL after `timeout_s`, or as soon as `force` is set."""
        deadline = time.monotonic() + timeout_s
        while self.process.poll() is None:
            if time.monotonic() >= deadline or (force is not None and force.is_set()):
                self.process.kill()
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(_POLL_S)
        self.process.wait()


@dataclass
class Fleet:
    """Start with `start()` (or `with Fleet(config) as fleet:`), stop with `stop()`."""

    config: FleetConfig
    redis: RedisServer | None = None
    tokenizer: ServiceProcess | None = None
    engines: list[ServiceProcess] = field(default_factory=list)
    router: ServiceProcess | None = None
    # More routers on the same engines (e.g. one per policy in the serving benchmark).
    extra_routers: list[ServiceProcess] = field(default_factory=list)
    _log_dir: Path | None = None
    _tmp: tempfile.TemporaryDirectory[str] | None = None
    _credentials: FleetCredentials | None = None
    _force: threading.Event = field(default_factory=threading.Event)

    @property
    def redis_url(self) -> str:
        """Redis's URL for clients in this process (with the password when it has one)."""
        if self.config.redis_url:
            return self.config.redis_url
        if self.redis is None:
            raise RuntimeError("fleet not started")
        return self.redis.url

    @property
    def _service_redis_url(self) -> str:
        """The URL services get: the password goes to them in a file."""
        if self.config.redis_url:
            return self.config.redis_url
        if self.redis is None:
            raise RuntimeError("fleet not started")
        return self.redis.url_without_password

    @property
    def router_address(self) -> str:
        if self.router is None:
            raise RuntimeError("fleet not started")
        return self.router.address

    @property
    def http_url(self) -> str:
        """The router's OpenAI API base, e.g. http://127.0.0.1:8000 (append /v1)."""
        if self.router is None:
            raise RuntimeError("fleet not started")
        scheme = "https" if self.config.tls else "http"
        return f"{scheme}://{format_host(self.config.host)}:{self.router.http_port}"

    @property
    def log_dir(self) -> Path:
        if self._log_dir is None:
            raise RuntimeError("fleet not started")
        return self._log_dir

    @property
    def router_secret_file(self) -> Path:
        """The shared secret engines require of routers (0600, removed when the fleet stops)."""
        return self.credentials.router_secret_file

    @property
    def credentials(self) -> FleetCredentials:
        """The fleet's secrets; with TLS its CA and certificates (kvfleet.fleet_credentials)."""
        if self._credentials is None:
            raise RuntimeError("fleet not started")
        return self._credentials

    @property
    def ca_file(self) -> Path | None:
        """The throwaway CA's certificate (TLS fleets): clients verify the router with it."""
        return self.credentials.ca_file

    @property
    def started(self) -> bool:
        return self._log_dir is not None

    def start(self) -> Fleet:
        if self.started:
            raise RuntimeError("fleet already started")
        self._prepare_dirs()
        try:
            if not self.config.redis_url:
                self.redis = RedisServer(
                    host=self.config.host, executable=str(self._redis_shim()),
                    password=self.credentials.redis_password,
                ).start()
            self.tokenizer = self._launch_tokenizer(0)
            self._wait_ready([self.tokenizer])
            self.engines = [
                self.start_engine_process(i) for i in range(len(self.config.engine_roles))
            ]
            self._wait_ready(self.engines)
            self.start_router()
        except BaseException:
            self.stop()
            raise
        return self

    def start_engine_process(self, index: int) -> ServiceProcess:
        """Launch engine `index` (not awaited; see `wait_ready`). Tests restart engines so."""
        name = engine_id(index)
        command = engine_command(self.config, name, self._service_redis_url)
        command += [*self.config.engine_own_args(index),
                    "--router-secret-file", str(self.router_secret_file),
                    *self._redis_flags(), *self.credentials.tls_flags(name)]
        env = None
        if self.config.engine_threads is not None:
            threads = str(self.config.engine_threads)
            env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        return self._launch(name, command, env, tls_name=name,
                            nice=self.config.engine_nice(index),
                            cpus=self.config.engine_cpu_set(index))

    def restart_tokenizer(self, kill: bool = False) -> ServiceProcess:
        """Stop the tokenizer (SIGKILL if `kill`, else a graceful SIGTERM) and start it again
        on the same port, so routers reconnect without being told (fault tests)."""
        old = self.tokenizer
        if old is None or old.port is None:
            raise RuntimeError("fleet not started")
        if kill:
            old.kill()
        else:
            old.terminate()
        old.wait(self.config.stop_timeout_s, self._force)
        self.tokenizer = self._launch_tokenizer(old.port)
        self._wait_ready([self.tokenizer])
        return self.tokenizer

    def start_router(self) -> ServiceProcess:
        """(Re)start the router process and wait until it serves."""
        self.router = self._start_router_process("router", self.config.policy,
                                                 self.config.router_port,
                                                 self.config.router_http_port)
        return self.router

    def add_router(self, name: str, policy: str) -> ServiceProcess:
        """Another router with its own policy over the same engines; stopped with the fleet."""
        router = self._start_router_process(name, policy, 0, 0)
        self.extra_routers.append(router)
        return router

    def _start_router_process(
        self, name: str, policy: str, port: int, http_port: int
    ) -> ServiceProcess:
        assert self.tokenizer is not None
        http_port_file = self.log_dir / f"{name}.http-port"
        http_port_file.unlink(missing_ok=True)
        command = router_command(
            self.config, self.tokenizer.address, self._service_redis_url, policy, port
        ) + ["--http-port", str(http_port), "--http-port-file", str(http_port_file),
             "--router-secret-file", str(self.router_secret_file), *self._redis_flags(),
             *self.credentials.tls_flags("router"), *self.credentials.router_http_flags()]
        router = self._launch(name, command, tls_name=ROUTER_ROLE,
                              cpus=self.config.service_cpus())
        router.http_port_file = http_port_file
        self._wait_ready([router])
        return router

    def wait_ready(self, services: Sequence[ServiceProcess]) -> None:
        self._wait_ready(services)

    def stop(self) -> None:
        """Stop router, engines, tokenizer, Redis, in that order; idempotent."""
        timeout = self.config.stop_timeout_s
        for group in ([self.router, *self.extra_routers], self.engines, [self.tokenizer]):
            services = [s for s in group if s is not None]
            for service in services:
                service.terminate()
            for service in services:
                service.wait(timeout, self._force)
        if self.redis is not None:
            self.redis.stop()
        if self._credentials is not None:  # run logs are kept; the secrets are not
            self._credentials.remove()

    def force_stop(self) -> None:
        """Make a running `stop()` kill what is left instead of waiting (second Ctrl-C)."""
        self._force.set()

    def metrics_urls(self) -> dict[str, str]:
        """Each service's /metrics URL by service name (fleets with metrics on)."""
        return {s.name: s.metrics_url for s in self.processes() if s.metrics_port_file}

    def processes(self) -> list[ServiceProcess]:
        services = (self.router, *self.extra_routers, *self.engines, self.tokenizer)
        return [s for s in services if s is not None]

    def __enter__(self) -> Fleet:
        return self if self.started else self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- internals -------------------------------------------------------------------------

    def _prepare_dirs(self) -> None:
        if self.config.log_dir is not None:
            self._log_dir = self.config.log_dir
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvfleet-")
            self._log_dir = Path(self._tmp.name)
        self._log_dir.mkdir(parents=True, exist_ok=True)
        # Engines serve only callers with the router secret (kvfleet.runtime.service_auth): the
        # fleet's routers, not any local process that finds an engine port.
        engines = [engine_id(i) for i in range(len(self.config.engine_roles))]
        self._credentials = FleetCredentials.create(self._log_dir, engines, self.config.tls,
                                                    self.config.host)

    def _redis_flags(self) -> list[str]:
        """How services authenticate to Redis: the password as a file, never in argv."""
        if self.config.redis_url:
            password_file = self.config.redis_password_file
            return [] if password_file is None else ["--redis-password-file", str(password_file)]
        return ["--redis-password-file", str(self.credentials.redis_password_file)]

    def _launch_tokenizer(self, port: int) -> ServiceProcess:
        command = tokenizer_command(self.config, port) + self.credentials.tls_flags("tokenizer")
        return self._launch("tokenizer", command, tls_name=TOKENIZER_ROLE,
                            cpus=self.config.service_cpus())

    def _redis_shim(self) -> Path:
        """An executable that runs redis-server through the child shim (for RedisServer)."""
        shim = self.log_dir / "redis-server-shim"
        code = _shim_code([find_redis_server()], cpus=self.config.service_cpus())
        shim.write_text(f"#!{sys.executable}\n{code}")
        shim.chmod(0o755)
        return shim

    def _launch(
        self, name: str, command: list[str], env: dict[str, str] | None = None,
        tls_name: str | None = None, nice: int = 0, cpus: tuple[int, ...] = (),
    ) -> ServiceProcess:
        port_file = self.log_dir / f"{name}.port"
        port_file.unlink(missing_ok=True)
        log_path = self.log_dir / f"{name}.log"
        metrics_port_file = None
        if self.config.metrics:
            metrics_port_file = self.log_dir / f"{name}.metrics-port"
            metrics_port_file.unlink(missing_ok=True)
            command = [*command, "--metrics-port", "0",
                       "--metrics-port-file", str(metrics_port_file)]
        else:
            command = [*command, "--no-metrics"]
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-c", _shim_code([], nice, cpus), *command,
                 "--port-file", str(port_file), "--log-level", self.config.log_level],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        credentials = self.credentials.launcher_credentials()
        return ServiceProcess(name, process, port_file, log_path, self.config.host,
                              metrics_port_file=metrics_port_file, credentials=credentials,
                              tls_name=tls_name if credentials is not None else None)

    def _wait_ready(self, services: Sequence[ServiceProcess]) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        for service in services:
            wait_until_serving(service, deadline)


def wait_until_serving(service: ServiceProcess, deadline: float) -> None:
    """Port file, then health SERVING; FleetError if the process dies or time runs out."""
    while True:
        if service.process.poll() is not None:
            raise FleetError(
                f"{service.name} exited with {service.process.returncode}:\n{service.log_tail()}"
            )
        if service.port is None and service.port_file.exists():
            with contextlib.suppress(ValueError):
                service.port = int(service.port_file.read_text().strip())
        if service.port is not None and health_serving(
            service.address, credentials=service.credentials, tls_name=service.tls_name
        ):
            return
        if time.monotonic() > deadline:
            raise FleetError(f"{service.name} did not become ready:\n{service.log_tail()}")
        time.sleep(_POLL_S)


def health_serving(
    address: str, timeout_s: float = 1.0, *,
    credentials: grpc.ChannelCredentials | None = None, tls_name: str | None = None,
) -> bool:
    """Whether the gRPC health check at `address` answers SERVING (over TLS with
    `credentials`, verifying the peer's certificate carries `tls_name`)."""
    if credentials is None:
        channel = grpc.insecure_channel(address)
    else:
        channel = grpc.secure_channel(address, credentials, name_options(tls_name or ""))
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return bool(response.status == health_pb2.HealthCheckResponse.SERVING)


def _shim_code(target: list[str], nice: int = 0, cpus: tuple[int, ...] = ()) -> str:
    # TARGET last: a path in it must not be taken for a placeholder.
    return (_CHILD_SHIM.replace("NICE", repr(nice))
            .replace("CPUS", repr(sorted(set(cpus)) if cpus else None))
            .replace("TARGET", repr(target)))
