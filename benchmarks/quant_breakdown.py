"""Where one decode step's time goes, per part of the model: the quantized (or dense)
projections by kind, attention, RoPE, norms, SiLU-and-mul, the LM head (with its greedy
argmax or sampler), the embedding, and the rest of `engine.step` (scheduling, input building,
Python).

Each part's modules get a timing wrapper on their instance's `forward` (or the LayerOps /
runner method), so the model's code runs unchanged; the wrappers cost ~1 us a call (about 250
calls a step), counted in the parts they wrap. Parts never nest: the step total minus their sum
is "other". Systems as in benchmarks.quant_bench.

`--threads 1 --clock cpu` (what a machine shared with other jobs needs): one thread, timed
by its CPU seconds, which a descheduled slice does not inflate; with two threads every
parallel region waits on whichever thread is descheduled, and wall time at a load of 5-10
is mostly those waits.

Usage: python -m benchmarks.quant_breakdown [--systems gguf-q4_1-f32 ...] [--batch 1]
[--steps 64] [--threads N] [--clock wall|cpu]. Prints ms a step per part and its share.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.quant_bench import _prompts, systems
from engine import LLM, SamplingParams

PROJECTIONS = (("self_attn", "qkv_proj", "qkv"), ("self_attn", "o_proj", "o"),
               ("mlp", "gate_up_proj", "gate_up"), ("mlp", "down_proj", "down"))


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}


class Timers:
    """Seconds per part, accumulated only while `active` (the timed decode steps)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.active = False
        self.clock = clock

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return fn(*args, **kwargs)
            start = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += self.clock() - start
        return timed


def _wrap(obj: object, method: str, part: str, timers: Timers) -> None:
    # An instance attribute shadows the class's method for this object only.
    setattr(obj, method, timers.wrap(part, getattr(obj, method)))


def instrument(llm: LLM, timers: Timers) -> None:
    """Wrap the model's parts (instance attributes shadow the class methods)."""
    runner = llm.engine.runner
    model = runner.model
    for layer in model.layers:
        for block, name, part in PROJECTIONS:
            proj = getattr(getattr(layer, block), name)
            _wrap(proj, "forward", part, timers)
            if hasattr(proj, "silu_and_mul"):  # the dense float32 panel's fused gate/up + SiLU
                _wrap(proj, "silu_and_mul", part, timers)
        _wrap(layer.get_submodule("self_attn.attn"), "forward", "attention", timers)
    # rotary_qkv_write_kv (the fused RoPE + K/V write, where a version has it) counts as
    # "rope": the K/V write it takes over is then not in "attention".
    for method, part in (("rotary_qkv", "rope"), ("rotary_qkv_write_kv", "rope"),
                         ("rms_norm", "norms"), ("add_rms_norm", "norms"),
                         ("silu_and_mul", "silu_mul")):
        if hasattr(model.ops, method):
            _wrap(model.ops, method, part, timers)
    _wrap(model.embed_tokens, "forward", "embedding", timers)
    _wrap(model, "greedy_tokens", "lm_head+argmax", timers)
    _wrap(model, "compute_logits", "lm_head+argmax", timers)
    _wrap(runner, "sampler", "sampler", timers)


def breakdown(engine_args: dict[str, Any], args: argparse.Namespace) -> dict[str, float]:
    """ms a decode step per part, over `args.steps` steps of a batch of `args.batch`."""
    llm = LLM(max_model_len=args.prompt_len + args.steps + 32, **engine_args)
    timers = Timers(CLOCKS[args.clock])
    instrument(llm, timers)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
    for round_ in range(2):  # the first round warms up (allocations, first-call costs)
        prompts = _prompts(args.batch, args.prompt_len, seed=round_)
        requests = [engine.add_request(f"r{round_}-{i}", p, params) for i, p in enumerate(prompts)]
        while any(r.num_output_tokens == 0 for r in requests):
            engine.step()
        timers.seconds.clear()
        timers.active = round_ == 1
        start = timers.clock()
        for _ in range(args.steps):
            engine.step()
        total = timers.clock() - start
        timers.active = False
        while engine.has_unfinished_requests():
            engine.step()
    parts = {k: v * 1e3 / args.steps for k, v in sorted(timers.seconds.items())}
    parts["other"] = total * 1e3 / args.steps - sum(parts.values())
    parts["step"] = total * 1e3 / args.steps
    return parts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", nargs="+", default=["gguf-q4_1-f32", "gguf-q4_1-bf16",
                                                          "int8-bf16", "dense-bfloat16"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="cpu: the main thread's CPU seconds (use with --threads 1)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    table = {name: breakdown(engine_args, args) for name, engine_args in systems().items()
             if name in args.systems}
    parts = sorted({p for row in table.values() for p in row} - {"other", "step"})
    parts += ["other", "step"]
    print(f"{'ms/step':<16}" + "".join(f"{name:>18}" for name in table))
    for part in parts:
        cells = []
        for row in table.values():
            ms = row.get(part, 0.0)
            cells.append(f"{ms:>10.3f} ({100 * ms / row['step']:4.1f}%)")
        print(f"{part:<16}" + "".join(cells))


if __name__ == "__main__":
    main()
