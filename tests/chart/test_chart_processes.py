"""The chart's pods, run as local processes: the rendered command lines really serve.

Renders the chart, then starts each container's command exactly as the kubelet would run it
($(VAR) expanded from the ConfigMap and the downward API), on loopback: the bundled Redis's
args with a local redis-server, then tokenizer, engine and router on the tiny test model.
Each must report SERVING on the service name its readiness probe asks for; the first-request
command from NOTES.txt must stream a completion from the engine named after its pod; on
SIGTERM every service drains and exits 0, and the engine leaves Redis.
With `tls.enabled` the same release serves over mutual TLS with the chart's generated
certificates (gRPC client and HTTPS with the CA; an engine refuses a plaintext caller).

Only what a cluster provides is simulated: Service DNS names resolve to 127.0.0.1, the Secret
and model volumes are directories under tmp_path, and the CPU-kernel cache is the usual one
(the chart points it at an emptyDir).
"""

from __future__ import annotations

import base64
import json
import os
import shlex
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvfleet.contracts import redis_schema
from kvfleet.redis_server import find_redis_server, free_port, ping
from tests.chart.chart_harness import FULLNAME, Rendered, container_env, expand, render

pytestmark = pytest.mark.slow

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0
API_KEY = "sk-chart-test"
ENGINE_POD = f"{FULLNAME}-engine-0"
SERVICES = ("tokenizer", "engine", "router")  # start order; stopped in reverse


def _values(model_dir: Path, ports: dict[str, int]) -> dict[str, Any]:
    return {
        "listenHost": "127.0.0.1",
        "model": {"source": "hostPath", "hostPath": {"path": str(model_dir.parent)},
                  "mountPath": str(model_dir.parent), "dir": model_dir.name},
        "router": {"grpcPort": ports["router"]},
        "tokenizer": {"port": ports["tokenizer"]},
        "engine": {"port": ports["engine"], "threads": 1, "numKvBlocks": 64, "maxNumSeqs": 4},
        "redis": {"port": ports["redis"]},
        "auth": {"enabled": True, "apiKeys": {"keys": {API_KEY: "chart"}}},
        # Pods share metrics.port; on one host only one process could bind it.
        "metrics": {"enabled": False},
    }


class LocalRelease:
    """The release's containers as subprocesses; stop() is SIGTERM in reverse order."""

    def __init__(self, rendered: Rendered, workdir: Path) -> None:
        self.rendered = rendered
        self.workdir = workdir
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.secret_dir = workdir / "auth"
        self.secret_dir.mkdir()
        for name, content in rendered.get("Secret", f"{FULLNAME}-api-keys")[
                "stringData"].items():
            (self.secret_dir / name).write_text(content)
        # The generated router credential, as its Secret volume would hold it.
        self.router_secret_dir = workdir / "router-secret"
        self.router_secret_dir.mkdir()
        for name, content in rendered.get("Secret", f"{FULLNAME}-router-secret")[
                "data"].items():
            (self.router_secret_dir / name).write_bytes(base64.b64decode(content))
        # The generated Redis password (redis.conf for Redis, password for its clients).
        self.redis_auth_dir = workdir / "redis-auth"
        self.redis_auth_dir.mkdir()
        for name, content in rendered.get("Secret", f"{FULLNAME}-redis-auth")["data"].items():
            (self.redis_auth_dir / name).write_bytes(base64.b64decode(content))
        self.redis_password = (self.redis_auth_dir / "password").read_text()
        # With tls.enabled: each component's certificate Secret, as its volume would hold it.
        self.tls_dirs: dict[str, Path] = {}
        for component in SERVICES:
            secret = rendered.find("Secret", f"{FULLNAME}-{component}-tls")
            if secret is not None:
                self.tls_dirs[component] = workdir / f"tls-{component}"
                self.tls_dirs[component].mkdir()
                for name, content in secret["data"].items():
                    (self.tls_dirs[component] / name).write_bytes(base64.b64decode(content))

    def log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")[-3000:]

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        with open(self.workdir / f"{name}.log", "wb") as log:
            self.processes[name] = subprocess.Popen(
                argv, cwd=self.workdir, env=env, stdout=log, stderr=subprocess.STDOUT)

    def start_redis(self, port: int) -> None:
        pod = self.rendered.get("Deployment", f"{FULLNAME}-redis")["spec"]["template"]["spec"]
        args = pod["containers"][0]["args"]
        assert args[0] == "redis-server"
        args = [a.replace("/etc/kvfleet/redis-auth", str(self.redis_auth_dir)) for a in args]
        self._spawn("redis", [find_redis_server(), *args[1:]])
        _wait(lambda: ping("127.0.0.1", port, password=self.redis_password), "redis", self)

    def start(self, component: str) -> None:
        container = self.rendered.container(component)
        fields = {"metadata.name": f"{FULLNAME}-{component}-0",
                  "metadata.namespace": "llm", "status.podIP": "127.0.0.1"}
        env = container_env(self.rendered, container, fields)
        for key, value in env.items():  # cluster DNS: the release's Services are local
            env[key] = value.replace(f"{FULLNAME}-redis:", "127.0.0.1:").replace(
                f"{FULLNAME}-tokenizer:", "127.0.0.1:")
        argv = [expand(arg, env) for arg in [*container["command"], *container["args"]]]
        assert argv[0] == "python"
        argv[0] = sys.executable
        argv = [arg.replace("/etc/kvfleet/auth", str(self.secret_dir)).replace(
            "/etc/kvfleet/router-secret", str(self.router_secret_dir)).replace(
            "/etc/kvfleet/redis-auth", str(self.redis_auth_dir)).replace(
            "/etc/kvfleet/tls", str(self.tls_dirs.get(component, "/etc/kvfleet/tls")))
            for arg in argv]
        del env["HOME"]  # keep the machine's caches (the chart gives each pod an emptyDir)
        env.pop("KVFLEET_CACHE_DIR", None)
        self._spawn(component, argv, {**os.environ, **env, "PYTHONPATH": str(_repo_root())})
        probe = container["readinessProbe"]
        if "grpc" in probe:
            grpc_probe = probe["grpc"]
            _wait(lambda: _serving(grpc_probe["port"], grpc_probe["service"]), component, self)
        else:  # TLS: the kubelet checks the port; here, health over mutual TLS
            port, service = probe["tcpSocket"]["port"], f"kvfleet.v1.{component.title()}"
            _wait(lambda: _serving(port, service, self.client_tls(component)), component, self)

    def client_tls(self, peer: str) -> tuple[grpc.ChannelCredentials, str]:
        """Credentials of a fleet client (the router's certificate) and `peer`'s role name."""
        files = self.tls_dirs["router"]
        credentials = grpc.ssl_channel_credentials(
            (files / "ca.crt").read_bytes(), (files / "tls.key").read_bytes(),
            (files / "tls.crt").read_bytes())
        return credentials, f"kvfleet-{peer}"

    def stop(self, names: tuple[str, ...] | None = None) -> dict[str, int | None]:
        """SIGTERM `names` (default: everything, newest first); their exit codes."""
        codes: dict[str, int | None] = {}
        for name in names or tuple(reversed(list(self.processes))):
            process = self.processes[name]
            if process.poll() is None:
                process.terminate()
            try:
                codes[name] = process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                codes[name] = process.wait()
        return codes


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def _serving(port: int, service: str,
             tls: tuple[grpc.ChannelCredentials, str] | None = None) -> bool:
    address = f"127.0.0.1:{port}"
    channel = grpc.insecure_channel(address) if tls is None else grpc.secure_channel(
        address, tls[0], (("grpc.ssl_target_name_override", tls[1]),))
    with channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2)
        except grpc.RpcError:
            return False
    return bool(response.status == health_pb2.HealthCheckResponse.SERVING)


def _wait(ready: Any, name: str, release: LocalRelease) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready():
        process = release.processes[name]
        if process.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"{name} did not become ready (exit {process.poll()}):\n"
                        f"{release.log(name)}")
        time.sleep(0.25)


@pytest.fixture
def release(tiny_model_dir: Path, tmp_path: Path) -> Iterator[LocalRelease]:
    yield from _release(tiny_model_dir, tmp_path, {})


@pytest.fixture
def tls_release(tiny_model_dir: Path, tmp_path: Path) -> Iterator[LocalRelease]:
    # The bundled Redis stays plaintext: the local redis-server may lack TLS support.
    yield from _release(tiny_model_dir, tmp_path, {"tls": {"enabled": True}})


def _release(tiny_model_dir: Path, tmp_path: Path,
             extra: dict[str, Any]) -> Iterator[LocalRelease]:
    ports = {name: free_port() for name in ("redis", *SERVICES)}
    local = LocalRelease(render({**_values(tiny_model_dir, ports), **extra}), tmp_path)
    try:
        local.start_redis(ports["redis"])
        for component in SERVICES:
            local.start(component)
        yield local
    finally:
        local.stop()


def _notes_client_command(notes: str) -> list[str]:
    """The port-forward variant of NOTES.txt's first request, ready to run here."""
    line = next(line for line in notes.splitlines() if "client --router 127.0.0.1" in line)
    argv = shlex.split(line.replace('"$API_KEY"', API_KEY))
    assert argv[:3] == [".venv/bin/python", "-m", "kvfleet.cli"]
    return [sys.executable, *argv[1:], "--max-tokens", "8", "--timeout", "60"]


def test_rendered_pods_serve_the_notes_request_and_drain(release: LocalRelease) -> None:
    client = subprocess.run(_notes_client_command(release.rendered.notes), cwd=_repo_root(),
                            capture_output=True, text=True, timeout=120, check=False)
    assert client.returncode == 0, client.stderr + release.log("router")
    summary = json.loads(client.stdout.strip().splitlines()[-1])
    assert summary["engine_id"] == ENGINE_POD
    assert summary["usage"]["completion_tokens"] > 0

    redis_url = release.rendered.config()["KVFLEET_REDIS_URL"].replace(
        f"{FULLNAME}-redis:", "127.0.0.1:")
    engine_port = release.rendered.container("engine")["ports"][0]["containerPort"]
    with redis.Redis.from_url(redis_url, password=release.redis_password) as store:
        key = redis_schema.engine_key(ENGINE_POD)
        assert store.hget(key, "address") == f"127.0.0.1:{engine_port}".encode()
        services = tuple(reversed(SERVICES))
        assert release.stop(services) == dict.fromkeys(services, 0)
        assert not store.exists(key)  # the engine deregistered while draining


def test_rendered_tls_pods_serve_over_mutual_tls(tls_release: LocalRelease) -> None:
    """tls.enabled: the chart's generated certificates carry the names each hop verifies;
    a request goes client -(TLS)-> router -(mTLS)-> tokenizer and engine, and the HTTP
    API answers over HTTPS with the same CA."""
    router = tls_release.rendered.container("router")
    grpc_port = router["ports"][0]["containerPort"]
    ca_file = tls_release.tls_dirs["router"] / "ca.crt"
    client = subprocess.run(
        [sys.executable, "-m", "kvfleet.cli", "client", "--router", f"localhost:{grpc_port}",
         "--ca-file", str(ca_file), "--api-key", API_KEY, "--max-tokens", "4", "--timeout",
         "60", "hello"], cwd=_repo_root(), capture_output=True, text=True, timeout=120,
        check=False)
    assert client.returncode == 0, client.stderr + tls_release.log("router")
    assert json.loads(client.stdout.strip().splitlines()[-1])["engine_id"] == ENGINE_POD
    http_port = next(p["containerPort"] for p in router["ports"] if p["name"] == "http")
    context = ssl.create_default_context(cafile=str(ca_file))
    request = urllib.request.Request(f"https://localhost:{http_port}/v1/models",
                                     headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, context=context, timeout=30) as reply:
        assert reply.status == 200
    # An engine refuses a caller without a fleet certificate.
    engine_port = tls_release.rendered.container("engine")["ports"][0]["containerPort"]
    assert not _serving(engine_port, "kvfleet.v1.Engine")
