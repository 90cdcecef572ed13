"""Micro-benchmark of one MoE layer's experts: the PyTorch path vs the fused C++ kernel.

A SmolLM2-size MoE layer (hidden 576, 8 experts of width 1536, top-2, renormalised as
Mixtral), random weights (seeded), random hidden states. For each batch size T of
`--tokens` (1, 8, 64, 512): the router runs once, then the experts of
engine.models.moe through `forward_reference` (PyTorch: a stable argsort, per-expert GEMMs,
index_add_) and `forward_fused` (float32: kernels/cpu/fused_moe_panel.cpp on the packed
copy; bfloat16: kernels/cpu/fused_moe.cpp), alternating, best of `--repeats` rounds
of `--iters` calls each. tokens/s = T / seconds per call. The machine's load average is
printed beside the figures (a shared machine's numbers are only comparable within one run).

Usage: python -m benchmarks.moe_bench [--dtype float32|bfloat16] [--repeats 5]
Writes bench_results/moe_bench.json (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.machine import cpu_info
from engine.models.config import ModelConfig
from engine.models.moe import SparseMoeBlock
from engine.models.moe_select import fused_available

HIDDEN, INTER, EXPERTS, TOP_K = 576, 1536, 8, 2


def make_block(dtype: torch.dtype) -> SparseMoeBlock:
    config = ModelConfig.from_dict({
        "architectures": ["MixtralForCausalLM"], "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_hidden_layers": 1, "num_attention_heads": 9,
        "num_key_value_heads": 3, "vocab_size": 49152, "num_local_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
    })
    block = SparseMoeBlock(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in (block.gate, block.gate_up, block.down):
            param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    block = block.to(dtype).eval()
    block.pack_panels()  # float32: the packed copy the engine's fused path runs on
    return block


def seconds_per_call(fn: Callable[[], object], iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


@torch.inference_mode()
def measure(block: SparseMoeBlock, tokens: int, args: argparse.Namespace) -> dict[str, float]:
    dtype = block.gate_up.dtype
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    weights, ids = block.route(x)
    iters = max(1, args.iters * 8 // tokens)  # about the same time per round at every T
    best = {"pytorch": float("inf"), "fused": float("inf")}
    paths = {"pytorch": block.forward_reference, "fused": block.forward_fused}
    for _ in range(args.repeats):
        for name, path in paths.items():
            seconds = seconds_per_call(lambda p=path: p(x, weights, ids), iters)
            best[name] = min(best[name], seconds)
    return {name: tokens / s for name, s in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20, help="calls per round at T=8")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--out", type=Path, default=Path("bench_results/moe_bench.json"))
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not fused_available(dtype):
        raise SystemExit("the fused MoE kernel is not available (C++ CPU kernels not built)")
    block = make_block(dtype)
    rows = []
    print(f"MoE layer H={HIDDEN} I={INTER} E={EXPERTS} top-{TOP_K}, {args.dtype}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'T':>5} {'pytorch tok/s':>14} {'fused tok/s':>12} {'speedup':>8}  load")
    for tokens in args.tokens:
        result = measure(block, tokens, args)
        load = os.getloadavg()[0]
        speedup = result["fused"] / result["pytorch"]
        rows.append({"tokens": tokens, **result, "speedup": speedup, "load_1m": load})
        print(f"{tokens:>5} {result['pytorch']:>14.0f} {result['fused']:>12.0f} "
              f"{speedup:>7.2f}x  {load:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"dtype": args.dtype, "cpu": cpu_info(),
                                    "threads": torch.get_num_threads(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
