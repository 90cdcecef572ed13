"""The benchmarks' printed reports: the offline one (A, B, C) from the result dict written to
JSON, and the pieces every scenario's report shares (PASS/MISS, ratios, side-by-side tables,
target lines, the CPU line).

Pure formatting: every figure printed is in the JSON, so a report can be re-printed from a saved
run (`python -m benchmarks.report bench_results/offline_throughput.json`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

Row = dict[str, Any]


def pf(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing (a system that did not run) or b is zero."""
    return a / b if a is not None and b else None


def times(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def target_line(label: str, r: float, target: float) -> str:
    """One target's verdict, as every scenario prints it."""
    return f"{label} {r:.2f}x (>= {target}x): {pf(r >= target)}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]], first: int = 26,
          width: int = 11) -> list[str]:
    """A side-by-side table: the first column left-aligned, the others right-aligned."""
    def line(cells: Sequence[str]) -> str:
        return (f"{cells[0]:<{first}}" + "".join(f"{c:>{width}}" for c in cells[1:])).rstrip()

    return [line(header), *(line(r) for r in rows)]


def cpu_line(cpu: Row) -> str:
    isa = cpu["isa"]
    amx = isa.get("amx_bf16") or isa.get("amx_tile")
    flags = (f"avx512f {'yes' if isa.get('avx512f') else 'no'}, avx512_bf16 "
             f"{'yes' if isa.get('avx512_bf16') else 'no'}, amx {'yes' if amx else 'no'}")
    return f"CPU: {cpu['model_name']}, {cpu['logical_cpus']} logical CPUs; {flags}"


def vllm_line(res: Row) -> str | None:
    sys_ = res["systems"]
    facts = next(iter(sys_["vllm"].values()), None)
    if facts is None:
        return None
    if sys_["tcmalloc"]:
        alloc = f"{facts['allocator']} (LD_PRELOAD {sys_['tcmalloc']})"
    else:
        alloc = (f"{facts['allocator']}: tcmalloc not found, running without it "
                 "(apt-get install libtcmalloc-minimal4)")
    mode = "torch.compile" if sys_["vllm_compiled"] else "eager"
    return (f"vLLM {facts['vllm']}: torch {facts['torch']} ({facts['torch_cpu_capability']}), "
            f"OpenMP threads bound to CPUs {facts['omp_threads_bind']} "
            f"({sys_['vllm_threads']} threads), {alloc}, {mode}, "
            f"KV cache {facts['kvcache_space_gib']} GiB, block size {facts['block_size']}")


def print_systems(res: Row) -> None:
    print(cpu_line(res["cpu"]))
    kv = res["systems"]["kvfleet"]
    backends = ", ".join(f"{d} {b}" for d, b in kv.get("linear_backend", {}).items())
    print(f"kvfleet: torch {kv['torch']} ({kv['torch_cpu_capability']}), {kv['threads']} torch "
          f"threads, {kv['allocator']}" + (f"; linear backend chosen at start: {backends}"
                                           if backends else ""))
    if any(p.startswith("hf") for p in res["config"]["peers"]):
        print(f"transformers {kv['transformers']}: in kvfleet's process (same torch, threads, "
              "allocator)")
    if line := vllm_line(res):
        print(line)


def print_a(a: Row) -> None:
    print(f"\nA. offline throughput, {a['dtype']}, median of {a['repeats']} round(s)")
    print(f"{'system':<42}{'wall s':>9}{'gen tok/s':>11}{'total tok/s':>13}{'kvfleet x':>11}")
    for r in a["rows"]:
        ratio = f"{r['kvfleet_ratio']:.2f}x" if "kvfleet_ratio" in r else "-"
        print(f"{r['system']:<42}{r['wall_s']:>9.2f}{r['gen_tok_s']:>11.1f}"
              f"{r['total_tok_s']:>13.1f}{ratio:>11}")
    if v := a.get("vs_vllm"):
        print(f"kvfleet / vLLM gen tok/s: {v['ratio']:.2f}x  target >= {v['target']:.1f}x  "
              f"{pf(v['pass'])}")
    if t := a.get("vs_transformers"):
        target = f"  target >= {t['target']:.1f}x  {pf(t['pass'])}" if a["dtype"] == "float32" \
            else ""
        print(f"kvfleet / transformers (best: {t['best']}): {t['ratio']:.2f}x{target}")
    for row in a["rows"][1:]:
        s = row["agreement"]
        where = f" (request: first differing token {s['first_divergence']})" \
            if s["first_divergence"] else ""
        print(f"greedy tokens: kvfleet == {row['system']} for {s['equal']}/{s['checked']} "
              f"requests{where}")
    print(f"kvfleet preemptions {a['kvfleet_preemptions']}, prefix-hit tokens "
          f"{a['kvfleet_prefix_hit_tokens']}, KV blocks {a['num_kv_blocks']}")


def print_b(b: Row) -> None:
    print(f"\nB. prefix cache ({b['dtype']}): {b['prompt_tokens']}-token prompt (1,024 shared + "
          "16 unique), max_tokens=1, medians")
    print(f"kvfleet TTFT cold   {b['kvfleet_cold_ttft_s'] * 1e3:9.1f} ms  "
          f"tokens computed {b['cold_tokens_computed']}")
    print(f"kvfleet TTFT cached {b['kvfleet_cached_ttft_s'] * 1e3:9.1f} ms  "
          f"tokens computed {b['cached_tokens_computed']}")
    print(f"cold / cached {b['cold_over_cached']:.1f}x  target >= {b['target']:.0f}x  "
          f"{pf(b['pass'])}")
    if b["transformers_ttft_s"] is not None:
        print(f"transformers generate TTFT (same prompt) {b['transformers_ttft_s'] * 1e3:.1f} ms")


def print_c(c: Row) -> None:
    bs = c["block_size"]
    print(f"\nC. KV waste during A ({c['dtype']}, {c['steps']} steps, {bs}-token blocks; "
          "held = num_tokens)")
    print(f"waste mean {c['waste_mean']:.2%} (time-weighted {c['waste_mean_time_weighted']:.2%})"
          f", max {c['waste_max']:.2%}; {bs}-token-block floor mean {c['waste_floor_mean']:.2%}")
    print(f"allocated beyond the floor (1 - floor slots / allocated): mean "
          f"{c['beyond_floor_mean']:.2%}, max {c['beyond_floor_max']:.2%}")
    print(f"(held = KV written: mean {c['waste_kv_mean']:.2%}, max {c['waste_kv_max']:.2%})")


def print_targets(res: Row) -> None:
    lines = [f"A {d}: kvfleet >= {a['vs_vllm']['target']:.1f}x vLLM gen tok/s "
             f"({a['vs_vllm']['ratio']:.2f}x) {pf(a['vs_vllm']['pass'])}"
             for d, a in res["A"].items() if "vs_vllm" in a]
    if b := res.get("B"):
        lines.append(f"B: cached TTFT >= {b['target']:.0f}x faster than cold "
                     f"({b['cold_over_cached']:.1f}x) {pf(b['pass'])}")
    if lines:
        print("\ntargets:\n  " + "\n  ".join(lines))


def print_report(res: Row) -> None:
    cfg = res["config"]
    print(f"\n== kvfleet offline benchmark: {cfg['model']}, {cfg['num_prompts']} prompts of "
          f"16-256 random ids, {cfg['output_len']} greedy tokens each (EOS ignored) ==")
    print_systems(res)
    for a in res["A"].values():
        print_a(a)
    if b := res.get("B"):
        print_b(b)
    if c := res.get("C"):
        print_c(c)
    print_targets(res)
    print(f"\ntotal run time {res['total_run_s']:.1f} s; load average before "
          f"{res['env']['loadavg_before']}, after {res['env']['loadavg_after']}")


if __name__ == "__main__":
    print_report(json.loads(Path(sys.argv[1]).read_text(encoding="utf-8")))
