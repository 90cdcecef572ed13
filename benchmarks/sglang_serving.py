"""sglang-router (PyPI `sglang-router`, a Rust gateway) in front of `vllm serve` workers.

`SglangRouter` runs `python -m sglang_router.launch_router --worker-urls URL... --policy P` from
.venv-peers on a free loopback port, with its Prometheus exporter on another free loopback port
(its default, 29000 on every interface, would clash between runs), worker checks every second
and a short shutdown grace. It is ready once /readiness answers 200 (workers registered). It
routes the OpenAI API by the request's text: it refuses token-id prompts (422) and answers
/v1/models with "unknown", so clients send text and name the model themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from benchmarks.vllm_runner import PeerConfig, peer_env, peer_python
from benchmarks.vllm_serving import ServedProcess, free_port

POLICIES = ("cache_aware", "round_robin")
VERSION = "0.3.2"


class SglangRouter:
    """sglang-router with `policy` over `worker_urls`; stop with `close()` or `with`."""

    def __init__(self, worker_urls: Sequence[str], policy: str, cfg: PeerConfig, log_path: Path,
                 start_timeout_s: float = 120.0) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        argv = [str(peer_python()), "-m", "sglang_router.launch_router",
                "--worker-urls", *worker_urls, "--policy", policy,
                "--host", "127.0.0.1", "--port", str(self.port),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                "--worker-startup-check-interval", "1", "--shutdown-grace-period-secs", "5",
                "--log-level", "warn"]
        env = {k: v for k, v in peer_env(cfg).items() if k != "LD_PRELOAD"}
        self._process = ServedProcess(argv, env, log_path, f"{self.base_url}/readiness",
                                      start_timeout_s, "sglang-router")

    def close(self) -> None:
        self._process.close()

    def __enter__(self) -> SglangRouter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
