"""The simulated engine's cost model, and its calibration from the real engine.

Role: `Calibration` says how long one engine step takes (prefill tokens, decoding requests,
the context they attend to) and how many KV blocks an engine holds. `measure()` fits it from
the real engine (engine.core.llm_engine on the default model, one torch thread, as one fleet
engine runs; each step's process CPU time, so other processes on a shared machine inflate it
less than they would wall time) in about a minute of CPU; `load_or_measure()` caches the
result as JSON under $KVFLEET_CACHE_DIR (default ~/.cache/kvfleet/fleet_sim_calibration.json).
`DEFAULT` is a built-in calibration (one such measurement) for tests and
machines without the model.

Which engine: the real fleet's the simulator is checked against (`vs_real`: `make bench-fleet`,
benchmarks/fleet_bench.py), float32 with `DEFAULT_KVCACHE_GIB` of KV each, so the KV capacity
is that budget over the model's bytes per block (2 GiB / 720 KiB = 2,912 blocks for SmolLM2),
not the engine's own default budget (1 GiB, what `kvfleet up` without flags gets: 1,456).
A calibration that recorded no budget, or another one (measured before this was fixed), is
re-sized on loading (`for_fleet`); its step times do not depend on the KV size.

Step time model (seconds), fitted by least squares:

    step = base + prefill_s_per_token * p + prefill_attn_s * p * ctx_p / 1000
           + decode_s_per_seq * d + decode_ctx_s * ctx_d / 1000

p: prompt tokens computed in the step, ctx_p: the context they attend to (mean position),
d: decoding requests, ctx_d: the tokens those attend to in all.

Invariants: every coefficient is >= 0 (negative fits are clamped: a shared machine's noise
must not make work free); the JSON is the dataclass' fields, plus where it came from; every
calibration this module hands out has `kv_blocks` = the fleet's KV budget // bytes per block.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

CACHE_NAME = "fleet_sim_calibration.json"
# The fleet benchmark's engines compute in float32 (its --dtype default).
FLEET_DTYPE = "float32"


@dataclass(frozen=True)
class Calibration:
    base_s: float
    prefill_s_per_token: float
    prefill_attn_s: float
    decode_s_per_seq: float
    decode_ctx_s: float
    kv_blocks: int
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 8192
    # The KV budget `kv_blocks` was sized from, and one block's bytes (0: not recorded).
    kv_cache_bytes: int = 0
    kv_bytes_per_block: int = 0
    source: str = "built-in default"
    samples: list[dict[str, float]] = field(default_factory=list)

    def step_s(self, prefill_tokens: int, prefill_ctx: float, decoding: int,
               decode_ctx: int) -> float:
        """Duration of one engine step (module docstring)."""
        return (self.base_s + self.prefill_s_per_token * prefill_tokens
                + self.prefill_attn_s * prefill_tokens * prefill_ctx / 1000.0
                + self.decode_s_per_seq * decoding + self.decode_ctx_s * decode_ctx / 1000.0)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Calibration:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


# SmolLM2-135M, float32, one torch thread: `measure()` on a shared 2-core x86 machine
# (2026-11-28, the figures in docs/fleet-simulator.md). A block holds K and V of 30 layers x 3
# KV heads x 64 dims x 16 tokens in float32: 720 KiB; the fleet's 2 GiB hold 2,912 of them
# (tests/unit/test_fleet_sim.py checks this against the fleet benchmark and the engine).
_SMOLLM2_BYTES_PER_BLOCK = 2 * 30 * 3 * 64 * 16 * 4
DEFAULT = Calibration(
    base_s=0.0128, prefill_s_per_token=0.00229, prefill_attn_s=0.00084,
    decode_s_per_seq=0.00334, decode_ctx_s=0.00446,
    kv_blocks=2 * 2**30 // _SMOLLM2_BYTES_PER_BLOCK, kv_cache_bytes=2 * 2**30,
    kv_bytes_per_block=_SMOLLM2_BYTES_PER_BLOCK,
)


def fleet_kv_cache_bytes() -> int:
    """Each engine's KV budget in the real fleet benchmark (module docstring)."""
    from benchmarks.fleet_bench import DEFAULT_KVCACHE_GIB

    return DEFAULT_KVCACHE_GIB * 2**30


def for_fleet(cal: Calibration, model: str | None = None) -> Calibration:
    """`cal` with the fleet's KV capacity: re-sized when it was measured with another budget
    or recorded none (the default engine's 1 GiB, before the budget was the fleet's)."""
    budget = fleet_kv_cache_bytes()
    if cal.kv_cache_bytes == budget and cal.kv_bytes_per_block > 0:
        return cal
    per_block = cal.kv_bytes_per_block or _bytes_per_block(model, cal.block_size)
    blocks = budget // per_block
    return replace(cal, kv_blocks=blocks, kv_cache_bytes=budget, kv_bytes_per_block=per_block,
                   source=f"{cal.source}; KV re-sized to the fleet's {budget / 2**30:g} GiB: "
                          f"{blocks} blocks of {per_block} bytes (was {cal.kv_blocks})")


def _bytes_per_block(model: str | None, block_size: int) -> int:
    """One KV block's bytes in the fleet's dtype, as the engine sizes it (no weights loaded)."""
    from engine.models.config import ModelConfig
    from engine.models.default_model import prepare_default_model
    from engine.models.loader import resolve_dtype
    from engine.worker.model_runner import kv_cache_bytes_per_block

    config = ModelConfig.from_dir(model or prepare_default_model())
    return kv_cache_bytes_per_block(config, block_size, resolve_dtype(FLEET_DTYPE, config))


def cache_path() -> Path:
    root = os.environ.get("KVFLEET_CACHE_DIR") or str(Path.home() / ".cache" / "kvfleet")
    return Path(root) / CACHE_NAME


def load(path: Path) -> Calibration:
    """A calibration file, with the fleet's KV capacity (`for_fleet`)."""
    return for_fleet(Calibration.from_json(json.loads(path.read_text())))


def load_or_measure(path: Path | None = None) -> Calibration:
    """The cached calibration, else a fresh `measure()` written to the cache."""
    target = path or cache_path()
    if target.is_file():
        cached = Calibration.from_json(json.loads(target.read_text()))
        return for_fleet(replace(cached, source=f"cached {target}"))
    cal = measure()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(cal.to_json(), indent=1))
    return cal


def measure(model: str | None = None) -> Calibration:
    """Time real engine steps (module docstring); about a minute on 2 shared cores."""
    import torch

    from engine.llm import LLM  # heavy imports only when calibrating

    torch.set_num_threads(1)
    started = time.time()
    budget = fleet_kv_cache_bytes()
    llm = LLM(model, enable_prefix_caching=False, max_num_batched_tokens=2048,
              dtype=FLEET_DTYPE, kv_cache_memory_bytes=budget)
    engine = llm.engine
    samples = _prefill_samples(engine) + _decode_samples(engine)
    coeffs = _fit(samples)
    return Calibration(
        *coeffs, kv_blocks=int(engine.kv.num_blocks), block_size=int(engine.config.block_size),
        kv_cache_bytes=budget, kv_bytes_per_block=int(engine.kv_layout.bytes_per_block),
        max_num_batched_tokens=2048, max_num_seqs=int(engine.config.max_num_seqs),
        max_model_len=int(engine.max_model_len),
        source=f"measured {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} in "
               f"{time.time() - started:.0f}s wall (real engine, 1 torch thread, CPU time per "
               "step; a shared machine: noisy)",
        samples=samples,
    )


def _timed_steps(
    engine: Any, prompts: list[list[int]], max_tokens: int
) -> list[tuple[float, int, int]]:
    """Adds the prompts, steps to completion; (seconds, tokens, decoding) per step."""
    from kvfleet.contracts.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"cal-{time.monotonic_ns()}-{i}", prompt, params)
    steps = []
    while engine.has_unfinished_requests():
        # CPU time, not wall time: on a shared machine the wall clock also counts the time
        # other processes held our core; one torch thread computes on this one.
        t0 = time.process_time()
        engine.step()
        steps.append((time.process_time() - t0, int(engine.last_step_num_tokens), len(prompts)))
    return steps


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 30000 + 100 for i in range(n)]


def _prefill_samples(engine: Any) -> list[dict[str, float]]:
    _timed_steps(engine, [_prompt(256, 0)], 1)  # warm-up
    samples: list[dict[str, float]] = []
    for n in (128, 512, 2048, 3072):
        for rep in range(1 if n > 512 else 2):
            steps = _timed_steps(engine, [_prompt(n, 10 * n + rep)], 1)
            done = 0
            for seconds, tokens, _ in steps:
                if tokens <= 0:
                    continue
                ctx = done + tokens / 2.0
                samples.append({"s": seconds, "p": tokens, "ctx_p": ctx, "d": 0, "ctx_d": 0})
                done += tokens
    return samples


def _decode_samples(engine: Any) -> list[dict[str, float]]:
    samples: list[dict[str, float]] = []
    for batch, length in ((1, 64), (8, 64), (32, 64), (16, 384)):
        steps = _timed_steps(engine, [_prompt(length, 97 * batch + i) for i in range(batch)], 5)
        decode = [s for s, tokens, _ in steps if tokens == batch]
        if decode:
            samples.append({"s": statistics.median(decode), "p": 0, "ctx_p": 0, "d": batch,
                            "ctx_d": batch * (length + 3)})
    return samples


def _fit(samples: list[dict[str, float]]) -> tuple[float, float, float, float, float]:
    """Least squares over the five features, clamped to >= 0 (module docstring)."""
    import numpy as np

    rows = [[1.0, s["p"], s["p"] * s["ctx_p"] / 1000.0, s["d"], s["ctx_d"] / 1000.0]
            for s in samples]
    x, y = np.array(rows), np.array([s["s"] for s in samples])
    coef = np.linalg.lstsq(x, y, rcond=None)[0]
    clamped = [max(float(c), 0.0) for c in coef]
    return clamped[0], clamped[1], clamped[2], clamped[3], clamped[4]
