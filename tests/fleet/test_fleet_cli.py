"""`kvfleet` end to end: `demo` (what `make run` runs), `client`, Ctrl-C, no orphans; `up`
with its defaults (metrics on, logs kept under the cache dir) and `logs`.

One local fleet (1 engine, tiny model) started by the real command in its own session, so
Ctrl-C is simulated exactly as a terminal sends it: SIGINT to the whole process group.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.cli import DEMO_PROMPTS, build_parser, http_port_or_free, main
from kvfleet.fleet import FleetConfig, engine_command, router_command, tokenizer_command
from tests.fixtures.router_fleet import child_pids, pid_alive, wait_until

pytestmark = pytest.mark.timeout(240)

ROUTER_LINE = re.compile(r"^router: (127\.0\.0\.1:\d+)$")


def read_until(process: subprocess.Popen[str], pattern: str, timeout_s: float) -> list[str]:
    """Lines of stdout up to and including the first one containing `pattern`."""
    assert process.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise AssertionError(f"exited early ({process.poll()}):\n{''.join(lines)}")
        lines.append(line.rstrip("\n"))
        if pattern in line:
            return lines
    raise AssertionError(f"no {pattern!r} within {timeout_s}s:\n" + "\n".join(lines))


def test_demo_then_client_then_ctrl_c_leaves_no_process(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    command = [sys.executable, "-m", "kvfleet.cli", "demo", "--engines", "1",
               "--model", str(tiny_model_dir), "--log-dir", str(tmp_path / "logs"),
               "--http-port", "0"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        lines = read_until(process, "press Ctrl-C", 180)
        router = next(m.group(1) for line in lines if (m := ROUTER_LINE.match(line)))
        http = next(line.split()[1] for line in lines if line.startswith("http: "))
        with urllib.request.urlopen(f"{http}/v1/models", timeout=10) as reply:
            served = json.loads(reply.read())
        assert [model["id"] for model in served["data"]] == [tiny_model_dir.name]
        table = [line for line in lines if line.startswith(DEMO_PROMPTS)]
        assert len(table) == 2 * len(DEMO_PROMPTS), "\n".join(lines)
        second_round = [line.split() for line in table[len(DEMO_PROMPTS):]]
        # Chat template + same prompt again: at least one full block comes from the cache.
        assert all(int(fields[-3]) >= 16 for fields in second_round), "\n".join(table)

        client = subprocess.run(
            [sys.executable, "-m", "kvfleet.cli", "client", "--router", router,
             "--max-tokens", "5", "--temperature", "0", "Once upon a time"],
            capture_output=True, text=True, timeout=60, check=True,
        )
        summary = json.loads(client.stdout.strip().splitlines()[-1])
        assert summary["engine_id"] == "engine-0"
        assert summary["finish_reason"] == "length"
        assert summary["usage"]["completion_tokens"] == 5

        children = child_pids(process.pid)
        assert len(children) >= 4  # redis, tokenizer, engine, router
        os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        assert process.wait(60) == 0
        wait_until(lambda: not any(pid_alive(p) for p in children), 10,
                   what="every service process to exit")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_serve_dispatches_to_each_service() -> None:
    for service in ("router", "tokenizer", "engine"):
        with pytest.raises(SystemExit) as info:
            main(["serve", service, "--help"])
        assert info.value.code == 0


def test_up_passes_the_security_flags_on(tmp_path: Path) -> None:
    """`--tenant-policy` is `--api-keys` (as on the router); the LoRA and special-token
    switches reach the router, the engines and the tokenizer (docs/security.md)."""
    policy, adapters = tmp_path / "policy.yaml", tmp_path / "adapters"
    args = build_parser().parse_args([
        "up", "--tenant-policy", str(policy), "--allow-runtime-lora-updating",
        "--lora-allowed-dirs", str(adapters), "--allow-special-tokens-in-prompts"])
    assert args.api_keys == policy
    assert build_parser().parse_args(["up", "--api-keys", str(policy)]).api_keys == policy
    config = FleetConfig(model_dir=tmp_path, api_keys=args.api_keys,
                         allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                         lora_allowed_dirs=tuple(args.lora_allowed_dirs),
                         allow_special_tokens_in_prompts=args.allow_special_tokens_in_prompts)
    router = router_command(config, "t:1", "redis://r", "prefix", 0)
    assert router[router.index("--api-keys") + 1] == str(policy)
    assert "--allow-runtime-lora-updating" in router
    assert router[router.index("--lora-allowed-dirs") + 1] == str(adapters)
    engine = engine_command(config, "engine-0", "redis://r")
    assert engine[engine.index("--lora-allowed-dirs") + 1] == str(adapters)
    assert "--allow-special-tokens-in-prompts" in tokenizer_command(config)
    plain = FleetConfig(model_dir=tmp_path)
    assert "--allow-runtime-lora-updating" not in router_command(plain, "t:1", "r", "prefix", 0)
    assert "--allow-special-tokens-in-prompts" not in tokenizer_command(plain)


def test_client_requires_router_and_prompt() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["client", "hello"])


def test_services_die_with_a_killed_owner(tiny_model_dir: Path, tmp_path: Path) -> None:
    command = [sys.executable, "-m", "kvfleet.cli", "up", "--engines", "1",
               "--model", str(tiny_model_dir), "--log-dir", str(tmp_path / "logs"),
               "--http-port", "0"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        read_until(process, "press Ctrl-C", 180)
        children = child_pids(process.pid)
        assert len(children) >= 4
        process.kill()  # no handler runs: only the death signal can clean up
        process.wait(10)
        wait_until(lambda: not any(pid_alive(p) for p in children), 20,
                   what="every service process to exit after its owner was killed")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_busy_http_port_falls_back_to_a_free_one() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert http_port_or_free("127.0.0.1", port) == 0
    assert http_port_or_free("127.0.0.1", port) == port  # free again
    assert http_port_or_free("127.0.0.1", 0) == 0


def test_up_prints_a_metrics_url_per_service_and_keeps_its_logs(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    # Only the run logs are to land in the test's cache: the compiled kernels stay shared,
    # else the engine rebuilds every C++ library before it is ready (minutes on a busy machine).
    shared = Path(os.environ.get("KVFLEET_CACHE_DIR") or Path.home() / ".cache" / "kvfleet")
    (shared / "torch_extensions").mkdir(parents=True, exist_ok=True)
    cache.mkdir()
    (cache / "torch_extensions").symlink_to(shared / "torch_extensions")
    env = {**os.environ, "KVFLEET_CACHE_DIR": str(cache)}
    command = [sys.executable, "-m", "kvfleet.cli", "up", "--engines", "1",
               "--model", str(tiny_model_dir), "--http-port", "0", "--engine-threads", "1"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True, env=env)
    try:
        lines = read_until(process, "press Ctrl-C", 180)
        urls = dict(line.split()[1:3] for line in lines if line.startswith("metrics: "))
        assert set(urls) == {"router", "tokenizer", "engine-0"}, "\n".join(lines)
        expected = {"router": "kvfleet:router_requests", "tokenizer": "kvfleet:tokenizer_requests",
                    "engine-0": "kvfleet:num_requests_running"}
        for service, url in urls.items():
            with urllib.request.urlopen(url, timeout=10) as reply:
                assert reply.status == 200
                names = {f.name for f in text_string_to_metric_families(reply.read().decode())}
            assert expected[service] in names, (service, sorted(names))

        log_line = next(line for line in lines if line.startswith("logs: "))
        log_dir = Path(log_line.split()[1])
        assert log_dir.parent == cache / "logs" and (cache / "logs" / "latest").resolve() == \
            log_dir.resolve()
        assert {"router.log", "tokenizer.log", "engine-0.log"} <= {
            p.name for p in log_dir.iterdir()}
        shown = subprocess.run([sys.executable, "-m", "kvfleet.cli", "logs", "router"],
                               capture_output=True, text=True, timeout=60, env=env)
        assert shown.returncode == 0 and "OpenAI API on http://" in shown.stdout, shown
        assert str(log_dir) in shown.stderr
        os.killpg(process.pid, signal.SIGINT)
        assert process.wait(60) == 0
        assert log_dir.is_dir()  # kept after the fleet stopped
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
