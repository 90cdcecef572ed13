"""Decode attention with shared prefixes attended once per group (engine.attention.shared_prefix,
`paged_decode_attention_shared`): the kernel against attention over each request's gathered
context, the grouping rules on exact block tables, and greedy tokens through the engine
against transformers when decoding requests share cached prefix blocks."""

from __future__ import annotations

import pytest
import torch

import engine.worker.input_batch
from engine import LLM, SamplingParams
from engine.attention.shared_prefix import MIN_SHARED_BLOCKS, find_shared_prefixes
from kernels.cpu import load
from tests.engine.test_cpu_kernels import reference
from tests.fixtures.greedy import random_prompts, transformers_greedy


@pytest.fixture(scope="module", autouse=True)
def kernel_built() -> None:
    assert load(), "the CPU kernel should build on this machine (g++ and ninja are installed)"


def shared_case(groups, heads, kv_heads, dim, dtype, block_size, seed=0):
    """groups: (shared blocks, [own lengths of the members]) each; (0, [n]) is a loner."""
    gen = torch.Generator().manual_seed(seed)
    need = sum(s + sum(-(-n // block_size) for n in own) for s, own in groups)
    perm = torch.randperm(need + 2, generator=gen).tolist()  # scattered block ids
    tables, lens, group_of, shared_lens = [], [], [], []
    for shared, own in groups:
        prefix = [perm.pop() for _ in range(shared)]
        if shared:
            shared_lens.append(shared * block_size)
        for n in own:
            tables.append(prefix + [perm.pop() for _ in range(-(-n // block_size))])
            lens.append(shared * block_size + n)
            group_of.append(len(shared_lens) - 1 if shared else -1)
    width = max(len(t) for t in tables) + 1
    k_cache = torch.randn(need + 2, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(need + 2, block_size, kv_heads, dim, generator=gen).to(dtype)
    wide = torch.randn(len(lens), heads + 2 * kv_heads, dim, generator=gen).to(dtype)
    return (wide[:, :heads], k_cache, v_cache,
            torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            torch.tensor(lens, dtype=torch.int32), torch.tensor(group_of, dtype=torch.int32),
            torch.tensor(shared_lens, dtype=torch.int32))


# Two members; twelve (more than one prefix item's worth of query heads); a loner; a member
# whose own part is one position (its current token).
GROUPS = [(4, [1, 30]), (9, [5, 16, 17, 40, 2, 9, 33, 1, 60, 7, 12, 3]), (0, [150])]


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 2, 128), (4, 1, 64), (4, 2, 16), (6, 3, 32)]
)
@pytest.mark.parametrize("block_size", [16, 32])
def test_shared_kernel_matches_gathered_attention(dtype, tol, heads, kv_heads, dim, block_size):
    q, k_cache, v_cache, tables, lens, group_of, shared_lens = shared_case(
        GROUPS, heads, kv_heads, dim, dtype, block_size)
    out = torch.empty(q.shape, dtype=dtype)
    torch.ops.kvfleet_cpu.paged_decode_attention_shared(
        out, q, k_cache, v_cache, tables, lens, 0.125, group_of, shared_lens)
    for row in range(len(lens)):
        expected = reference(q[row], k_cache, v_cache, tables[row], int(lens[row]), 0.125)
        torch.testing.assert_close(out[row].float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    ("group_of", "shared_lens", "message"),
    [
        ([0, 0, -1], [24], "multiples of 16"),
        ([0, 0, -1], [80], "not shorter than its context"),  # member 0's context is 65
        ([0, 1, -1], [64], "out of range"),
    ],
)
def test_shared_kernel_refuses_inconsistent_groups(group_of, shared_lens, message):
    q, k_cache, v_cache, tables, lens, _, _ = shared_case(
        [(4, [1, 30]), (0, [10])], 9, 3, 64, torch.float32, 16)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.kvfleet_cpu.paged_decode_attention_shared(
            torch.empty_like(q), q, k_cache, v_cache, tables, lens, 0.125,
            torch.tensor(group_of, dtype=torch.int32),
            torch.tensor(shared_lens, dtype=torch.int32))


# -- grouping ------------------------------------------------------------------------------


def test_requests_with_equal_leading_blocks_form_one_group_of_their_common_run():
    prefix = [7, 3, 9, 4, 11, 2]
    tables = [prefix + [20, 21], prefix[:5] + [30, 31], prefix + [40], [50, 51, 52, 53, 54]]
    lens = [16 * 8, 16 * 7, 16 * 6 + 1, 16 * 5]
    found = find_shared_prefixes(tables, lens, 16)
    assert found is not None
    # The common run stops where the second request's table diverges (block 5).
    assert found.group_of.tolist() == [0, 0, 0, -1]
    assert found.shared_lens.tolist() == [5 * 16]


def test_the_current_tokens_block_is_never_shared():
    # Both hold blocks 1..5, but the second's current token sits in its 5th block (position
    # 16 * 4): only the 4 blocks before it count.
    tables = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5]]
    found = find_shared_prefixes(tables, [16 * 6, 16 * 4 + 1], 16)
    assert found is not None and found.shared_lens.tolist() == [4 * 16]


def test_short_shares_loners_and_odd_block_sizes_use_the_plain_kernel():
    short = [[1, 2, 3, 9], [1, 2, 3, 8]]  # three blocks in common: below MIN_SHARED_BLOCKS
    assert MIN_SHARED_BLOCKS == 4
    assert find_shared_prefixes(short, [16 * 4, 16 * 4], 16) is None
    assert find_shared_prefixes([[1, 2, 3, 4, 5, 6]], [16 * 6], 16) is None
    same = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7]]
    assert find_shared_prefixes(same, [16 * 6, 16 * 6], 8) is None


# -- through the engine ----------------------------------------------------------------------

NEW_TOKENS = 24


def test_greedy_matches_transformers_when_decodes_share_a_cached_prefix(tiny_model_dir,
                                                                        monkeypatch):
    """The first request caches an 83-token prefix; six more with their own suffixes then
    hit it and decode together, so their decode steps attend the prefix as one group."""
    prefix, *suffixes = random_prompts(tiny_model_dir, [83, 1, 5, 16, 30, 47, 2], seed=77)
    prompts = [prefix + [5]] + [prefix + s for s in suffixes]
    expected = transformers_greedy(tiny_model_dir, prompts, NEW_TOKENS)
    grouped: list[int] = []
    original = engine.worker.input_batch.find_shared_prefixes

    def spy(tables, lens, block_size):
        found = original(tables, lens, block_size)
        if found is not None:
            grouped.append(int((found.group_of >= 0).sum()))
        return found

    monkeypatch.setattr(engine.worker.input_batch, "find_shared_prefixes", spy)
    llm = LLM(tiny_model_dir, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + rest] == expected
    assert all(o.num_cached_tokens == 80 for o in rest)
    assert grouped and max(grouped) == len(suffixes)
