"""The fleet simulator (benchmarks/fleet_sim) at a CI size: 4 engines, 20 tenants, 2 simulated
minutes, every policy on a real Redis with the router's own decision code.

Checks structure and invariants: every policy's figures are present and sane, the ordering
oracle >= prefix >= round robin holds for hit rates on a seeded llm-d workload, a run is
deterministic per seed, the prefix cache's accounting holds.
"""

from __future__ import annotations

import asyncio
import json
import pstats
from pathlib import Path

import pytest

from benchmarks import fleet_bench
from benchmarks.fleet_sim import __main__ as cli
from benchmarks.fleet_sim import calibration, decision_cost, vs_real
from benchmarks.fleet_sim.calibration import DEFAULT
from benchmarks.fleet_sim.prefix_cache import PrefixCache
from benchmarks.fleet_sim.workload import Workload, WorkloadConfig
from kvfleet.redis_server import RedisServer

# 20 tenants' 600-token prompts (~38 blocks each) on 4 engines of 200 blocks: no engine holds
# them all, the fleet holds most; ~1 request/s keeps the engines busy, not saturated.
SMALL = ["--engines", "4", "--tenants", "20", "--seed", "7", "--duration-s", "120",
         "--sessions-per-s", "0.3", "--system-tokens", "600", "--default-calibration",
         "--kv-blocks", "200"]


@pytest.fixture(scope="module")
def results(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("sim") / "sim.json"
    assert cli.main([*SMALL, "--redis-url", redis_server.url, "--json", str(out)]) == 0
    return json.loads(Path(out).read_text())


def test_every_policy_reports_every_figure(results: dict) -> None:
    policies = results["policies"]
    assert set(policies) == {"prefix", "round_robin", "least_load", "oracle"}
    for name, row in policies.items():
        for key in ("hit_rate", "oracle_hit_rate", "max_over_mean_load", "ttft_p50_s",
                    "ttft_p90_s", "ttft_p99_s", "throughput_rps", "decision_p99_ms"):
            assert key in row, (name, key)
        assert 0.0 <= row["hit_rate"] <= row["ideal_hit_rate"] <= 1.0
        assert row["ttft_p50_s"] <= row["ttft_p90_s"] <= row["ttft_p99_s"]
        assert row["max_over_mean_load"] >= 1.0
        assert row["unfinished"] == 0
    assert policies["oracle"]["decision_p99_ms"] == 0.0  # no Redis call
    assert policies["prefix"]["decision_p99_ms"] > 0.0


def test_hit_rates_are_ordered(results: dict) -> None:
    p = results["policies"]
    assert p["oracle"]["hit_rate"] >= p["round_robin"]["hit_rate"]
    assert p["prefix"]["hit_rate"] >= p["round_robin"]["hit_rate"]
    assert p["prefix"]["hit_rate"] >= 0.95 * p["oracle"]["hit_rate"]
    assert p["prefix"]["hit_rate"] > 2 * p["round_robin"]["hit_rate"]
    assert p["prefix"]["ttft_p99_s"] <= p["round_robin"]["ttft_p99_s"]


def test_the_virtual_clock_makes_runs_repeatable(redis_server: RedisServer) -> None:
    args = cli.parse_args([*SMALL, "--redis-url", redis_server.url, "--duration-s", "40"])
    wl = cli.workload_config(args)
    cal = cli.load_calibration(args)
    first = asyncio.run(cli.run_policy("oracle", args, cal, wl, redis_server.url))
    second = asyncio.run(cli.run_policy("oracle", args, cal, wl, redis_server.url))
    for key in ("hit_rate", "ttft_p99_s", "throughput_rps", "requests"):
        assert first[key] == second[key]


def test_workload_is_a_function_of_the_seed() -> None:
    config = WorkloadConfig(tenants=5, system_tokens=100, duration_s=60, sessions_per_s=1.0)
    a, b = Workload(config), Workload(config)
    assert a.session_starts == b.session_starts
    first = a.turn(3, 0)
    assert first.prompt == b.turn(3, 0).prompt
    follow_up = a.turn(3, 1)
    assert follow_up.prompt[: len(first.prompt) + len(first.output)] == (
        first.prompt + first.output)


def test_prefix_cache_evicts_free_blocks_oldest_first() -> None:
    cache = PrefixCache(3)
    cache.acquire([], 3)
    for h in (b"a", b"b", b"c"):
        cache.store(h)
    cache.release([b"a", b"b", b"c"], 0)
    assert cache.match([b"a", b"b", b"c"], 3) == 3
    cache.acquire([b"c"], 1)  # one new block: evicts a, the oldest free one
    assert not cache.contains(b"a") and cache.contains(b"b")
    assert cache.used == 2 and cache.used + 1 <= cache.capacity
    assert cache.take_changes() == {b"a": False, b"b": True, b"c": True}


def test_default_calibration_is_sane() -> None:
    assert DEFAULT.step_s(512, 256, 8, 4000) > DEFAULT.step_s(0, 0, 8, 4000) > 0


def test_the_simulated_engines_have_the_real_fleets_kv(smollm2_dir: Path) -> None:
    """The engines modelled are the fleet benchmark's (`vs_real` compares with them): its KV
    budget over the engine's own bytes per block, not the engine's default budget."""
    budget = fleet_bench.parse_args([]).kvcache_gib * 2**30
    assert calibration.fleet_kv_cache_bytes() == budget == DEFAULT.kv_cache_bytes
    per_block = calibration._bytes_per_block(str(smollm2_dir), 16)
    assert per_block == DEFAULT.kv_bytes_per_block == 720 * 1024
    assert DEFAULT.kv_blocks == budget // per_block == 2912


def test_a_calibration_from_before_the_fleets_kv_is_resized(smollm2_dir: Path,
                                                            tmp_path: Path) -> None:
    """A cached calibration measured on the engine's default 1 GiB (no budget recorded) keeps
    its step times and gets the fleet's capacity; one already sized is left alone."""
    old = {k: v for k, v in DEFAULT.to_json().items()
           if k not in ("kv_cache_bytes", "kv_bytes_per_block")}
    path = tmp_path / "old.json"
    path.write_text(json.dumps({**old, "kv_blocks": 1456}))
    cal = calibration.load(path)
    assert (cal.kv_blocks, cal.kv_cache_bytes, cal.prefill_s_per_token) == (
        2912, 2 * 2**30, DEFAULT.prefill_s_per_token)
    assert "was 1456" in cal.source
    assert calibration.for_fleet(DEFAULT) is DEFAULT
    cached = calibration.load_or_measure(path)
    assert cached.kv_blocks == 2912 and cached.source.startswith(f"cached {path}")


def test_decision_cost_measures_every_size(redis_server: RedisServer, tmp_path: Path) -> None:
    out, profile = tmp_path / "cost.json", tmp_path / "cost.pstats"
    assert decision_cost.main(["--sizes", "2,4", "--decisions", "5", "--blocks-per-engine",
                               "50", "--prompt-tokens", "200", "--redis-url",
                               redis_server.url, "--json", str(out),
                               "--profile", str(profile)]) == 0
    sizes = json.loads(out.read_text())["sizes"]
    assert set(sizes) == {"2", "4"}
    for row in sizes.values():
        assert row["decision_p99_ms"] >= row["decision_p50_ms"] > 0
        assert row["redis_bytes_per_block"] > 16  # at least the 16-byte hash itself
    calls = pstats.Stats(str(profile)).stats  # type: ignore[attr-defined]
    decides = [v for (file, _, name), v in calls.items()
               if name == "decide" and file.endswith("decision.py")]
    # Every timed decision (2 sizes x 5) entered it at least once; the warm-up ones are not in.
    assert decides and 2 * 5 <= decides[0][1] < 2 * 25


def test_candidate_lookups_keep_the_prefix_policys_hit_rate(
    redis_server: RedisServer, results: dict, tmp_path: Path
) -> None:
    """The same run with every decision on candidates (first block's holders + 1 idle)."""
    out = tmp_path / "candidates.json"
    assert cli.main([*SMALL, "--policies", "prefix", "--full-scan-max-engines", "0",
                     "--candidate-window", "1", "--redis-url", redis_server.url,
                     "--json", str(out)]) == 0
    prefix = json.loads(out.read_text())["policies"]["prefix"]
    assert prefix["hit_rate"] >= 0.95 * results["policies"]["oracle"]["hit_rate"]
    assert prefix["unfinished"] == 0


def test_prefix_repetition_is_the_benchmarks_shape() -> None:
    config = WorkloadConfig(shape="prefix_repetition", tenants=4, turns=1, system_tokens=64,
                            user_tokens=8, sessions_per_s=float("inf"), max_sessions=12)
    wl = Workload(config)
    assert wl.session_starts == [0.0] * 12 and wl.turns_per_session == 1
    turns = [wl.turn(i, 0) for i in range(12)]
    assert {t.tenant for t in turns} == {"default"}
    prefixes = [tuple(t.prompt[:64]) for t in turns]
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [3, 3, 3, 3]
    assert all(len(t.prompt) == 72 for t in turns)
    with pytest.raises(ValueError, match="max_sessions"):
        WorkloadConfig(shape="prefix_repetition")


def test_vs_real_sets_simulated_beside_measured(redis_server: RedisServer,
                                                tmp_path: Path) -> None:
    figures = {"hit_rate": 0.8, "ttft_mean_ms": 500.0, "ttft_median_ms": 200.0,
               "ttft_p99_ms": 2000.0}
    measured = tmp_path / "fleet_bench.json"
    measured.write_text(json.dumps({"cases": {
        "prefix_repetition@inf": {"systems": {"kvfleet-prefix": figures}}}}))
    out = tmp_path / "vs.json"
    assert vs_real.main(["--measured", str(measured), "--rates", "inf", "--num-prompts", "16",
                         "--num-prefixes", "2", "--prefix-len", "64", "--suffix-len", "8",
                         "--output-len", "4", "--default-calibration", "--redis-url",
                         redis_server.url, "--json", str(out)]) == 0
    row = json.loads(out.read_text())["rates"]["inf"]
    assert row["real"] == figures
    assert row["sim"]["completed"] == 16
    # 2 prefixes of 4 blocks, each computed at least once: at most 14 of 16 prompts hit.
    assert 0.0 < row["sim"]["hit_rate"] <= 14 * 64 / (16 * 72)
    assert row["error"]["ttft_p99_ms"] == row["sim"]["ttft_p99_ms"] / 2000.0 - 1.0
