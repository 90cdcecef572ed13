"""Fused mixture-of-experts MLP: grouped expert GEMMs over tokens sorted by expert.

vLLM's fused_moe idea. The (token, slot) rows of the batch are sorted by expert and each
expert's run is padded to a multiple of BLOCK_M (`align_block_size`): `sorted_rows` lists
flat row indices t * k + slot, expert after expert, padding entries holding the sentinel
T * k, and `block_expert` names the expert of every BLOCK_M block (E past the used blocks).
Then two launches, one program per (row block, N tile):

    gate_up: act[p]  = silu(x[tok(p)] @ gate[e]^T) * (x[tok(p)] @ up[e]^T)   [padded rows, I]
    down:    y[row]  = (act[p] @ down[e]^T) * routing weight(row)             [T * k, H] f32

and out[t] = the sum of y over the token's k rows. Weights are the model's own batched
tensors, gate_up [E, 2I, H] (gate rows, then up) and down [E, H, I]: no packed copy.

Everything runs on the device without a host sync (the grid is sized from shapes alone:
at most T * k + min(E, T * k) * (BLOCK_M - 1) padded rows), so the launch could be captured
in a CUDA graph.

Rounding follows the PyTorch path (engine.models.moe): products summed in float32, the
gate/up projections, SiLU and the activation rounded to the activation dtype, the down
projection rounded before the routing weight scales it; the k rows are summed in float32 and
rounded once. On CUDA, float16/bfloat16 operands go to tensor-core dots as they are
(`NATIVE_DOT`); otherwise (float32, and always under the interpreter, whose bfloat16 storage
needs it) the operands are widened to float32 with IEEE products (no TF32).

Invariants: x, gate_up, down contiguous; topk_ids int64 [T, k] with ids in [0, E).

Checked on: CPU under TRITON_INTERPRET=1 (tests/kernels_triton/test_fused_moe.py), float32
and bfloat16. Written to compile for CUDA (the engine uses it for every MoE layer on
`--device cuda`); not yet run on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.runtime import count_launch

BLOCK_M = 16
BLOCK_N = 32
BLOCK_K = 32


def align_block_size(topk_ids: torch.Tensor, num_experts: int,
                     block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_rows int32 [padded], block_expert int32 [padded / block_m]) as above."""
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)  # stable: an expert's rows stay in token order
    expert_of = flat.index_select(0, order)
    rank = torch.arange(n, device=flat.device) - (torch.cumsum(counts, 0) - counts)[expert_of]
    dest = (padded_end - padded)[expert_of] + rank
    blocks = triton.cdiv(n + min(num_experts, n) * (block_m - 1), block_m)
    sorted_rows = torch.full((blocks * block_m,), n, dtype=torch.int32, device=flat.device)
    sorted_rows.index_copy_(0, dest, order.to(torch.int32))
    starts = torch.arange(blocks, device=flat.device) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True).to(torch.int32)
    return sorted_rows, block_expert


@triton.jit
def _dot(acc, lhs, rhs, NATIVE_DOT: tl.constexpr):
    # acc += lhs [M, K] @ rhs [N, K]^T
    if NATIVE_DOT:
        return tl.dot(lhs, tl.trans(rhs), acc)
    return acc + tl.dot(lhs.to(tl.float32), tl.trans(rhs.to(tl.float32)),
                        input_precision="ieee")


@triton.jit
def _block_rows(sorted_rows_ptr, block_expert_ptr, num_rows, BLOCK_M: tl.constexpr):
    # This program's expert, its padded positions and the flat rows they hold.
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    offs_p = block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_rows_ptr + offs_p).to(tl.int64)
    return expert, offs_p, rows, rows < num_rows


@triton.jit
def moe_gate_up_kernel(
    act_ptr, x_ptr, w_ptr, sorted_rows_ptr, block_expert_ptr,
    num_rows, num_experts, top_k, hidden, inter,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
):  # fmt: skip
    expert, offs_p, rows, valid = _block_rows(
        sorted_rows_ptr, block_expert_ptr, num_rows, BLOCK_M)
    if expert >= num_experts:  # past the last used block
        return
    tokens = rows // top_k
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < inter
    gate_rows = w_ptr + expert * 2 * inter * hidden + offs_n.to(tl.int64)[:, None] * hidden
    up_rows = gate_rows + inter * hidden
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < hidden
        x = tl.load(x_ptr + tokens[:, None] * hidden + offs_k[None, :],
                    mask=valid[:, None] & mask_k[None, :], other=0.0)
        w_mask = mask_n[:, None] & mask_k[None, :]
        acc_g = _dot(acc_g, x, tl.load(gate_rows + offs_k[None, :], mask=w_mask, other=0.0),
                     NATIVE_DOT)
        acc_u = _dot(acc_u, x, tl.load(up_rows + offs_k[None, :], mask=w_mask, other=0.0),
                     NATIVE_DOT)
    dtype = act_ptr.dtype.element_ty
    gate = acc_g.to(dtype).to(tl.float32)
    up = acc_u.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(act_ptr + offs_p[:, None] * inter + offs_n[None, :], (silu * up).to(dtype),
             mask=mask_n[None, :])


@triton.jit
def moe_down_kernel(
    y_ptr, act_ptr, w_ptr, weights_ptr, sorted_rows_ptr, block_expert_ptr,
    num_rows, num_experts, hidden, inter,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
):  # fmt: skip
    expert, offs_p, rows, valid = _block_rows(
        sorted_rows_ptr, block_expert_ptr, num_rows, BLOCK_M)
    if expert >= num_experts:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hidden
    w_rows = w_ptr + expert * hidden * inter + offs_n.to(tl.int64)[:, None] * inter
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < inter
        a = tl.load(act_ptr + offs_p[:, None] * inter + offs_k[None, :],
                    mask=mask_k[None, :], other=0.0)
        w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc = _dot(acc, a, w, NATIVE_DOT)
    h = acc.to(act_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weights_ptr + rows, mask=valid, other=0.0)
    tl.store(y_ptr + rows[:, None] * hidden + offs_n[None, :], h * weight[:, None],
             mask=valid[:, None] & mask_n[None, :])


def fused_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """out [T, H] in x's dtype: the MoE MLP of every token over its routed experts."""
    tokens, hidden = x.shape
    experts, inter, top_k = gate_up.shape[0], down.shape[2], topk_ids.shape[1]
    if gate_up.shape != (experts, 2 * inter, hidden) or down.shape != (experts, hidden, inter):
        raise ValueError(f"fused_moe: gate_up {tuple(gate_up.shape)} and down "
                         f"{tuple(down.shape)} do not match hidden size {hidden}")
    if tokens == 0:
        return torch.zeros_like(x)
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    num_rows = tokens * top_k
    sorted_rows, block_expert = align_block_size(topk_ids, experts, BLOCK_M)
    act = x.new_empty(sorted_rows.numel(), inter)
    y = torch.empty(num_rows, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.float().contiguous()
    native = x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)
    blocks = block_expert.numel()
    count_launch("moe_gate_up")
    moe_gate_up_kernel[(blocks, triton.cdiv(inter, BLOCK_N))](
        act, x, gate_up, sorted_rows, block_expert, num_rows, experts, top_k, hidden, inter,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, NATIVE_DOT=native,
    )  # fmt: skip
    count_launch("moe_down")
    moe_down_kernel[(blocks, triton.cdiv(hidden, BLOCK_N))](
        y, act, down, weights, sorted_rows, block_expert, num_rows, experts, hidden, inter,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, NATIVE_DOT=native,
    )  # fmt: skip
    return y.view(tokens, top_k, hidden).sum(dim=1).to(x.dtype)
