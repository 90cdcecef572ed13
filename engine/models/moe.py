"""Sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): top-k routing, grouped expert GEMMs.

The router is one [experts, hidden] matmul; softmax in float32 over all experts, top-k, then
(Mixtral always; Qwen3-MoE with norm_topk_prob) the k weights renormalised to sum 1, as
transformers' TopKRouter does (float32 on CPU with the C++ kernels: all after the matmul in
one op, kvfleet_cpu::moe_route in kernels/cpu/fused_moe.cpp). The experts then run on one of
three paths:

- the fused C++ kernels on CPU, for the row counts where start-up timing found them faster
  (`MoePlan`, engine.models.moe_select): in float32 kernels/cpu/fused_moe_panel.cpp on a
  panel-packed copy of the expert weights (the dense MLP's register blocking), in bfloat16
  (or float32 without the packed copy) kernels/cpu/fused_moe.cpp on the weights as loaded;
- the fused Triton kernel (kernels/triton/fused_moe.py) on CUDA;
- the PyTorch path elsewhere: (token, slot) pairs sorted by expert once (stable), each expert
  that received tokens runs two GEMMs on all of its rows together ([n_e, H] x [2I, H]^T,
  SiLU-and-mul, x [H, I]^T), scaled by the rows' routing weights and summed into the output
  with index_add_ (one Python iteration per expert hit, as transformers' own experts loop).

Invariants: expert weights are batched parameters, gate_up [E, 2I, H] (gate rows, then up)
and down [E, H, I], the source of truth that the loader fills from the checkpoint's per-expert
w1/w3/w2 (Mixtral) or gate/up/down_proj (Qwen3-MoE) tensors (engine.models.weight_names) and
every path but the float32 panel kernel reads. That kernel's copy (`panels`) is derived from
them once, after loading and before the first forward pass, as the dense projections' packed
copies are (engine.models.linear); it doubles the experts' float32 memory. Float32 results of
every path equal transformers' to rounding; the PyTorch path's per-expert matmuls see the same
rows, in token order, as transformers'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.config import ModelConfig

# The row counts at which start-up timing compares the paths (decode to prefill sizes; 2,048
# is the default step token budget, the prefill chunk of offline batches).
PLAN_ROWS = (1, 8, 64, 512, 2048)


@dataclass(frozen=True)
class MoePlan:
    """Which CPU path runs a batch: `fused[i]` for batches of at most `rows[i]` rows (and
    the last entry for larger ones). Empty: the PyTorch path always."""

    rows: tuple[int, ...] = ()
    fused: tuple[bool, ...] = ()

    def use_fused(self, num_rows: int) -> bool:
        for limit, fused in zip(self.rows, self.fused, strict=True):
            if num_rows <= limit:
                return fused
        return bool(self.fused) and self.fused[-1]

    @classmethod
    def always(cls) -> MoePlan:
        return cls(rows=(1,), fused=(True,))


def pack_expert_panels(
    gate_up: torch.Tensor, down: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [E, 2I, H] -> [E, I/16, H, 32] (panel p: gate columns 16p.. then the matching
    up columns) and down [E, H, I] -> [E, ceil(H/32), I, 32] (zero-padded past H): the layouts
    of kernels/cpu/fused_moe_panel.cpp, the dense projections' panels per expert."""
    experts, two_i, hidden = gate_up.shape
    inter = two_i // 2
    gate = gate_up[:, :inter].reshape(experts, inter // 16, 16, hidden)
    up = gate_up[:, inter:].reshape(experts, inter // 16, 16, hidden)
    gu = torch.cat([gate, up], dim=2).transpose(2, 3).contiguous()
    pad = -hidden % 32
    padded = F.pad(down, (0, 0, 0, pad)) if pad else down
    dn = padded.reshape(experts, (hidden + pad) // 32, 32, inter).transpose(2, 3).contiguous()
    return gu, dn


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        experts, hidden, inter = (
            config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.num_experts = experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        # Qwen3-MoE casts the routing weights to the activation dtype; Mixtral keeps float32.
        self.cast_weights = config.architecture != "MixtralForCausalLM"
        self.gate = nn.Parameter(torch.empty(experts, hidden))
        self.gate_up = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.down = nn.Parameter(torch.empty(experts, hidden, inter))
        # CPU path choice, set at start (engine.models.moe_select); the default is PyTorch's.
        self.plan = MoePlan()
        # float32 panel-packed copy of gate_up and down for the fused CPU kernel, made once
        # after loading (pack_panels); None: the kernel reads the weights as loaded.
        self.panels: tuple[torch.Tensor, torch.Tensor] | None = None
        # "auto": Triton on CUDA, `plan` on CPU; "triton": Triton on any device (tests run it
        # interpreted on CPU).
        self.backend = "auto"
        # True: CPU batches route through kvfleet_cpu::moe_route (set at start with the plan,
        # where the C++ kernels are on).
        self.fused_route = False

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) per token."""
        logits = F.linear(x, self.gate)
        if self.fused_route and logits.dtype == torch.float32 and x.device.type == "cpu":
            # One op for softmax, top-k and the renormalisation instead of five ATen calls and
            # their dispatch per layer and step: the same operations in the same order; only
            # exp's last bit may differ from PyTorch's. float32 only: bfloat16 logits tie, and
            # ties are torch.topk's to break.
            weights, ids = torch.ops.kvfleet_cpu.moe_route(
                logits.contiguous(), self.top_k, self.norm_topk_prob)
            return (weights.to(x.dtype) if self.cast_weights else weights), ids
        probs = F.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return (weights.to(x.dtype) if self.cast_weights else weights), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        if self.backend == "triton" or x.device.type == "cuda":
            from kernels.triton.fused_moe import fused_moe

            return fused_moe(x, ids, weights, self.gate_up, self.down)
        if self.plan.use_fused(x.shape[0]):
            return self.forward_fused(x, weights, ids)
        return self.forward_reference(x, weights, ids)

    def pack_panels(self) -> bool:
        """Make the float32 panel-packed copy the fused kernel prefers (once, after the weights
        are loaded); False where it does not apply (another dtype or device, an expert width
        not a multiple of 16, no C++ op)."""
        w = self.gate_up
        if (w.dtype != torch.float32 or w.device.type != "cpu" or w.shape[1] % 32
                or not hasattr(torch.ops.kvfleet_cpu, "fused_moe_panel")):
            return False
        with torch.no_grad():
            self.panels = pack_expert_panels(self.gate_up.detach(), self.down.detach())
        return True

    def forward_fused(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """The C++ kernel (float32 and bfloat16 on CPU): on the packed panels where they exist
        for x's dtype, else on the weights as loaded."""
        out = torch.empty_like(x)
        args = (out, x.contiguous(), ids.contiguous(), weights.float().contiguous())
        if self.panels is not None and x.dtype == self.panels[0].dtype:
            torch.ops.kvfleet_cpu.fused_moe_panel(*args, *self.panels)
        else:
            torch.ops.kvfleet_cpu.fused_moe(*args, self.gate_up, self.down)
        return out

    def forward_reference(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """The PyTorch path: grouped per-expert GEMMs, one Python iteration per expert hit."""
        out = torch.zeros_like(x)
        flat_ids = ids.reshape(-1)
        # Stable sort: within an expert, rows stay in token order (as transformers' where()).
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        tokens = order // self.top_k
        row_weights = weights.reshape(-1).index_select(0, order)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = tokens[start : start + count]
            gate, up = F.linear(x.index_select(0, rows), self.gate_up[expert]).chunk(2, dim=-1)
            h = F.linear(F.silu(gate) * up, self.down[expert])
            h = h * row_weights[start : start + count, None]
            out.index_add_(0, rows, h.to(out.dtype))
            start += count
        return out
