"""vLLM's serving side for the online benchmark: `vllm serve`, and `vllm bench serve` as client.

Both run through benchmarks/vllm_launcher.py in `.venv-peers` with the peer environment of
benchmarks/vllm_runner.py. `VllmServer` starts the OpenAI server on a free loopback port and is
ready once /health answers 200 (start-up is not timed); it stops with SIGTERM to its session,
then SIGKILL. `bench_serve` runs vLLM's own serving benchmark client against any
OpenAI-compatible base URL (kvfleet's router or vLLM's server), so both systems are measured
by the same client with the same prompts, and returns the result JSON it saved.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from benchmarks.vllm_runner import LAUNCHER, REPO, PeerConfig, PeerError, log_tail, peer_env
from benchmarks.vllm_runner import peer_python as _peer_python

_POLL_S = 0.5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http_ok(url: str, timeout_s: float, alive: Any = None, what: str = "server") -> None:
    """Poll `url` until it answers 200; `alive()` False (the process died) stops the wait."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            raise PeerError(f"{what} exited before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(_POLL_S)
    raise PeerError(f"{what}: {url} did not answer 200 within {timeout_s:.0f} s")


class ServedProcess:
    """A peer server process in its own session: started, waited for until `ready_url` answers
    200 (its log tail in the error when it does not), stopped with SIGTERM, then SIGKILL."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], log_path: Path,
                 ready_url: str, start_timeout_s: float, what: str,
                 stop_timeout_s: float = 15.0) -> None:
        self._stop_timeout_s = stop_timeout_s
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("w", encoding="utf-8")
        self._proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=self._log,
                                      stderr=subprocess.STDOUT, env=dict(env), cwd=REPO,
                                      start_new_session=True)
        try:
            wait_http_ok(ready_url, start_timeout_s, lambda: self._proc.poll() is None, what)
        except BaseException as e:
            self.close()
            if isinstance(e, PeerError):
                raise PeerError(f"{e}; log {log_path}:\n{log_tail(log_path)}") from None
            raise

    def close(self) -> None:
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout=self._stop_timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        self._log.close()


class VllmServer:
    """`vllm serve MODEL_DIR` on 127.0.0.1, one dtype.

    By default the online benchmark's set-up: prefix caching on, stats logging off, the given
    batch limits and a 2,048-token context. A `None` limit (and `prefix_caching=None`) leaves
    that flag out, so vLLM's own default applies; `log_stats=True` keeps vLLM's stats, which
    its Prometheus counters (/metrics) need; `env` overrides variables of `peer_env` (e.g. one
    server's `VLLM_CPU_OMP_THREADS_BIND`).
    """

    def __init__(self, model_dir: Path, served_name: str, dtype: str, cfg: PeerConfig,
                 log_path: Path, *, max_num_seqs: int | None, max_num_batched_tokens: int | None,
                 max_model_len: int | None = 2048, prefix_caching: bool | None = True,
                 log_stats: bool = False, env: Mapping[str, str] | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.metrics_url = f"{self.base_url}/metrics"
        self.log_path = log_path
        argv = [str(_peer_python()), "-I", str(LAUNCHER), "serve", str(model_dir),
                "--host", "127.0.0.1", "--port", str(self.port), "--dtype", dtype,
                "--served-model-name", served_name]
        for flag, value in (("--max-model-len", max_model_len), ("--max-num-seqs", max_num_seqs),
                            ("--max-num-batched-tokens", max_num_batched_tokens)):
            if value is not None:
                argv += [flag, str(value)]
        if prefix_caching is not None:
            argv.append("--enable-prefix-caching" if prefix_caching
                        else "--no-enable-prefix-caching")
        if not log_stats:
            argv.append("--disable-log-stats")
        if cfg.enforce_eager:
            argv.append("--enforce-eager")
        self._process = ServedProcess(
            argv, {**peer_env(cfg), **(env or {})}, log_path, f"{self.base_url}/health",
            cfg.start_timeout_s, "vllm serve", stop_timeout_s=30,
        )

    def close(self) -> None:
        self._process.close()

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def bench_serve(base_url: str, served_name: str, tokenizer_dir: Path, dataset_args: Sequence[str],
                cfg: PeerConfig, result_path: Path, log_path: Path, *, num_prompts: int,
                num_warmups: int, seed: int, timeout_s: float,
                request_rate: float | None = None) -> dict[str, Any]:
    """Run `vllm bench serve` (OpenAI completions, greedy, EOS ignored) at `request_rate`
    requests/s (Poisson arrivals; None: every request at once, rate inf)."""
    result_path.parent.mkdir(parents=True, exist_ok=True)
    result_path.unlink(missing_ok=True)
    argv = [str(_peer_python()), "-I", str(LAUNCHER), "bench", "serve", "--backend", "openai",
            "--base-url", base_url, "--endpoint", "/v1/completions", "--model", served_name,
            "--tokenizer", str(tokenizer_dir), *dataset_args, "--num-prompts", str(num_prompts),
            "--request-rate", "inf" if request_rate is None else f"{request_rate:.3f}",
            "--ignore-eos", "--temperature", "0", "--seed", str(seed),
            "--num-warmups", str(num_warmups), "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,99", "--disable-tqdm", "--save-result",
            "--result-dir", str(result_path.parent), "--result-filename", result_path.name]
    with log_path.open("w", encoding="utf-8") as log:
        try:
            code = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=log,
                                  stderr=subprocess.STDOUT, env=peer_env(cfg), cwd=REPO,
                                  timeout=timeout_s, check=False).returncode
        except subprocess.TimeoutExpired:
            raise PeerError(f"vllm bench serve against {base_url} ran past {timeout_s:.0f} s; "
                            f"log {log_path}:\n{log_tail(log_path)}") from None
    if code != 0 or not result_path.exists():
        raise PeerError(f"vllm bench serve against {base_url} failed ({code}); "
                        f"log {log_path}:\n{log_tail(log_path)}")
    result: dict[str, Any] = json.loads(result_path.read_text(encoding="utf-8"))
    return result
