"""Unified paged attention: every query of the flattened mixed batch in ONE launch.

The batch holds S sequences; sequence s owns flat query rows [query_start_loc[s],
query_start_loc[s + 1]) and has seq_lens[s] tokens of context in the cache, this step's
included (the K/V write runs first). A decode is simply a sequence with one query row; a
prefill chunk with earlier context has several rows and seq_len > q_len. Query row i of s sits
at position seq_lens[s] - q_len + i and attends causally to keys 0..that position, read in
place through block_tables[s] — no gather, no Python loop over requests.

Work split (the idea of vLLM's unified Triton attention, written here from scratch): each
program owns BLOCK_Q consecutive query tokens of one sequence and one KV head, i.e. a
[BLOCK_Q * QPK_PAD, head_dim] tile of queries (all query heads sharing that KV head, GQA),
so every K/V tile it loads is reused by all of them. Programs are numbered over "q-blocks";
sequence s's q-blocks start at query_start_loc[s] // BLOCK_Q + s (an upper bound that needs
no host-side prefix sum), found by binary search; surplus programs exit at once. Keys stream
in tiles of TILE_N with an online softmax (flash-attention style, base-2 exponentials); each
key's physical block is looked up per key, so any block size works, powers of two or not.

Invariants and limits: query/out may be strided in tokens and heads (the engine's q is a view
of the fused qkv projection) but head_dim must be contiguous; the cache is [num_blocks,
block_size, num_kv_heads, head_dim] per K and V; num_heads is a multiple of num_kv_heads;
every tl.dot tile is at least 16 wide (BLOCK_M >= 16, TILE_N >= 16, head_dim padded to a power
of two >= 16). Accumulation is float32 whatever the cache dtype; float32 dots ask for IEEE
precision so that CUDA does not silently use TF32.

Checked on: CPU under TRITON_INTERPRET=1 (tests/kernels_triton), head_dim 64/128 (and the
tiny model's 16), GQA ratios 1/3/4, block sizes 16/32, float32/float16/bfloat16 caches;
compiled and run on an NVIDIA H100 (Triton 3.6, torch 2.11+cu130, `make gpu-check`,
2026-11-24): the same tests pass there. The whole engine runs
on it there (tests/gpu: exact float32 greedy tokens, with and without CUDA graphs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.runtime import count_launch, is_interpreted

MIN_DOT = 16  # smallest tl.dot tile side Triton accepts on GPUs
TILE_N = 32  # keys per inner iteration


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """Largest s with query_start_loc[s] // BLOCK_Q + s <= q_block (binary search)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _as_operand(x, query_ptr, DOT_DTYPE: tl.constexpr):
    """Round to the query dtype (what the GPU multiplies), then hand tl.dot DOT_DTYPE."""
    return x.to(query_ptr.dtype.element_ty).to(DOT_DTYPE)


@triton.jit
def unified_attention_kernel(
    out_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale_log2,  # softmax scale * log2(e)
    window,  # sliding window (keys with q - k < window); read only with HAS_WINDOW
    softcap,  # tanh logit cap; read only with HAS_SOFTCAP
    num_seqs,
    num_queries_per_kv,
    head_dim,
    query_stride_t,
    query_stride_h,
    out_stride_t,
    out_stride_h,
    block_table_stride,
    cache_stride_block,
    cache_stride_offset,
    cache_stride_head,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    QPK_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    TILE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr = False,
    HAS_SOFTCAP: tl.constexpr = False,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * QPK_PAD
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local = q_block - (q_start // BLOCK_Q + seq)
    if local * BLOCK_Q >= q_len:
        return  # surplus program of the upper-bound grid
    seq_len = tl.load(seq_lens_ptr + seq)
    num_context = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_tok = local * BLOCK_Q + rows // QPK_PAD
    head_in_group = rows % QPK_PAD
    head = kv_head * num_queries_per_kv + head_in_group
    row_ok = (q_tok < q_len) & (head_in_group < num_queries_per_kv)
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < head_dim
    q_row = (q_start + q_tok).to(tl.int64)
    q = tl.load(
        query_ptr + q_row[:, None] * query_stride_t + head[:, None] * query_stride_h
        + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    q_pos = num_context + q_tok  # absolute position of each row's query token

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    # Keys this q-block can see: up to its last real query's position.
    kv_end = num_context + tl.minimum(local * BLOCK_Q + BLOCK_Q, q_len)
    table = block_tables_ptr + seq.to(tl.int64) * block_table_stride
    kv_start = 0
    if HAS_WINDOW:  # tiles wholly before the first query's window are never read
        kv_start = tl.maximum(num_context + local * BLOCK_Q - window + 1, 0) // TILE * TILE
    for tile_start in range(kv_start, kv_end, TILE):
        keys = tile_start + tl.arange(0, TILE)
        key_ok = keys < kv_end
        block = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        base = (
            block * cache_stride_block
            + (keys % BLOCK_SIZE) * cache_stride_offset
            + kv_head * cache_stride_head
        )
        kv_mask = key_ok[None, :] & dim_ok[:, None]
        # K read straight as [DIM_PAD, TILE] so the score dot needs no transpose.
        k = tl.load(key_cache_ptr + base[None, :] + dims[:, None], mask=kv_mask, other=0.0)
        scores = tl.dot(q, _as_operand(k, query_ptr, DOT_DTYPE), input_precision=DOT_PRECISION)
        if HAS_SOFTCAP:
            # transformers' cap * tanh(s / cap) on the scaled scores, then into base 2;
            # tanh(x) = 1 - 2 / (exp(2x) + 1), exact at both saturations.
            capped = scores * (scale_log2 / 1.4426950408889634) / softcap
            # |x| >= 15 is +-1 in float32 already; clamping keeps exp finite.
            capped = tl.minimum(tl.maximum(capped, -15.0), 15.0)
            capped = 1.0 - 2.0 / (tl.exp(2.0 * capped) + 1.0)
            scores = capped * (softcap * 1.4426950408889634)
        else:
            scores = scores * scale_log2
        visible = key_ok[None, :] & (keys[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (keys[None, :] > q_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # Rows with nothing visible yet (padding rows) keep a finite shift: no inf - inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(scores - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            value_cache_ptr + base[:, None] + dims[None, :],
            mask=key_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(
            _as_operand(p, query_ptr, DOT_DTYPE),
            _as_operand(v, query_ptr, DOT_DTYPE),
            input_precision=DOT_PRECISION,
        )
        m_i = m_new
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + q_row[:, None] * out_stride_t + head[:, None] * out_stride_h + dims[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


def _dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """The dtype tl.dot sees. Triton's interpreter multiplies bfloat16 tiles as their raw
    uint16 bits (Triton 3.9), so there bfloat16 operands, already rounded to bfloat16, are
    widened to float32: exact products, the same float32 accumulation as the GPU's bf16 dot."""
    native = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
    if dtype not in native:
        raise ValueError(f"unsupported query dtype {dtype}")
    if dtype == torch.bfloat16 and is_interpreted(unified_attention_kernel):
        return tl.float32
    return native[dtype]


def launch_shape(num_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """(BLOCK_Q, QPK_PAD): query tokens per program and padded query heads per KV head.

    BLOCK_M = BLOCK_Q * QPK_PAD rows feed tl.dot, so it is kept at least MIN_DOT.
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    qpk_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    return max(MIN_DOT // qpk_pad, 1), qpk_pad


def unified_attention(
    out: torch.Tensor,  # [T, num_heads, head_dim]
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32
    seq_lens: torch.Tensor,  # [S] int32, this step's tokens included
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """With `window`: a query at position i sees keys j with i - j < window (transformers'
    sliding window); with `softcap`: scores become softcap * tanh(scores / softcap)."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0:
        return
    assert query.stride(-1) == 1 and out.stride(-1) == 1, "head_dim must be contiguous"
    assert key_cache.stride() == value_cache.stride() and key_cache.stride(-1) == 1
    block_q, qpk_pad = launch_shape(num_heads, num_kv_heads)
    dot_dtype = _dot_dtype(query.dtype)
    count_launch("unified_attention")
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    unified_attention_kernel[grid](
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale * 1.4426950408889634,
        window or 0,
        softcap or 0.0,
        num_seqs,
        num_heads // num_kv_heads,
        head_dim,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        QPK_PAD=qpk_pad,
        DIM_PAD=max(triton.next_power_of_2(head_dim), MIN_DOT),
        TILE=TILE_N,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
        HAS_WINDOW=window is not None,
        HAS_SOFTCAP=softcap is not None,
    )


def unified_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """PyTorch reference, one sequence at a time in float32: gather the context through the
    block table, causal mask offset by the earlier context (and window), GQA by repeating KV
    heads, scores soft-capped when asked."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32)
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        q = query[starts[s] : starts[s + 1]].float()
        q_len = q.shape[0]
        positions = torch.arange(seq_len)
        blocks = block_tables[s].long()[positions // block_size]
        k = key_cache[blocks, positions % block_size].float()  # [seq_len, KVH, D]
        v = value_cache[blocks, positions % block_size].float()
        group = num_heads // num_kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - q_len, seq_len)
        scores.masked_fill_(positions[None, None, :] > q_pos[None, :, None], float("-inf"))
        if window is not None:
            hidden = positions[None, None, :] <= q_pos[None, :, None] - window
            scores.masked_fill_(hidden, float("-inf"))
        out[starts[s] : starts[s + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out.to(query.dtype)
