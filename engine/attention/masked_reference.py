"""Attention with a sliding window and/or tanh logit soft-capping, in plain PyTorch.

The reference for the kernels' window and cap options (kernels/cpu, kernels/triton), and the
path of layers that slide (Gemma's local layers) or cap their scores (Gemma 2) wherever the
compiled kernels are not used (PyTorch backend, head sizes they are not built for), for every
prefill segment and decode of the step. Correct, not fast: each query row materialises its
scores against its whole context.

Numerics follow transformers' eager attention (Gemma2's `eager_attention_forward`): scores =
q @ k^T * scale; capped = cap * tanh(scores / cap); masked keys get -inf; softmax in float32,
cast back to the query dtype; then @ v. A key at position j is visible from a query at
position i when j <= i and, with a window w, i - j < w (transformers' sliding_window_overlay:
kv_idx > q_idx - w).

Invariant: the step's K/V are already in the cache (PagedAttention writes them first), so
every context is read back through its slots, this chunk's own tokens included.
"""

from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata


def masked_attention_into(
    out: torch.Tensor,  # [T, H, D], written for every row of the step
    query: torch.Tensor,  # [T, H, D]
    flat_k: torch.Tensor,  # [slots, KVH, D]
    flat_v: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    logit_cap: float | None,
) -> None:
    for seg in meta.prefills:
        rows = slice(seg.query_start, seg.query_end)
        q_pos = torch.arange(seg.num_context_tokens,
                             seg.num_context_tokens + rows.stop - rows.start, device=out.device)
        slots = seg.context_slots.unsqueeze(0)  # [1, L]
        out[rows] = _attend(query[rows].unsqueeze(0), flat_k, flat_v, slots.to(out.device),
                            q_pos.unsqueeze(0), scale, window, logit_cap).squeeze(0)
    decode = meta.decode
    if decode is None:
        return
    slots = decode.context_slots.to(flat_k.device)  # [B, L], padding at slot 0 (masked)
    lens = decode.context_lens.to(device=flat_k.device, dtype=torch.int64)
    q = query.index_select(0, decode.query_indices).unsqueeze(1)  # [B, 1, H, D]
    result = _attend(q, flat_k, flat_v, slots, (lens - 1).unsqueeze(1), scale, window,
                     logit_cap, lens)
    out.index_copy_(0, decode.query_indices, result.squeeze(1))


def _attend(
    q: torch.Tensor,  # [B, Q, H, D]
    flat_k: torch.Tensor,
    flat_v: torch.Tensor,
    slots: torch.Tensor,  # [B, L] int64
    q_pos: torch.Tensor,  # [B, Q] int64, absolute positions
    scale: float,
    window: int | None,
    logit_cap: float | None,
    context_lens: torch.Tensor | None = None,  # [B]; None: every slot is real
) -> torch.Tensor:  # [B, Q, H, D]
    b, length = slots.shape
    heads, kv_heads = q.shape[2], flat_k.shape[1]
    k = flat_k.index_select(0, slots.reshape(-1)).view(b, length, kv_heads, -1).to(q.dtype)
    v = flat_v.index_select(0, slots.reshape(-1)).view(b, length, kv_heads, -1).to(q.dtype)
    # GQA as transformers' repeat_kv: query head h reads KV head h // (H / KVH).
    k = k.repeat_interleave(heads // kv_heads, dim=2).permute(0, 2, 3, 1)  # [B, H, D, L]
    v = v.repeat_interleave(heads // kv_heads, dim=2).transpose(1, 2)  # [B, H, L, D]
    scores = torch.matmul(q.transpose(1, 2), k) * scale  # [B, H, Q, L]
    if logit_cap is not None:
        scores = torch.tanh(scores / logit_cap) * logit_cap
    k_pos = torch.arange(length, device=q.device).view(1, 1, length)
    visible = k_pos <= q_pos.unsqueeze(2)  # [B, Q, L]
    if window is not None:
        visible &= k_pos > q_pos.unsqueeze(2) - window
    if context_lens is not None:
        visible &= k_pos < context_lens.view(b, 1, 1)
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).transpose(1, 2)
