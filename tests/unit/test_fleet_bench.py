"""The fleet benchmark's pure parts (benchmarks/fleet_metrics.py, fleet_report.py,
fleet_prompts.py, fleet_bench.py): the prefix-cache ceiling, hit rates and requests per engine
from Prometheus text, PASS/MISS on made-up figures, and a report printed from the dict alone.
No servers.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import fleet_bench, fleet_metrics, fleet_prompts, fleet_report
from benchmarks.vllm_runner import PeerError
from benchmarks.vllm_serving import ServedProcess, free_port

KVFLEET_METRICS = """\
# HELP kvfleet:prefix_cache_queries_total Prompt tokens looked up in the prefix cache
# TYPE kvfleet:prefix_cache_queries_total counter
kvfleet:prefix_cache_queries_total{model_name="m"} 1000.0
kvfleet:prefix_cache_queries_created{model_name="m"} 1.7e9
kvfleet:prefix_cache_hits_total{model_name="m"} 600.0
kvfleet:request_success_total{finished_reason="length",model_name="m"} 7.0
kvfleet:request_success_total{finished_reason="stop",model_name="m"} 3.0
kvfleet:prompt_tokens_total{model_name="m"} 1000.0
"""

VLLM_METRICS = """\
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 50.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 0.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 9.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 2.0
vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0"} 1.0
"""


def test_counters_sum_label_sets_and_ignore_other_names() -> None:
    assert fleet_metrics.counters(KVFLEET_METRICS, "kvfleet:") == {
        "prefix_cache_queries": 1000.0, "prefix_cache_hits": 600.0, "request_success": 10.0}
    # external_prefix_cache_hits is not prefix_cache_hits; the vllm: prefix is not kvfleet:
    assert fleet_metrics.counters(VLLM_METRICS, "vllm:") == {
        "prefix_cache_queries": 50.0, "prefix_cache_hits": 0.0, "request_success": 2.0}
    assert fleet_metrics.counters(VLLM_METRICS, "kvfleet:")["prefix_cache_queries"] == 0.0


def test_block_size_from_vllm_cache_config_info() -> None:
    assert fleet_metrics.block_size(VLLM_METRICS) == 128
    assert fleet_metrics.block_size(KVFLEET_METRICS) is None


def snap(queries: float, hits: float, requests: float) -> dict[str, float]:
    return {"prefix_cache_queries": queries, "prefix_cache_hits": hits,
            "request_success": requests}


def test_hit_rate_and_requests_from_before_after() -> None:
    before = {"engine-0": snap(100, 10, 4), "engine-1": snap(0, 0, 4)}
    after = {"engine-0": snap(1100, 810, 14), "engine-1": snap(1000, 200, 10)}
    change = fleet_metrics.delta(before, after)
    assert change["engine-0"] == snap(1000, 800, 10)
    assert fleet_metrics.hit_rate(change) == pytest.approx(1000 / 2000)
    assert fleet_metrics.requests_per_engine(change) == {"engine-0": 10, "engine-1": 6}
    assert fleet_metrics.hit_rate({"e": snap(0, 0, 0)}) is None
    # An engine absent from the first snapshot counts from zero.
    assert fleet_metrics.delta({}, {"e": snap(5, 1, 1)}) == {"e": snap(5, 1, 1)}


def test_ceiling_token_level_counts_each_shared_prefix_once() -> None:
    a, b = list(range(100, 110)), list(range(200, 210))
    prompts = [a + [1, 2], a + [3, 4], a + [5, 6], b + [7]]
    # a is computed once, found by 2 later prompts (10 tokens each); b is never shared.
    assert fleet_metrics.prefix_ceiling(prompts) == pytest.approx(20 / 47)
    # Order does not matter.
    assert fleet_metrics.prefix_ceiling(prompts[::-1]) == pytest.approx(20 / 47)


def test_ceiling_in_blocks_and_the_last_token_rule() -> None:
    shared = list(range(10))
    prompts = [shared + [50], shared + [60]]
    assert fleet_metrics.prefix_ceiling(prompts, 1) == pytest.approx(10 / 22)
    assert fleet_metrics.prefix_ceiling(prompts, 4) == pytest.approx(8 / 22)  # 2 whole blocks
    # Identical prompts: the last token is always computed, so 7 of 8 tokens at most ...
    assert fleet_metrics.prefix_ceiling([[1] * 8, [1] * 8]) == pytest.approx(7 / 16)
    # ... and in 4-token blocks only the first block (the second would hold the last token).
    assert fleet_metrics.prefix_ceiling([[1] * 8, [1] * 8], 4) == pytest.approx(4 / 16)
    # Blocks match only after the same earlier blocks.
    assert fleet_metrics.prefix_ceiling([[1, 2, 3, 4, 9, 9], [5, 6, 7, 8, 9, 9]], 2) == 0.0
    assert fleet_metrics.prefix_ceiling([]) == 0.0
    with pytest.raises(ValueError):
        fleet_metrics.prefix_ceiling([[1]], 0)


def test_ceiling_of_the_prefix_repetition_shape() -> None:
    rng = random.Random(0)
    prefixes = [[rng.randrange(1000) for _ in range(512)] for _ in range(8)]
    prompts = [p + [rng.randrange(1000) for _ in range(32)] for p in prefixes for _ in range(12)]
    expected = 8 * 11 * 512 / (96 * 544)
    assert fleet_metrics.prefix_ceiling(prompts) == pytest.approx(expected, abs=1e-3)
    assert fleet_metrics.ceilings(prompts, {"kvfleet": 16})["kvfleet"] == pytest.approx(
        expected, abs=1e-3)


def test_conversation_order_keeps_turns_in_order() -> None:
    order = fleet_prompts.conversation_order(5, 3, random.Random(1))
    assert sorted(order) == [(c, k) for c in range(5) for k in range(3)]
    for c in range(5):
        assert [k for cc, k in order if cc == c] == [0, 1, 2]


def test_parse_rates() -> None:
    assert fleet_bench.parse_rates("2, 4,inf") == [2.0, 4.0, None]
    assert fleet_bench.rate_label(None) == "inf" and fleet_bench.rate_label(2.0) == "2"
    with pytest.raises(ValueError):
        fleet_bench.parse_rates("0")


def row(req_s: float, ttft: float, p99: float, tpot: float, **extra: Any) -> dict[str, Any]:
    return {"req_per_s": req_s, "ttft_mean_ms": ttft, "ttft_median_ms": ttft,
            "ttft_p99_ms": p99, "tpot_mean_ms": tpot, "completed": 96, "failed": 0, **extra}


OURS = row(4.0, 400, 800, 50, hit_rate=0.85, ceiling=0.86, block_size=16,
           requests_per_engine={"engine-0": 48, "engine-1": 48})
SGLANG = row(3.0, 600, 900, 50, hit_rate=0.6, ceiling=0.80, block_size=128)
ROUND_ROBIN = row(3.5, 450, 900, 52, hit_rate=0.5, ceiling=0.86, block_size=16)


def test_case_verdicts_pass_and_miss() -> None:
    systems = {"kvfleet-prefix": OURS, "sglang-cache_aware": SGLANG,
               "kvfleet-round_robin": ROUND_ROBIN}
    got = fleet_report.case_verdicts("c@inf", None, systems)
    assert [v["pass"] for v in got] == [True, False, True, True]
    assert "98.8% of the 16-token ceiling" in got[0]["text"]
    assert "TTFT mean 0.67x, p99 0.89x (<= 0.8x)" in got[1]["text"]  # p99 misses
    assert "TPOT mean 1.00x" in got[1]["text"]
    assert "1.33x (>= 1.3x)" in got[3]["text"]
    # A Poisson rate has no req/s target; a missing reference system is no check.
    assert len(fleet_report.case_verdicts("c@2", 2.0, {"kvfleet-prefix": OURS})) == 1
    assert fleet_report.case_verdicts("c@2", 2.0, {"sglang-cache_aware": SGLANG}) == []
    # A failed system (no figures) is a MISS, not a crash.
    failed = fleet_report.case_verdicts("c@2", 2.0, {"kvfleet-prefix": OURS,
                                                     "kvfleet-round_robin": {"error": "x"}})
    assert [v["pass"] for v in failed] == [True, False]
    low_hits = dict(OURS, hit_rate=0.80)
    assert not fleet_report.case_verdicts("c@2", 2.0, {"kvfleet-prefix": low_hits})[0]["pass"]


def test_defaults_verdicts_need_every_round() -> None:
    vllm = row(4.0, 5000, 9000, 150)
    good = {"kvfleet-defaults": row(4.5, 4000, 8000, 140), "vllm-defaults": vllm}
    slow = {"kvfleet-defaults": row(4.3, 4000, 8000, 140), "vllm-defaults": vllm}
    got = fleet_report.defaults_verdicts([good, slow, good])
    assert [v["pass"] for v in got] == [True, False, True, False]
    assert got[-1]["text"] == "2/3 rounds pass"
    assert fleet_report.defaults_verdicts([]) == []


def test_report_prints_from_the_dict(capsys: pytest.CaptureFixture[str]) -> None:
    systems = {"kvfleet-prefix": OURS, "sglang-cache_aware": SGLANG}
    res = {"config": {"dtype": "float32", "model": "m"}, "system_lines": ["CPU: test"],
           "cases": {"prefix_repetition@inf": {
               "rate": None, "shape": "96 prompts", "ceiling_token": 0.86, "systems": systems}},
           "rounds": [{"kvfleet-defaults": row(4.5, 4000, 8000, 140),
                       "vllm-defaults": row(4.0, 5000, 9000, 150)}],
           "defaults_shape": "random 256 in / 64 out"}
    res["targets"] = fleet_bench.targets(res)
    fleet_report.print_report(res)
    out = capsys.readouterr().out
    assert "prefix_repetition@inf: 96 prompts; token-level ceiling 86.0%" in out
    assert "48/48" in out
    assert "kvfleet-prefix / sglang-cache_aware: req/s 1.33x" in out
    assert "round 0: req/s 1.12x (>= 1.1x)" in out
    assert "PASS" in out and "MISS" in out


class FakeServer:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_start_all_is_all_or_none() -> None:
    from benchmarks import fleet_systems

    up = FakeServer()

    def broken() -> Any:
        raise OSError("no port")

    starters: list[Any] = [lambda: up, broken]
    with pytest.raises(OSError, match="no port"):
        fleet_systems._start_all(starters)
    assert up.closed  # the one that came up is not left running
    servers: list[Any] = fleet_systems._start_all([FakeServer, FakeServer])  # type: ignore[list-item]
    assert len(servers) == 2 and not any(s.closed for s in servers)


def test_a_served_process_is_waited_for_and_stopped(tmp_path: Path) -> None:
    # A real process serving HTTP: ready once its URL answers 200, gone after close().
    port = free_port()
    served = ServedProcess(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        dict(os.environ), tmp_path / "served.log", f"http://127.0.0.1:{port}/", 30, "http.server",
    )
    pid = served._proc.pid
    served.close()
    assert served._proc.poll() is not None and served._proc.pid == pid


def test_a_served_process_that_dies_fails_with_its_log(tmp_path: Path) -> None:
    with pytest.raises(PeerError, match="exited before"):
        ServedProcess([sys.executable, "-c", "print('boom')"], dict(os.environ),
                      tmp_path / "dead.log", f"http://127.0.0.1:{free_port()}/", 30, "dead")


def test_labelled_counter_sums_per_label_value() -> None:
    name = "kvfleet:router_routing_decisions"
    text = "\n".join([
        f"# TYPE {name} counter",
        f'{name}_total{{policy="prefix",engine_id="e0",reason="spill"}} 2.0',
        f'{name}_total{{policy="prefix",engine_id="e1",reason="spill"}} 1.0',
        f'{name}_total{{engine_id="e1",policy="prefix",reason="cached"}} 7.0',
        f'{name}_created{{policy="prefix",reason="spill"}} 1.7e9',
        'kvfleet:router_requests_total{tenant="t",code="OK"} 10.0',
    ])
    assert fleet_metrics.labelled_counter(text, "kvfleet:router_routing_decisions", "reason") == {
        "spill": 3.0, "cached": 7.0}
