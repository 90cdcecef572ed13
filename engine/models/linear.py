"""Linear layers whose CPU GEMM path is chosen per machine: plain `F.linear`, MKL's packed
GEMM, oneDNN with the weight reordered once into oneDNN's blocked layout, or our own
register-blocked kernel on a panel-packed weight (kernels/cpu/panel_linear.cpp).

Why a choice: the fastest float32 GEMM differs between CPUs. On an AMD EPYC (Zen 4) oneDNN
with a prepacked weight ran the model's shapes at 160-220 GFLOP/s where MKL's paths ran at
55-180 (the LM head at 32 rows: 144 vs 55); on other CPUs MKL can win. `gemm_select` measures
the candidates on the model's own shapes at start-up and the model uses the winner.

Invariants: every backend computes the same float32 (or bfloat16) GEMM `x @ w.T + b`; only the
blocking, hence the last bits of rounding, differ. A layer's dense `weight` parameter stays the
source of truth (loading, state_dict); the packed copy is derived from it by `prepack`.
Packing runs after the weights are loaded and before the first forward pass.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# "dense": F.linear; "mkl": MKL packed GEMM; "onednn": oneDNN with a reordered weight;
# "panel": kvfleet's kernel on [ceil(N / 32), K, 32] panels; "amx": kvfleet's AMX tile kernel
# (bfloat16) on the same panels with K padded to 32 (kernels/cpu/amx_linear.cpp).
BACKENDS = ("dense", "mkl", "onednn", "panel", "amx")
# The row count the packed layouts are tuned for (a decode batch).
_PACK_HINT_ROWS = 32
_PANEL = 32
# The activations the packed gate/up GEMM can end in (kernels/cpu/panel_linear.cpp).
GATE_UP_ACTS = ("silu", "gelu_tanh")


def backend_supported(backend: str, dtype: torch.dtype) -> bool:
    if backend == "dense":
        return True
    if backend == "mkl":
        return dtype == torch.float32 and torch.backends.mkl.is_available()
    if backend == "onednn":
        return bool(
            dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available()
            and torch.backends.mkldnn.enabled
        )
    if backend == "amx":
        return dtype == torch.bfloat16 and amx_supported()
    if backend == "panel":
        from kernels.cpu import load as load_cpu_kernels

        if not load_cpu_kernels():
            return False
        return dtype == torch.float32 or (
            dtype == torch.bfloat16 and hasattr(torch.ops.kvfleet_cpu, "panel_linear_bf16"))
    raise ValueError(f"unknown linear backend {backend!r}; choose from {', '.join(BACKENDS)}")


_AMX_K = 32
_amx_state: dict[str, bool] = {}


def amx_supported() -> bool:
    """True where the AMX op is compiled in (the CPU has AMX) and runs: Linux grants the tile
    state on request, and a kernel without that support refuses it. Tried once per process."""
    if "ok" not in _amx_state:
        from kernels.cpu import load as load_cpu_kernels

        ok = load_cpu_kernels() and hasattr(torch.ops.kvfleet_cpu, "amx_linear_bf16")
        if ok:
            try:
                # A local generator: a start-up probe must not move the caller's RNG stream.
                gen = torch.Generator().manual_seed(0)
                w = torch.randn(32, _AMX_K, dtype=torch.bfloat16, generator=gen)
                x = torch.randn(3, _AMX_K, dtype=torch.bfloat16, generator=gen)
                out = x.new_empty(3, 32)
                torch.ops.kvfleet_cpu.amx_linear_bf16(out, x, pack_amx(w), 32)
                ok = bool(torch.allclose(out.float(), x.float() @ w.float().T, rtol=2e-2,
                                         atol=1e-2))
            except RuntimeError:
                ok = False
        _amx_state["ok"] = ok
    return _amx_state["ok"]


def pack_amx(weight: torch.Tensor) -> torch.Tensor:
    """bfloat16 [N, K] -> [ceil(N / 32), Kp / 2, 64] with K zero-padded to Kp, a multiple of
    32; within a panel, [Kp / 32][2][16][32]: per k step of 32, the B tile of columns 0-15
    then that of columns 16-31, each 16 k pairs x 16 columns x 2 (AMX's VNNI order), one
    contiguous 1 KiB (kernels/cpu/amx_linear.cpp)."""
    n, k = weight.shape
    k_pad = -(-k // _AMX_K) * _AMX_K
    if k_pad != k:
        weight = torch.cat([weight, weight.new_zeros(n, k_pad - k)], dim=1)
    panels = pack_panels(weight.to(torch.bfloat16))  # [P, Kp / 2, 64]: k pair, 32 columns, 2
    p = panels.shape[0]
    return (panels.view(p, k_pad // _AMX_K, 16, 2, 32).permute(0, 1, 3, 2, 4)
            .reshape(p, k_pad // 2, 64).contiguous())


def pack_weight(weight: torch.Tensor, backend: str) -> torch.Tensor | None:
    """The backend's packed copy of a CPU [out, in] weight (None for "dense")."""
    w = weight.detach()
    if backend == "mkl":
        return torch.ops.mkl._mkl_reorder_linear_weight(w, _PACK_HINT_ROWS)
    if backend == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(w, _PACK_HINT_ROWS)
    if backend == "panel":
        return pack_panels(w)
    if backend == "amx":
        return pack_amx(w)
    return None


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] -> [ceil(N / 32), K, 32]: panel p holds columns 32p.. of W^T,
    zero-padded. bfloat16 -> [ceil(N / 32), ceil(K / 2), 64]: k in pairs, each column's pair
    adjacent (the operand order of VDPBF16PS)."""
    n, k = weight.shape
    panels = -(-n // _PANEL)
    if weight.dtype == torch.bfloat16:
        k_pad = k + k % 2
        padded = weight.new_zeros(panels * _PANEL, k_pad)
        padded[:n, :k] = weight
        return (padded.view(panels, _PANEL, k_pad // 2, 2).permute(0, 2, 1, 3)
                .reshape(panels, k_pad // 2, 2 * _PANEL).contiguous())
    padded = weight.new_zeros(panels * _PANEL, k)
    padded[:n] = weight
    return padded.view(panels, _PANEL, k).transpose(1, 2).contiguous()


def pack_gate_up_panels(weight: torch.Tensor) -> torch.Tensor:
    """[2I, K] (gate rows, then up rows) -> `pack_panels` of the rows reordered so that panel p
    holds gate columns 16p.. then the matching up columns: one micro-tile sees both halves of
    the SiLU- or GeGLU-and-mul it feeds (kernels/cpu/panel_linear.cpp, panel_gate_up).
    float32: [I / 16, K, 32]; bfloat16: [I / 16, ceil(K / 2), 64]."""
    two_i, k = weight.shape
    inter = two_i // 2
    gate = weight[:inter].view(inter // 16, 16, k)
    up = weight[inter:].view(inter // 16, 16, k)
    return pack_panels(torch.cat([gate, up], dim=1).reshape(two_i, k))


_KERNELS: dict[str, Any] = {}


def _packed_call(op: str, x: torch.Tensor, packed: torch.Tensor, n: int,
                 bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """out = x @ W^T (+ bias) by kvfleet_cpu.`op` on W's packed copy."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = x.new_empty(x.shape[0], n, dtype=out_dtype)
    kernel = _KERNELS.get(op)
    if kernel is None:  # resolved once: the attribute lookup is ~1 us, ~120 calls a step
        kernel = _KERNELS[op] = getattr(torch.ops.kvfleet_cpu, op)
    kernel(out, x, packed, n)
    if bias is not None:
        out += bias
    return out


def amx_linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None,
               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    op = "amx_linear_bf16_f32" if out_dtype == torch.float32 else "amx_linear_bf16"
    return _packed_call(op, x, packed, n, bias, out_dtype)


def panel_linear(x: torch.Tensor, packed: torch.Tensor, n: int,
                 bias: torch.Tensor | None) -> torch.Tensor:
    op = "panel_linear_bf16" if x.dtype == torch.bfloat16 else "panel_linear"
    return _packed_call(op, x, packed, n, bias, x.dtype)


def apply_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    backend: str,
    packed: torch.Tensor | None,
) -> torch.Tensor:
    if packed is None or x.shape[0] == 0:
        return F.linear(x, weight, bias)
    if backend == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if backend == "panel":
        return panel_linear(x, packed, weight.shape[0], bias)
    if backend == "amx":
        return amx_linear(x, packed, weight.shape[0], bias)
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, _PACK_HINT_ROWS)


class Linear(nn.Linear):
    backend: str = "dense"
    packed_weight: torch.Tensor | None = None
    # Batches of more rows than this run F.linear on the dense weight (gemm_select found it
    # faster there than the packed backend); None: the packed backend at every size.
    dense_above: int | None = None
    # A gate/up projection's intermediate size (set by the MLP): with the panel backend its
    # weight is packed gate/up interleaved, which also serves the fused SiLU / GeGLU.
    gate_up_inter: int = 0
    # Its activation ("silu" or "gelu_tanh", set by the MLP): bfloat16 has a GeGLU epilogue only.
    gate_up_act: str = "silu"
    interleaved: bool = False
    # Set by `prepack` where the backend is one op on the packed weight: forward calls it
    # straight away (~120 projections a step; the general path is four Python frames and
    # several nn.Module attribute lookups). `_direct_args` follow (out, x, packed).
    _direct_op: Any = None
    _direct_args: tuple[Any, ...] = ()
    _direct_dtype: torch.dtype | None = None
    # () or (bias,): a tuple, since a Parameter set as an attribute would register twice.
    _direct_bias: tuple[torch.Tensor, ...] = ()

    def prepack(self, backend: str, dense_above: int | None = None) -> None:
        self.backend = backend
        self.dense_above = dense_above
        self.interleaved = bool(
            backend == "panel" and self.gate_up_inter and self.gate_up_inter % 16 == 0
            and self.bias is None and self.weight.device.type == "cpu"
            and self._gate_up_op() is not None)
        self.packed_weight = (pack_gate_up_panels(self.weight.detach()) if self.interleaved
                              else pack_weight(self.weight, backend))
        self._set_direct()

    def _set_direct(self) -> None:
        """Decides once which op `forward` calls directly, with its fixed arguments."""
        self._direct_op, self._direct_args = None, ()
        dtype, packed = self.weight.dtype, self.packed_weight
        if packed is None or self.weight.device.type != "cpu":
            return
        n = self.out_features
        args: tuple[Any, ...]
        if self.interleaved:
            op, args = self._gate_up_op(), (self.gate_up_inter, "none")
        elif self.backend == "panel":
            op = "panel_linear_bf16" if dtype == torch.bfloat16 else "panel_linear"
            args = (n,)
        elif self.backend == "amx" and dtype == torch.bfloat16:
            op, args = "amx_linear_bf16", (n,)
        else:
            return
        assert op is not None
        self._direct_op = getattr(torch.ops.kvfleet_cpu, op).default
        self._direct_args = (packed, *args)
        self._direct_dtype = dtype
        self._direct_bias = () if self.interleaved or self.bias is None else (self.bias,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        op, rows = self._direct_op, x.shape[0]
        if (op is not None and rows and x.dtype == self._direct_dtype and x.stride(-1) == 1
                and (self.dense_above is None or rows <= self.dense_above)):
            # What the general path below computes, by the same op with the same arguments.
            out = x.new_empty(rows, self.out_features)
            op(out, x, *self._direct_args)
            for bias in self._direct_bias:
                out += bias
            return out
        if self._dense_rows(x):
            return F.linear(x, self.weight, self.bias)
        if self.interleaved and x.shape[0]:
            return self._gate_up(x, "none")
        return apply_linear(x, self.weight, self.bias, self.backend, self.packed_weight)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of this gate/up projection in one pass, or None where the weight is
        not packed for it (or the batch runs on the dense weight)."""
        return self.act_and_mul(x, "silu")

    def act_and_mul(self, x: torch.Tensor, act: str) -> torch.Tensor | None:
        """act(gate) * up ("silu" or "gelu_tanh") as the packed GEMM's epilogue, or None where
        the weight is not packed for it (or the batch runs on the dense weight)."""
        if act not in GATE_UP_ACTS:
            raise ValueError(f"act must be one of {', '.join(GATE_UP_ACTS)}, got {act!r}")
        if not (self.interleaved and x.shape[0] and act == self.gate_up_act) \
                or self._dense_rows(x):
            return None
        return self._gate_up(x, act)

    def _dense_rows(self, x: torch.Tensor) -> bool:
        return self.dense_above is not None and x.shape[0] > self.dense_above

    def _gate_up_op(self) -> str | None:
        """The packed gate/up kernel for this weight's dtype and activation, if built."""
        dtype = self.weight.dtype
        op = ("panel_gate_up" if dtype == torch.float32 else "panel_gate_up_bf16"
              if dtype == torch.bfloat16 and self.gate_up_act == "gelu_tanh" else None)
        return op if op is not None and hasattr(torch.ops.kvfleet_cpu, op) else None

    def _gate_up(self, x: torch.Tensor, act: str) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        inter = self.gate_up_inter
        out = x.new_empty(x.shape[0], 2 * inter if act == "none" else inter)
        assert self.packed_weight is not None
        op = self._gate_up_op()
        assert op is not None
        kernel = _KERNELS.get(op)
        if kernel is None:
            kernel = _KERNELS[op] = getattr(torch.ops.kvfleet_cpu, op)
        kernel(out, x, self.packed_weight, inter, act)
        return out


def prepack_linears(model: nn.Module, backend: str, dense_above: int | None = None) -> None:
    for module in model.modules():
        if isinstance(module, Linear):
            module.prepack(backend, dense_above)
