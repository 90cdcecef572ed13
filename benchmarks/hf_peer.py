"""The transformers peer for the offline benchmark: the same model through transformers.

Two ways of serving a batch of token-id prompts greedily for a fixed number of new tokens:

- `generate_batch`: transformers' own continuous batching (paged KV cache, 16-token pages via
  `ContinuousBatchingConfig.page_size`; `block_size` there is a deprecated alias). On CPU no flash
  kernel exists, so the manager keeps the model's `sdpa` attention with explicit masks (it would
  only switch to flash when available); the KV budget, the per-step token budget and the batch
  width are passed explicitly, so the cache is not sized from 90% of the host's RAM and the batch
  width is not taken from the warm-up's workload hints. Prefix sharing is off (see below).
- `generate`: classic static batching, left padding plus an attention mask, EOS blocked by
  `min_new_tokens == max_new_tokens` so every row yields exactly `max_new_tokens` tokens.

Timed calls reuse a persistent continuous-batching manager created by the warm-up call, so
neither peer pays set-up (cache allocation, thread start) inside the timing, like kvfleet's `LLM`,
which allocates its cache in the constructor.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    ContinuousBatchingConfig,
    GenerationConfig,
)
from transformers.utils import logging as hf_logging

# Its warnings (persistent manager sizing, eos_token_id=None -> -1) are expected here.
logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)


@dataclass(frozen=True)
class Timed:
    wall_s: float
    outputs: list[list[int]]


def load_model(model_dir: Path, dtype: torch.dtype) -> Any:
    hf_logging.disable_progress_bar()  # its "Loading weights" bar would split the report
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    model.eval()
    return model


def special_token_ids(model_dir: Path) -> set[int]:
    """Every added/special token id of the tokenizer (SmolLM2: 0..16), to keep out of prompts."""
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return set(tok.added_tokens_decoder) | set(tok.all_special_ids)


def pad_token_id(model: Any) -> int:
    cfg = model.generation_config
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else cfg.eos_token_id
    return int(pad if isinstance(pad, int) else pad[0])


def generate_batch(
    model: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    page_size: int,
    num_blocks: int,
    max_batch_tokens: int,
    max_requests_per_batch: int,
) -> Timed:
    """Continuous batching through `model.generate_batch`, greedy, EOS disabled."""
    # A fresh config each call: generate_batch rewrites eos_token_id=None to -1 in place.
    gen_cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None)
    cb_cfg = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens,
        # Explicit: otherwise it is taken from the first call's workload (the small warm-up).
        max_requests_per_batch=max_requests_per_batch,
        # Off: random prompts share no prefix (kvfleet resets its cache every round).
        allow_block_sharing=False,
    )
    start = time.perf_counter()
    results = model.generate_batch(
        inputs=prompts,
        generation_config=gen_cfg,
        continuous_batching_config=cb_cfg,
        # Not persistent: a kept manager's background thread lives on in this process, which
        # is kvfleet's too, and would take CPU and the GIL from kvfleet's later rounds (its
        # set-up, now inside this wall time, is small next to a 30 s round).
        persistent_manager=False,
        progress_bar=False,
    )
    wall = time.perf_counter() - start
    outs = [list(r.generated_tokens) for r in results.values()]
    errors = [r.error for r in results.values() if getattr(r, "error", None)]
    if len(outs) != len(prompts) or errors:
        raise RuntimeError(f"generate_batch returned {len(outs)}/{len(prompts)} results: {errors}")
    return Timed(wall, outs)


def drop_cb_manager(model: Any) -> None:
    model.destroy_cached_continuous_batching_manager()


@torch.inference_mode()
def generate_static(
    model: Any, prompts: list[list[int]], max_new_tokens: int, batch_size: int
) -> Timed:
    """Static batches of `batch_size` in input order: left padding, attention mask, greedy."""
    pad = pad_token_id(model)
    outs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, p in enumerate(batch):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        seqs = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
        outs.extend(seqs[:, width:].tolist())
    return Timed(time.perf_counter() - start, outs)


@torch.inference_mode()
def ttft(model: Any, prompt: list[int]) -> float:
    """Wall time of `generate(max_new_tokens=1)` on one prompt (prefill + one sampled token)."""
    ids = torch.tensor([prompt])
    start = time.perf_counter()
    model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=1,
        do_sample=False,
        pad_token_id=pad_token_id(model),
    )
    return time.perf_counter() - start
