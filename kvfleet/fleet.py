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
"""

from __future__ import annotations

import contextlib
import os
import secrets
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

from kvfleet.redis_server import RedisServer, find_redis_server

DEFAULT_START_TIMEOUT_S = 300.0
DEFAULT_STOP_TIMEOUT_S = 15.0
# Every child starts through this shim, then execs the real program (same pid):
# - its own session, so a terminal's Ctrl-C reaches only the fleet's owner, which then stops
#   the services in order (Redis included: it would otherwise quit first);
# - on Linux, PR_SET_PDEATHSIG: SIGTERM when the owner dies, even by SIGKILL (no orphans).
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
argv = TARGET + sys.argv[1:]
os.execv(argv[0], argv)
"""
_POLL_S = 0.05


class FleetError(RuntimeError):
    """A service did not come up (the message carries its log tail)."""


@dataclass(frozen=True)
class FleetConfig:
    model_dir: Path
    num_engines: int = 2
    redis_url: str | None = None
    host: str = "127.0.0.1"
    router_port: int = 0
    # The router's OpenAI HTTP API port (0: a free port, see Fleet.http_url).
    router_http_port: int = 0
    policy: str = "prefix"
    api_keys: Path | None = None
    # Extra engine flags, e.g. ("--num-kv-blocks", "256").
    engine_args: tuple[str, ...] = ()
    # Extra flags of engine i only, after engine_args (e.g. one engine speculating, one not);
    # engines past the end of the tuple get none.
    engine_args_by_index: tuple[tuple[str, ...], ...] = ()
    router_args: tuple[str, ...] = ()
    # Torch threads per engine (OMP_NUM_THREADS); None: torch's default (every core).
    engine_threads: int | None = None
    log_dir: Path | None = None
    log_level: str = "INFO"
    # Every service serves Prometheus /metrics on a free port, written to
    # <log_dir>/<name>.metrics-port (see ServiceProcess.metrics_port); False: --no-metrics.
    metrics: bool = True
    # The model name engines and the tokenizer report (default: the model dir's name).
    served_model_name: str | None = None
    # The tokenizer's chat template (a file or the template itself), for models without one.
    chat_template: str | None = None
    # docs/security.md: the router's runtime adapter endpoints (admins only), the adapter
    # directories (router and engines), and special tokens in prompts (tokenizer).
    allow_runtime_lora_updating: bool = False
    lora_allowed_dirs: tuple[Path, ...] = ()
    allow_special_tokens_in_prompts: bool = False
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S
    stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S
    # Prefill/decode disaggregation (docs/disaggregation.md): when either is set, the fleet's
    # engines are these many prefill-role engines then decode-role ones (num_engines unused).
    prefill_engines: int = 0
    decode_engines: int = 0

    def __post_init__(self) -> None:
        if self.num_engines < 1:
            raise ValueError(f"a fleet needs at least one engine, got {self.num_engines}")
        if self.prefill_engines < 0 or self.decode_engines < 0:
            raise ValueError("prefill_engines and decode_engines must be >= 0")
        if bool(self.prefill_engines) != bool(self.decode_engines):
            raise ValueError("a disaggregated fleet needs prefill and decode engines, got "
                             f"{self.prefill_engines} and {self.decode_engines}")

    @property
    def engine_roles(self) -> tuple[str, ...]:
        """Engine i's --role: prefill ones first, then decode ones; else all both."""
        if self.prefill_engines:
            return ("prefill",) * self.prefill_engines + ("decode",) * self.decode_engines
        return ("both",) * self.num_engines


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
    _force: threading.Event = field(default_factory=threading.Event)

    @property
    def redis_url(self) -> str:
        if self.config.redis_url:
            return self.config.redis_url
        if self.redis is None:
            raise RuntimeError("fleet not started")
        return self.redis.url

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
        return f"http://{self.config.host}:{self.router.http_port}"

    @property
    def log_dir(self) -> Path:
        if self._log_dir is None:
            raise RuntimeError("fleet not started")
        return self._log_dir

    @property
    def router_secret_file(self) -> Path:
        """The shared secret engines require of routers (0600, removed when the fleet stops)."""
        return self.log_dir / "router-secret"

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
                    host=self.config.host, executable=str(self._redis_shim())
                ).start()
            self.tokenizer = self._launch("tokenizer", tokenizer_command(self.config))
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
        command = engine_command(self.config, engine_id(index), self.redis_url)
        if index < len(self.config.engine_args_by_index):
            command += self.config.engine_args_by_index[index]
        command += ["--router-secret-file", str(self.router_secret_file)]
        roles = self.config.engine_roles
        if index < len(roles) and roles[index] != "both":
            command += ["--role", roles[index]]
        env = None
        if self.config.engine_threads is not None:
            threads = str(self.config.engine_threads)
            env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        return self._launch(engine_id(index), command, env)

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
        self.tokenizer = self._launch("tokenizer", tokenizer_command(self.config, old.port))
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
            self.config, self.tokenizer.address, self.redis_url, policy, port
        ) + ["--http-port", str(http_port), "--http-port-file", str(http_port_file),
             "--router-secret-file", str(self.router_secret_file)]
        router = self._launch(name, command)
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
        if self._log_dir is not None:  # run logs are kept; the secret is not
            self.router_secret_file.unlink(missing_ok=True)

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
        # Engines serve only callers with this secret (kvfleet.runtime.service_auth): the fleet's
        # routers, not any local process that finds an engine port.
        fd = os.open(self.router_secret_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_urlsafe(32))

    def _redis_shim(self) -> Path:
        """An executable that runs redis-server through the child shim (for RedisServer)."""
        shim = self.log_dir / "redis-server-shim"
        code = _shim_code([find_redis_server()])
        shim.write_text(f"#!{sys.executable}\n{code}")
        shim.chmod(0o755)
        return shim

    def _launch(
        self, name: str, command: list[str], env: dict[str, str] | None = None
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
                [sys.executable, "-c", _shim_code([]), *command,
                 "--port-file", str(port_file), "--log-level", self.config.log_level],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        return ServiceProcess(name, process, port_file, log_path, self.config.host,
                              metrics_port_file=metrics_port_file)

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
        if service.port is not None and health_serving(service.address):
            return
        if time.monotonic() > deadline:
            raise FleetError(f"{service.name} did not become ready:\n{service.log_tail()}")
        time.sleep(_POLL_S)


def health_serving(address: str, timeout_s: float = 1.0) -> bool:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return bool(response.status == health_pb2.HealthCheckResponse.SERVING)


def engine_id(index: int) -> str:
    return f"engine-{index}"


def tokenizer_command(config: FleetConfig, port: int = 0) -> list[str]:
    command = [sys.executable, "-m", "tokenizer_svc.server", "--model", str(config.model_dir),
               "--host", config.host, "--port", str(port), *_served_name(config)]
    if config.chat_template is not None:
        command += ["--chat-template", config.chat_template]
    if config.allow_special_tokens_in_prompts:
        command.append("--allow-special-tokens-in-prompts")
    return command


def engine_command(config: FleetConfig, name: str, redis_url: str) -> list[str]:
    return [sys.executable, "-m", "engine.service.server", "--model", str(config.model_dir),
            "--engine-id", name, "--redis-url", redis_url, "--host", config.host,
            "--port", "0", *_served_name(config), *_lora_dirs(config), *config.engine_args]


def _lora_dirs(config: FleetConfig) -> list[str]:
    dirs = config.lora_allowed_dirs
    return ["--lora-allowed-dirs", *map(str, dirs)] if dirs else []


def _served_name(config: FleetConfig) -> list[str]:
    name = config.served_model_name
    return [] if name is None else ["--served-model-name", name]


def format_host(host: str) -> str:
    """`host` as it goes in a URL (IPv6 in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def router_command(
    config: FleetConfig, tokenizer_address: str, redis_url: str, policy: str, port: int
) -> list[str]:
    command = [sys.executable, "-m", "router.server", "--tokenizer", tokenizer_address,
               "--redis-url", redis_url, "--policy", policy, "--host", config.host,
               "--port", str(port), *config.router_args]
    if config.api_keys is not None:
        command += ["--api-keys", str(config.api_keys)]
    if config.allow_runtime_lora_updating:
        command.append("--allow-runtime-lora-updating")
    return command + _lora_dirs(config)


def _shim_code(target: list[str]) -> str:
    return _CHILD_SHIM.replace("TARGET", repr(target))
