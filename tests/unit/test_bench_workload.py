"""The offline benchmark's workload and peer environment (benchmarks/workload.py, vllm_runner.py).

Pure functions: the prompts every system receives, the token comparison the report prints, and
the environment the vLLM peer runs under.
"""

from __future__ import annotations

import random
from pathlib import Path

from benchmarks.vllm_runner import PeerConfig, peer_env
from benchmarks.workload import agreement, random_prompts, throughput


def test_random_prompts_stay_inside_the_id_margins_and_lengths() -> None:
    prompts = random_prompts(random.Random(0), 200, 16, 256, 49152, set(range(17)))
    assert len(prompts) == 200
    assert all(16 <= len(p) <= 256 for p in prompts)
    ids = {t for p in prompts for t in p}
    assert min(ids) >= 100 and max(ids) < 49152 - 100
    # One seed, one workload: every system and every run gets the same ids.
    assert prompts == random_prompts(random.Random(0), 200, 16, 256, 49152, set(range(17)))


def test_random_prompts_skip_special_ids_above_the_margin() -> None:
    prompts = random_prompts(random.Random(1), 50, 16, 16, 1000, {0, 150})
    assert min(t for p in prompts for t in p) >= 151


def test_agreement_names_each_diverging_request_and_position() -> None:
    mine = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 2]]
    theirs = [[1, 2, 3], [4, 0, 6], [7, 8, 9], [1, 2, 3]]
    assert agreement(mine, theirs) == {"checked": 4, "equal": 2,
                                       "first_divergence": {1: 1, 3: 2}}
    assert agreement(mine, theirs, 1)["checked"] == 1


def test_throughput_uses_the_median_round() -> None:
    row = throughput("x", [4.0, 1.0, 2.0], [[1] * 10], [[2] * 6])
    assert row["wall_s"] == 2.0
    assert row["gen_tok_s"] == 3.0 and row["total_tok_s"] == 8.0


def test_peer_env_pins_threads_and_drops_our_virtualenv() -> None:
    base = {"PATH": "/bin", "PYTHONPATH": "/ours", "VIRTUAL_ENV": "/ours/.venv",
            "LD_PRELOAD": "/ours/lib.so"}
    cfg = PeerConfig(cache_dir=Path("/tmp/bench"), threads=2)
    env = peer_env(cfg, base)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["VLLM_HOST_IP"] == "127.0.0.1"
    assert env["VLLM_CACHE_ROOT"].startswith("/tmp/bench")
    assert "PYTHONPATH" not in env and "VIRTUAL_ENV" not in env and "LD_PRELOAD" not in env
    with_tc = peer_env(PeerConfig(cache_dir=Path("/tmp/b"), tcmalloc="/lib/libtc.so.4"), base)
    assert with_tc["LD_PRELOAD"] == "/lib/libtc.so.4"
