"""Where `kvfleet up --engines 1` spends CPU outside the model: `python -m benchmarks.defaults_cpu`.

Set-up: the fleet `fleet_bench --single-engine-defaults` starts for kvfleet (one engine with
`kvfleet up`'s thread count, `--dtype float32`, the default model), then `--num-prompts` random
prompts of `--input-len` tokens (decoded to text, as `vllm bench serve`'s random dataset sends
them) streamed through the router's OpenAI `/v1/completions`, all at once (rate inf),
`--output-len` tokens each with EOS ignored.

Reported: CPU seconds per request of each process (router, tokenizer, engine, Redis; utime +
stime from /proc before and after the load) and, inside the engine, per thread (the busiest
threads by name: the model's compute threads against the asyncio/gRPC service thread). CPU
seconds stay meaningful on a shared machine where wall time does not; the load average is
printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.one_engine_fleet import one_engine_fleet, service_pids
from benchmarks.proc_cpu import cpu_seconds, stat_cpu
from kvfleet.cli import default_engine_threads
from kvfleet.text.tokenizer import Tokenizer


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread name (threads sharing a name are summed)."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:
            continue
        label = "main" if task.name == str(pid) else name
        out[label] = out.get(label, 0.0) + stat_cpu(task / "stat")
    return out


def random_prompts(model: Path, count: int, length: int, seed: int) -> list[str]:
    from engine.quant.gguf_file import companion_dir, is_gguf

    # A GGUF's tokenizer is in its companion directory, as the fleet's tokenizer service reads.
    tokenizer = Tokenizer.from_dir(companion_dir(model) if is_gguf(model) else model)
    rng = random.Random(seed)
    vocab = tokenizer.vocab_size
    return [tokenizer.decode([rng.randrange(100, vocab - 100) for _ in range(length)])
            for _ in range(count)]


def stream_one(base_url: str, model: str, prompt: str, output_len: int) -> int:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": output_len,
                       "temperature": 0.0, "ignore_eos": True, "stream": True}).encode()
    request = urllib.request.Request(f"{base_url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    events = 0
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            events += line.startswith(b"data: {")
    return events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="HF directory or GGUF file (default: SmolLM2-135M's dense "
                             "directory, `make model`)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    model_dir = args.model
    if model_dir is None:
        from engine.models.default_model import prepare_default_model

        model_dir = Path(prepare_default_model())
    prompts = random_prompts(model_dir, args.num_prompts, args.input_len, seed=0)
    with one_engine_fleet(model_dir, prefix="kvfleet-cpu-",
                          engine_threads=default_engine_threads(1),
                          engine_args=("--dtype", args.dtype), log_level="WARNING") as fleet:
        model = model_dir.name
        stream_one(fleet.http_url, model, prompts[0], 4)  # warm-up
        pids = service_pids(fleet, redis=True)
        engine_pid = fleet.engines[0].pid
        load_before = os.getloadavg()
        before = {n: cpu_seconds(p) for n, p in pids.items()}
        threads_before = thread_cpu(engine_pid)
        started = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            events = list(pool.map(
                lambda p: stream_one(fleet.http_url, model, p, args.output_len), prompts))
        wall = time.perf_counter() - started
        after = {n: cpu_seconds(p) for n, p in pids.items()}
        threads_after = thread_cpu(engine_pid)
    n = len(prompts)
    per_thread = {k: round((v - threads_before.get(k, 0.0)) / n, 4)
                  for k, v in sorted(threads_after.items(), key=lambda kv: -kv[1])}
    print(json.dumps({
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "wall_s": round(wall, 2), "req_per_s": round(n / wall, 3),
        "sse_events_per_request": sum(events) / n,
        "cpu_s_per_request": {k: round((after[k] - before[k]) / n, 4) for k in pids},
        "engine_cpu_s_per_request_by_thread": {k: v for k, v in per_thread.items() if v > 0},
    }, indent=1))


if __name__ == "__main__":
    main()
