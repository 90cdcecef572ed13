"""A decode step's projections, quantized against dense bfloat16: SmolLM2-135M-shaped layers
(q/k/v 960 x 576, o 576 x 576, gate/up 3072 x 576, down 576 x 1536) of random valid blocks,
swept layer after layer so the weights come from DRAM as in a step, at decode row counts.

Per row count, milliseconds (and GFLOP/s) of one sweep by each path: the quantized register
kernel and panel kernel (engine.quant.qlinear, bfloat16 activations) and the dense bfloat16
weights (the same values rounded, as a bfloat16 copy of the file holds them) by the dense
model's packed backends (engine.models.linear). Best of `--repeats` interleaved rounds.

`python -m benchmarks.quant_sweep_bench [--format Q4_1] [--rows 1 8 32] [--threads 1]`;
one thread is timed in CPU seconds of the calling thread (a shared machine's descheduling does
not inflate it), more threads in wall-clock seconds.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch

from benchmarks.quant_kernel_bench import random_weight
from engine.models.linear import apply_linear, backend_supported, pack_weight
from engine.quant.qlinear import KERNEL, PANEL, PANEL_Q4, PANEL_Q4P, QuantLinear

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def _paths(fmt: str, layers: list[list[QuantLinear]], dense: list[list[torch.Tensor]],
           packed: dict[str, list[list[torch.Tensor | None]]],
           xs: dict[int, torch.Tensor]) -> dict[str, Callable[[int, int], object]]:
    """Per path, a call of projection j of layer i on x of its K."""
    paths: dict[str, Callable[[int, int], object]] = {
        f"{fmt} kernel": lambda i, j: layers[i][j].run(xs[SHAPES[j][1]], KERNEL),
        f"{fmt} panel": lambda i, j: layers[i][j].run(xs[SHAPES[j][1]], PANEL),
    }
    if fmt != "Q8_0":
        paths[f"{fmt} panel-q4"] = lambda i, j: layers[i][j].run(xs[SHAPES[j][1]], PANEL_Q4)
        if all(s.packed is not None for layer in layers for m in layer for s in m.segments):
            paths[f"{fmt} panel-q4p"] = lambda i, j: layers[i][j].run(xs[SHAPES[j][1]],
                                                                       PANEL_Q4P)
    for b in packed:
        paths[f"dense bf16 {b}"] = functools.partial(_dense_call, xs, dense, b, packed[b])
    return paths


def _dense_call(xs: dict[int, torch.Tensor], dense: list[list[torch.Tensor]], backend: str,
                packed: list[list[torch.Tensor | None]], i: int, j: int) -> object:
    return apply_linear(xs[SHAPES[j][1]], dense[i][j], None, backend, packed[i][j])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", default="Q4_1", choices=["Q4_0", "Q4_1", "Q8_0"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    layers = [[QuantLinear([random_weight(args.format, n, k, seed=4 * i + j)])
               for j, (n, k) in enumerate(SHAPES)] for i in range(args.layers)]
    if args.format != "Q8_0":
        for layer in layers:
            for m in layer:
                m.pack_panels()
    dense = [[m.dequantized_weight(torch.bfloat16) for m in layer] for layer in layers]
    backends = [b for b in ("panel", "onednn") if backend_supported(b, torch.bfloat16)]
    packed = {b: [[pack_weight(w, b) for w in layer] for layer in dense] for b in backends}

    def sweep(call: Callable[[int, int], object]) -> float:
        start = clock()
        for i in range(args.layers):
            for j in range(len(SHAPES)):
                call(i, j)
        return clock() - start

    flops_per_row = 2 * sum(n * k for n, k in SHAPES) * args.layers
    with torch.inference_mode():
        for rows in args.rows:
            xs = {k: torch.randn(rows, k).bfloat16() for k in {k for _, k in SHAPES}}
            paths = _paths(args.format, layers, dense, packed, xs)
            best = dict.fromkeys(paths, float("inf"))
            for _ in range(args.repeats):
                for name, call in paths.items():
                    best[name] = min(best[name], sweep(call))
            print(f"{rows:4d} rows: " + ", ".join(
                f"{name} {t * 1e3:.1f} ms ({flops_per_row * rows / t / 1e9:.0f} GFLOP/s)"
                for name, t in best.items()), flush=True)


if __name__ == "__main__":
    main()
