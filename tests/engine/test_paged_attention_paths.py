"""PagedAttention gives the same result through the compiled kernels (one prefill call for all
segments, the decode kernel) as through the PyTorch fallback, for a mixed step built by
`build_model_input`: a fresh prompt, a chunk after cached context, decodes between them. Head
sizes the kernels are not built for fall back to PyTorch even when the kernels are loaded."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.attention import PagedAttention
from engine.worker.input_batch import build_model_input
from kernels.cpu import load

BLOCK_SIZE = 16


@pytest.fixture(scope="module", autouse=True)
def kernel_built() -> None:
    assert load(), "the CPU kernels should build on this machine (g++ and ninja are installed)"


def scheduled(request_id: str, computed: int, new: int) -> SimpleNamespace:
    request = SimpleNamespace(
        request_id=request_id,
        num_computed_tokens=computed,
        all_token_ids=list(range(computed + new)),
        needs_prompt_logprobs=False,
    )
    return SimpleNamespace(request=request, num_new_tokens=new, samples=True, spec_token_ids=())


# (request, tokens already cached, tokens this step): decodes sit between prefill segments.
STEP = [("a", 0, 37), ("b", 40, 1), ("c", 50, 23), ("d", 5, 1), ("e", 17, 1), ("f", 0, 2)]


def run_step(heads: int, kv_heads: int, dim: int, use_kernels: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    items = [scheduled(rid, done, new) for rid, done, new in STEP]
    # Blocks handed out in a scrambled order.
    order = torch.randperm(64, generator=gen).tolist()
    block_ids: dict[str, list[int]] = {}
    for rid, done, new in STEP:
        block_ids[rid] = [order.pop() for _ in range(-(-(done + new) // BLOCK_SIZE))]
    batch = build_model_input(items, block_ids, BLOCK_SIZE, use_decode_kernel=use_kernels)
    assert (batch.meta.prefill_batch is not None) == use_kernels
    # Earlier steps' K/V (random) already sit in the cache.
    cache = torch.randn(2, 64, BLOCK_SIZE, kv_heads, dim, generator=gen)
    t = batch.meta.num_tokens
    qkv = torch.randn(t, heads + 2 * kv_heads, dim, generator=gen)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    attn = PagedAttention(heads, kv_heads, dim, dim**-0.5)
    return attn(q, k, v, cache, batch.meta)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 128), (4, 2, 48)])
def test_kernel_and_pytorch_paths_agree(heads, kv_heads, dim):
    kernel = run_step(heads, kv_heads, dim, use_kernels=True)
    fallback = run_step(heads, kv_heads, dim, use_kernels=False)
    torch.testing.assert_close(kernel, fallback, atol=1e-5, rtol=1e-5)
