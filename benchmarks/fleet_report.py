"""The fleet benchmark's verdicts (issue 35's targets) and printed report, from its result dict.

Pure: every figure printed is in the JSON (`python -m benchmarks.fleet_report FILE` prints a
saved run again). Targets, per case (shape x rate), kvfleet-prefix against:
- its ceiling: hit rate >= 98% of the prefix-cache ceiling at its block size;
- sglang-cache_aware: TTFT mean and p99 <= 0.8x, TPOT mean no worse; at rate inf also
  req/s >= 1.3x;
- kvfleet-round_robin: TTFT mean and p99 and TPOT mean no worse.
Single engine with defaults: kvfleet-defaults >= 1.1x vllm-defaults req/s with mean TTFT and
mean TPOT no worse, in every round.
A check whose systems did not run is left out (not a MISS).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.report import pf, ratio, table, times

Row = dict[str, Any]
HIT_OF_CEILING = 0.98
TTFT_VS_SGLANG = 0.8
SPEEDUP_VS_SGLANG = 1.3  # at rate inf
SPEEDUP_DEFAULTS = 1.1
OURS = "kvfleet-prefix"
REFERENCES = {"sglang-cache_aware": TTFT_VS_SGLANG, "kvfleet-round_robin": 1.0}
COMPARED = ("req_per_s", "ttft_mean_ms", "ttft_p99_ms", "tpot_mean_ms")
LABELS = {"req_per_s": "req/s", "ttft_mean_ms": "TTFT mean", "ttft_p99_ms": "TTFT p99",
          "tpot_mean_ms": "TPOT mean"}


def verdict(case: str, text: str, ok: bool) -> Row:
    return {"case": case, "text": text, "pass": ok}


def ratios(a: Row, b: Row) -> dict[str, float | None]:
    """a / b for the compared figures (above 1 favours a for req/s, below 1 for latencies)."""
    return {k: ratio(a.get(k), b.get(k)) for k in COMPARED}


def at_most(r: float | None, limit: float) -> bool:
    """A ratio within its limit; a missing one (a system that failed) is not."""
    return r is not None and r <= limit


def hit_verdict(case: str, row: Row) -> list[Row]:
    hit, ceiling = row.get("hit_rate"), row.get("ceiling")
    if hit is None or not ceiling:
        return []
    share = hit / ceiling
    return [verdict(case, f"hit rate {hit:.1%} = {share:.1%} of the {row['block_size']}-token "
                          f"ceiling {ceiling:.1%} (>= {HIT_OF_CEILING:.0%})",
                    share >= HIT_OF_CEILING)]


def latency_verdict(case: str, ours: Row, ref_name: str, ref: Row, factor: float) -> Row:
    r = ratios(ours, ref)
    ttft_ok = all(at_most(r[k], factor) for k in ("ttft_mean_ms", "ttft_p99_ms"))
    tpot_ok = at_most(r["tpot_mean_ms"], 1.0)
    return verdict(case, f"vs {ref_name}: TTFT mean {times(r['ttft_mean_ms'])}, p99 "
                         f"{times(r['ttft_p99_ms'])} (<= {factor}x), TPOT mean "
                         f"{times(r['tpot_mean_ms'])} (<= 1.0x)", ttft_ok and tpot_ok)


def case_verdicts(case: str, rate: float | None, systems: Mapping[str, Row]) -> list[Row]:
    """Every target of one case that its systems allow checking."""
    ours = systems.get(OURS)
    if not ours:
        return []
    out = hit_verdict(case, ours)
    for ref_name, factor in REFERENCES.items():
        if ref_name in systems:
            out.append(latency_verdict(case, ours, ref_name, systems[ref_name], factor))
    sglang = systems.get("sglang-cache_aware")
    if rate is None and sglang:
        r = ratio(ours.get("req_per_s"), sglang.get("req_per_s"))
        out.append(verdict(case, f"req/s vs sglang-cache_aware {times(r)} "
                                 f"(>= {SPEEDUP_VS_SGLANG}x)",
                           r is not None and r >= SPEEDUP_VS_SGLANG))
    return out


def defaults_verdicts(rounds: Sequence[Mapping[str, Row]]) -> list[Row]:
    """kvfleet-defaults vs vllm-defaults, one verdict per round that ran both, then overall."""
    out = []
    for i, systems in enumerate(rounds):
        kv, vl = systems.get("kvfleet-defaults"), systems.get("vllm-defaults")
        if not kv or not vl:
            continue
        r = ratios(kv, vl)
        ok = (r["req_per_s"] is not None and r["req_per_s"] >= SPEEDUP_DEFAULTS
              and all(at_most(r[k], 1.0) for k in ("ttft_mean_ms", "tpot_mean_ms")))
        out.append(verdict(f"round {i}", f"req/s {times(r['req_per_s'])} (>= "
                                         f"{SPEEDUP_DEFAULTS}x), TTFT mean "
                                         f"{times(r['ttft_mean_ms'])}, TPOT mean "
                                         f"{times(r['tpot_mean_ms'])} (<= 1.0x)", ok))
    if out:
        out.append(verdict("all rounds", f"{sum(v['pass'] for v in out)}/{len(out)} rounds pass",
                           all(v["pass"] for v in out)))
    return out


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def system_table(systems: Mapping[str, Row]) -> list[str]:
    names = list(systems)
    fields = (("req/s", "req_per_s", ".2f"), ("TTFT mean ms", "ttft_mean_ms", ",.0f"),
              ("TTFT p50 ms", "ttft_median_ms", ",.0f"), ("TTFT p99 ms", "ttft_p99_ms", ",.0f"),
              ("TPOT mean ms", "tpot_mean_ms", ",.1f"), ("hit rate", "hit_rate", ".1%"),
              ("ceiling (block)", "ceiling", ".1%"), ("completed", "completed", "d"),
              ("failed", "failed", "d"))
    rows = [[label, *(_fmt(systems[n].get(key), spec) for n in names)]
            for label, key, spec in fields]
    rows.append(["requests/engine", *("/".join(str(v) for v in
                                               systems[n].get("requests_per_engine", {}).values())
                                      or "-" for n in names)])
    if any("decision_reasons" in systems[n] for n in names):
        rows.append(["decisions", *(" ".join(f"{k} {v}" for k, v in
                                             systems[n].get("decision_reasons", {}).items())
                                    or "-" for n in names)])
    return table(["", *names], rows, first=18, width=20)


def ratio_lines(systems: Mapping[str, Row], ours: str, refs: Sequence[str]) -> list[str]:
    out = []
    for ref in refs:
        if ours in systems and ref in systems:
            r = ratios(systems[ours], systems[ref])
            out.append(f"{ours} / {ref}: " + ", ".join(f"{LABELS[k]} {times(v)}"
                                                       for k, v in r.items()))
    return out


def print_case(key: str, case: Row) -> None:
    print(f"\n{key}: {case['shape']}; token-level ceiling {case['ceiling_token']:.1%}")
    for line in system_table(case["systems"]):
        print(line)
    for line in ratio_lines(case["systems"], OURS, list(REFERENCES)):
        print(line)


def print_round(index: int, shape: str, systems: Mapping[str, Row]) -> None:
    print(f"\nsingle engine, defaults, round {index}: {shape}")
    for line in system_table(systems):
        print(line)
    for line in ratio_lines(systems, "kvfleet-defaults", ["vllm-defaults"]):
        print(line)


def print_report(res: Row) -> None:
    cfg = res["config"]
    print(f"\n== fleet bench: vllm bench serve (openai, /v1/completions, streaming, greedy, "
          f"EOS ignored) against each system; {cfg['dtype']}, model {cfg['model']} ==")
    for line in res["system_lines"]:
        print(line)
    for key, case in res["cases"].items():
        print_case(key, case)
    for i, systems in enumerate(res.get("rounds", [])):
        print_round(i, res["defaults_shape"], systems)
    if res["targets"]:
        print("\ntargets:")
        for v in res["targets"]:
            print(f"  {v['case']}: {v['text']}: {pf(v['pass'])}")


if __name__ == "__main__":
    print_report(json.loads(Path(sys.argv[1]).read_text(encoding="utf-8")))
