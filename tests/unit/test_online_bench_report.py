"""The online bench's arithmetic: medians over alternated rounds and the D verdicts (the runs
themselves need vLLM and are in tests/slow/test_vllm_peer.py)."""

from __future__ import annotations

from typing import Any

from benchmarks.online import (
    POISSON_CASE,
    auto_poisson_rate,
    check_targets,
    median_rows,
    round_ratios,
)


def row(req: float, ttft: float, tpot: float) -> dict[str, Any]:
    return {"completed": 64, "req_per_s": req, "ttft_mean_ms": ttft, "tpot_mean_ms": tpot}


def test_median_rows_takes_each_figure_over_the_rounds_that_ran_the_case() -> None:
    rounds = [{"random": row(2.0, 900, 300)},
              {"random": row(3.0, 700, 200), POISSON_CASE: row(1.5, 100, 50)},
              {"random": row(2.5, 800, 400)}]
    medians = median_rows(rounds)
    assert medians["random"] == row(2.5, 800, 300)
    assert medians[POISSON_CASE] == row(1.5, 100, 50)
    # Two rounds: figures average the middle pair, counts stay whole.
    two = median_rows([{"random": row(2.0, 900.0, 300.0)}, {"random": row(3.0, 700.0, 200.0)}])
    assert two["random"] == row(2.5, 800, 250) and two["random"]["completed"] == 64
    assert isinstance(two["random"]["completed"], int)


def test_rate_inf_needs_the_throughput_line_and_no_worse_latency() -> None:
    res = {"results": {"kvfleet": {"random": row(2.3, 900, 200)},
                       "vllm": {"random": row(2.0, 1000, 210)}}}
    assert check_targets(res) == [
        "D random: req/s 1.15x (>= 1.1x), mean TTFT no worse, mean TPOT no worse: PASS"]
    res["results"]["kvfleet"]["random"] = row(2.3, 1100, 200)
    assert check_targets(res)[0].endswith("mean TTFT WORSE, mean TPOT no worse: MISS")
    res["results"]["kvfleet"]["random"] = row(2.1, 900, 200)
    assert check_targets(res)[0].endswith(": MISS")


def test_the_poisson_case_is_judged_on_latency_only() -> None:
    """Both systems serve the offered load there: equal req/s is no miss, worse TPOT is."""
    res = {"results": {"kvfleet": {POISSON_CASE: row(1.6, 300, 100)},
                       "vllm": {POISSON_CASE: row(1.6, 500, 150)}}}
    assert check_targets(res) == [
        f"D {POISSON_CASE}: req/s 1.00x (offered load, level by design), mean TTFT no worse, "
        "mean TPOT no worse: PASS"]
    res["results"]["kvfleet"][POISSON_CASE] = row(1.6, 300, 160)
    assert check_targets(res)[0].endswith("mean TPOT WORSE: MISS")


def test_the_auto_poisson_rate_is_a_fraction_of_the_slower_systems_rate_inf() -> None:
    # 0.8 x the faster system's 2.5 req/s would offer 2.0, above the slower one's capacity.
    first_round = {"kvfleet": {"random": row(2.5, 1.0, 1.0)},
                   "vllm": {"random": row(1.8, 1.0, 1.0)}}
    assert auto_poisson_rate(first_round) == 1.44
    assert auto_poisson_rate({"kvfleet": {"random": row(2.5, 1.0, 1.0)}}) == 2.0
    assert auto_poisson_rate({"kvfleet": {"prefix_repetition": row(2.5, 1.0, 1.0)}}) is None


def test_round_ratios_pair_each_round_of_the_two_systems() -> None:
    per_round = {
        "kvfleet": [{"random": row(2.0, 1000, 200)},
                    {"random": row(3.0, 900, 300), POISSON_CASE: row(1.5, 100, 50)}],
        "vllm": [{"random": row(1.0, 500, 400)}, {"random": row(2.0, 900, 200)}],
    }
    assert round_ratios(per_round) == {
        "random": {"req_per_s": [2.0, 1.5], "ttft_mean_ms": [2.0, 1.0],
                   "tpot_mean_ms": [0.5, 1.5]}}
    assert round_ratios({"kvfleet": per_round["kvfleet"]}) == {}
