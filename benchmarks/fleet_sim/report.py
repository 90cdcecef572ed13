"""The printed table and the JSON document of a simulator run."""

from __future__ import annotations

from typing import Any

COLUMNS = (
    ("hit_rate", "hit", "{:.3f}"),
    ("oracle_hit_rate", "oracle_hit", "{:.3f}"),
    ("ideal_hit_rate", "ideal_hit", "{:.3f}"),
    ("miss_share", "miss_share", "{:.3f}"),
    ("ideal_miss_share", "ideal_miss", "{:.3f}"),
    ("max_over_mean_load", "max/mean", "{:.2f}"),
    ("ttft_p50_s", "ttft_p50", "{:.3f}"),
    ("ttft_p90_s", "ttft_p90", "{:.3f}"),
    ("ttft_p99_s", "ttft_p99", "{:.3f}"),
    ("hit_ttft_p90_s", "hit_p90", "{:.3f}"),
    ("miss_ttft_p50_s", "miss_p50", "{:.3f}"),
    ("throughput_rps", "req/s", "{:.2f}"),
    ("decision_p99_ms", "dec_p99_ms", "{:.2f}"),
    ("decision_cpu_p99_ms", "dec_cpu_p99", "{:.2f}"),
    ("unfinished", "unfinished", "{:.0f}"),
)


def table(policies: dict[str, dict[str, float]]) -> str:
    head = f"{'policy':<12}" + "".join(f"{title:>12}" for _, title, _ in COLUMNS)
    lines = [head]
    for name, row in policies.items():
        cells = "".join(f"{fmt.format(row.get(key, 0.0)):>12}" for key, _, fmt in COLUMNS)
        lines.append(f"{name:<12}{cells}")
    return "\n".join(lines)


def with_oracle(policies: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Adds the oracle's hit rate to every row (the ceiling each is judged against)."""
    oracle = policies.get("oracle", {}).get("hit_rate")
    if oracle is None:
        return policies
    return {name: {**row, "oracle_hit_rate": oracle} for name, row in policies.items()}


def document(policies: dict[str, dict[str, float]], meta: dict[str, Any]) -> dict[str, Any]:
    return {"policies": policies, **meta}
