"""The Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2; with their variants Qwen3,
Phi-3, Mixtral, Qwen3-MoE: q/k norm and MoE blocks per `ModelConfig`), our own implementation.

Shapes: the batch is flattened — `input_ids`/`positions` are [T] for all requests of a step
together, and attention finds each request's tokens through `AttentionMetadata`; there is
no batch dimension and no padding.

Invariants:
- Numerics follow transformers' modeling_llama op for op (RMSNorm in float32 with the same
  order of operations, rotate-half RoPE, SiLU-gated MLP, residual adds), so float32 logits
  match transformers to ~1e-6; the only deliberate difference is that q/k/v and gate/up
  are each one fused matmul, which changes GEMM blocking but not the math.
- Parameter names are ours (`qkv_proj`, `gate_up_proj`); `load_weights` maps Hugging Face
  names onto them and fails loudly on unknown or missing tensors.
- Tied embeddings have no separate lm_head parameter: `compute_logits` reads the embedding
  matrix, so tying survives meta-device construction and dtype casts.
- Inside the decoder, modules call each other's `forward` directly, not through
  `nn.Module.__call__`: its hook checks cost ~2 us a call, ~240 calls a decode step, and
  nothing registers hooks on these modules (a LoRA wrapper replaces a module; it is not a hook).
- For the same reason the per-step path reads submodules and the norms' weights from the
  module's own `_modules` / `_parameters` dicts (`_sub`, `_weight`): `nn.Module.__getattr__`
  is a Python function, ~0.7 us a lookup and ~12 a layer; the dicts are the registry itself,
  so a replaced module or parameter is seen at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from engine.attention import AttentionMetadata, PagedAttention
from engine.models.config import ModelConfig
from engine.models.gemm_select import MAX_PREFILL_ROWS, choose_backend
from engine.models.greedy_screen import GreedyScreen, measure_rows_limit, screen_supported
from engine.models.layer_ops import LayerOps
from engine.models.linear import Linear, apply_linear, pack_weight, prepack_linears
from engine.models.moe import SparseMoeBlock
from engine.models.moe_select import configure_moe
from engine.models.norms import GemmaRMSNorm, RMSNorm
from engine.models.rope import RotaryEmbedding
from engine.models.weight_names import WeightNames

logger = logging.getLogger("kvfleet.engine")


def _sub(module: nn.Module, name: str) -> Any:
    """`module.<name>` for a registered submodule, without `nn.Module.__getattr__`."""
    return module._modules[name]


def _weight(norm: nn.Module) -> torch.Tensor:
    """A norm's `weight` parameter, without `nn.Module.__getattr__`."""
    weight = norm._parameters["weight"]
    assert weight is not None
    return weight


def _row_argmax_available() -> bool:
    from kernels.cpu import load as load_cpu_kernels

    return load_cpu_kernels() and hasattr(torch.ops.kvfleet_cpu, "argmax_rows")


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, ops: LayerOps, index: int = 0) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.qkv_proj = Linear(
            config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.qkv_bias
        )
        self.o_proj = Linear(config.q_size, config.hidden_size, bias=config.o_proj_bias)
        scale = config.attn_scale if config.attn_scale is not None else self.head_dim**-0.5
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, self.head_dim, scale=scale,
            sliding_window=config.window_of(index), logit_cap=config.attn_logit_softcap,
        )
        # Per-head RMSNorm of q and k before RoPE (Qwen3: Llama numerics; Gemma 3: 1 + w).
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            norm = GemmaRMSNorm if config.gemma else RMSNorm
            self.q_norm = norm(self.head_dim, config.rms_norm_eps)
            self.k_norm = norm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return _sub(self, "o_proj").forward(self.attend(hidden, cos, sin, kv_cache, meta))

    def attend(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Attention output before o_proj, [T, q_size]; writes every row's K/V."""
        qkv = _sub(self, "qkv_proj").forward(hidden)
        attn = _sub(self, "attn")
        if self.q_norm is not None and self.k_norm is not None:
            return attn.forward(*self._normed_qkv(qkv, cos, sin), kv_cache, meta)
        slots = attn.kv_write_slots(meta)
        if slots is not None:  # RoPE and the K/V write in one op where the kernels apply
            rotated = self.ops.rotary_qkv_write_kv(
                qkv, self.num_heads, self.num_kv_heads, self.head_dim, cos, sin, kv_cache, slots)
            if rotated is not None:
                return attn.forward(*rotated, kv_cache, meta, kv_written=True)
        q, k, v = self.ops.rotary_qkv(
            qkv, self.num_heads, self.num_kv_heads, self.head_dim, cos, sin
        )
        return attn.forward(q, k, v, kv_cache, meta)

    def _normed_qkv(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q/k normed per head, then rotated (transformers' order).

        With the fused layer ops, one C++ pass per row norms and rotates the heads in place
        (qkv is this step's own projection output). Otherwise the q and k heads are normed by
        one call with a per-head weight (q's weight on the q heads, k's on the k heads): each
        head's math is its own norm's, element for element, then the layer ops' rotation.
        """
        assert self.q_norm is not None and self.k_norm is not None
        norms = (self.q_norm, self.k_norm, isinstance(self.q_norm, GemmaRMSNorm))
        fused = self.ops.qk_norm_rotary(
            qkv, self.num_heads, self.num_kv_heads, self.head_dim, norms, cos, sin)
        if fused is not None:  # the C++ kernel: norm and rotation in one pass per row
            return fused
        t, d = qkv.shape[0], self.head_dim
        heads = self.num_heads + self.num_kv_heads
        normed = self._qk_norm().forward(qkv[:, : heads * d].reshape(t, heads, d))
        qkv = torch.cat((normed.reshape(t, heads * d), qkv[:, heads * d :]), dim=-1)
        return self.ops.rotary_qkv(qkv, self.num_heads, self.num_kv_heads, d, cos, sin)

    def _qk_norm(self) -> RMSNorm:
        """q_norm and k_norm as one norm over [q heads | k heads], rebuilt if a weight changed."""
        assert self.q_norm is not None and self.k_norm is not None
        q, k = self.q_norm.weight, self.k_norm.weight
        key = (q.data_ptr(), k.data_ptr(), q._version, k._version, q.dtype)
        cached = self.__dict__.get("_qk_norm_cache")
        if cached is None or cached[0] != key:
            norm = type(self.q_norm)(self.head_dim, self.q_norm.eps)
            weight = torch.cat((q.detach().expand(self.num_heads, -1),
                                k.detach().expand(self.num_kv_heads, -1)))
            norm.weight = nn.Parameter(weight, requires_grad=False)
            # A plain attribute, not a submodule: no state_dict entry, no device move.
            self.__dict__["_qk_norm_cache"] = cached = (key, norm)
        return cached[1]


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: LayerOps) -> None:
        super().__init__()
        self.ops = ops
        # GeGLU (Gemma): gelu_tanh(gate) * up; SiLU-and-mul otherwise.
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.gate_up_proj.gate_up_inter = config.intermediate_size
        self.gate_up_proj.gate_up_act = "gelu_tanh" if self.gelu else "silu"
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A LoRA-wrapped projection (engine.lora) adds its delta to [gate | up] first, and the
        # PyTorch path stays op-for-op transformers': both take the unfused route.
        act = None
        gate_up_proj = _sub(self, "gate_up_proj")
        if self.ops.fused and isinstance(gate_up_proj, Linear):
            act = gate_up_proj.act_and_mul(x, "gelu_tanh" if self.gelu else "silu")
        if act is None:
            gate_up = gate_up_proj.forward(x)
            act = self.ops.gelu_and_mul(gate_up) if self.gelu else self.ops.silu_and_mul(gate_up)
        return _sub(self, "down_proj").forward(act)


class LlamaDecoderLayer(nn.Module):
    """One layer over the residual stream: `residual` is transformers' hidden state, updated in
    place; the layer receives the previous block's output `x` still to be added to it."""

    def __init__(self, config: ModelConfig, ops: LayerOps, index: int = 0) -> None:
        super().__init__()
        self.ops = ops
        self.self_attn = LlamaAttention(config, ops, index)
        self.mlp: LlamaMLP | SparseMoeBlock = (
            SparseMoeBlock(config) if config.is_moe_layer(index) else LlamaMLP(config, ops))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor | None,
        residual: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        normed = self._input_norm(x, residual)
        attn_out = _sub(self, "self_attn").forward(normed, cos, sin, kv_cache, meta)
        norm = _sub(self, "post_attention_layernorm")
        return _sub(self, "mlp").forward(
            self.ops.add_rms_norm(attn_out, residual, _weight(norm), norm.eps))

    def forward_rows(
        self,
        x: torch.Tensor | None,
        residual: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        rows: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` for the last layer when only `rows` of its output are wanted: K/V are
        still written for every row, but o_proj and the MLP (the layer's GEMMs but one) run
        on those rows alone. Returns (this layer's output, residual), both [len(rows), H].
        Each row is computed alone in every op, so a kept row's values are those `forward`
        gives it (up to the GEMM backend's blocking for a different row count)."""
        normed = self._input_norm(x, residual)
        attn_out = self.self_attn.attend(normed, cos, sin, kv_cache, meta).index_select(0, rows)
        kept = residual.index_select(0, rows)
        if rows.numel() == 0:  # a step without samples: the K/V writes were all it needed
            return kept, kept
        norm = self.post_attention_layernorm
        attn_out = self.self_attn.o_proj.forward(attn_out)
        return self.mlp.forward(self.ops.add_rms_norm(attn_out, kept, norm.weight, norm.eps)), kept

    def row_prunable(self) -> bool:
        """Whether `forward_rows` may run: no LoRA wrapper, whose per-step row map covers
        every row of the batch (engine.lora), sits on a projection it would run on a subset."""
        return all(isinstance(m, Linear) for m in (self.self_attn.o_proj, *self.mlp_linears()))

    def mlp_linears(self) -> list[nn.Module]:
        """The MLP's projections LoRA wraps and the GEMM backends pack (none for MoE: its
        experts are batched weights, engine.models.moe)."""
        if isinstance(self.mlp, LlamaMLP):
            return [self.mlp.gate_up_proj, self.mlp.down_proj]
        return []

    def gemm_weights(self) -> list[torch.Tensor]:
        """The layer's projection weights, for engine.models.gemm_select to time."""
        linears = [self.self_attn.qkv_proj, self.self_attn.o_proj, *self.mlp_linears()]
        return [m.weight.detach() for m in linears if isinstance(m.weight, torch.Tensor)]

    def _input_norm(self, x: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor:
        norm = _sub(self, "input_layernorm")
        if x is None:
            return self.ops.rms_norm(residual, _weight(norm), norm.eps)
        return self.ops.add_rms_norm(x, residual, _weight(norm), norm.eps)


class LlamaForCausalLM(nn.Module):
    """Decoder stack + final norm; `compute_logits` applies the LM head separately so the
    runner only projects the rows it samples from."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.ops = LayerOps()
        self.layers = nn.ModuleList(
            [self.make_layer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = (GemmaRMSNorm if config.gemma else RMSNorm)(
            config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._lm_head_backend = "dense"
        self._packed_lm_head: torch.Tensor | None = None
        self._greedy_screen: GreedyScreen | None = None
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        # Called with the layer's index after every layer but the last (engine.core.urgent_step
        # pauses a step there); the forward pass's state is all in its own locals, so the hook
        # may run other forward passes on this model. None: no call.
        self.layer_hook: Callable[[int], None] | None = None
        # The engine's largest batch (set by prepack): the MoE path timing goes up to it.
        self._max_batch_rows = MAX_PREFILL_ROWS

    def make_layer(self, config: ModelConfig, index: int) -> nn.Module:
        return LlamaDecoderLayer(config, self.ops, index)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        keep_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; writes this step's K/V to the caches.

        With `keep_rows` (int64 row indices): only those rows' hidden states, in that order.
        The last layer then runs its o_proj and MLP on them alone (`forward_rows`): a prompt
        chunk's other rows only feed the KV cache, which that layer has written by then.
        """
        residual = self.embed_tokens(input_ids)
        cos, sin = self.rotary.lookup(positions, residual.dtype)
        x: torch.Tensor | None = None
        hook, last = self.layer_hook, len(self.layers) - 1
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            assert isinstance(layer, LlamaDecoderLayer)
            if index == last and keep_rows is not None and layer.row_prunable():
                x, residual = layer.forward_rows(x, residual, cos, sin, kv_cache, meta, keep_rows)
                keep_rows = None
                break
            x = layer.forward(x, residual, cos, sin, kv_cache, meta)
            if hook is not None and index < last:
                hook(index)
        assert x is not None
        hidden = self.ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)
        return hidden if keep_rows is None else hidden.index_select(0, keep_rows)

    def use_fused_ops(self, enabled: bool) -> None:
        """Switch the elementwise steps to the C++ CPU kernels (float32 and bfloat16), and
        let MoE layers take the fused expert kernel where start-up timing finds it faster."""
        self.ops.fused = enabled
        configure_moe(self.layers, enabled, self._max_batch_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab]; computed in the model dtype, then upcast, as HF does."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = apply_linear(hidden, weight, None, self._lm_head_backend, self._packed_lm_head)
        return logits.float()

    def prepack(self, requested: str = "auto", prefill_rows: int = MAX_PREFILL_ROWS) -> str:
        """Pick the linear backends (measured on this machine unless `requested` names one;
        `prefill_rows`: the engine's largest batch) and pack every projection and the LM head
        for theirs; returns the decoder layers' backend."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self._max_batch_rows = prefill_rows
        layers = []
        for layer in self.layers:
            assert isinstance(layer, LlamaDecoderLayer)
            layers.append(layer.gemm_weights())
        # The timing sweeps layers of one shape (Qwen3-MoE mixes dense and MoE layers).
        shapes = [w.shape for w in layers[0]]
        layers = [ws for ws in layers if [w.shape for w in ws] == shapes]
        choice = choose_backend(layers, weight.detach(), requested, prefill_rows=prefill_rows)
        backend = choice.backend
        prepack_linears(self, backend, choice.dense_above)
        self._lm_head_backend = choice.lm_head
        self._packed_lm_head = pack_weight(weight, choice.lm_head)
        self._greedy_screen = None
        if requested == "auto":
            self._measure_greedy_screen(weight)
        elif screen_supported(weight, choice.lm_head):
            self._greedy_screen = GreedyScreen(weight)
        return backend

    def _measure_greedy_screen(self, weight: torch.Tensor) -> None:
        """Time the screened greedy head against the chosen LM head's full greedy path (what
        greedy rows above the limit take) and keep it up to the rows where it wins; where it
        wins and the head is not the panel kernel's, the head moves to the panel kernel.

        Why against any chosen head: the head's backend is timed on the full head alone, and
        on AVX-512 machines the panel kernel and oneDNN are within a few percent there, so
        either may win a start, while only the panel head has the screen (about half the cost
        of either for greedy rows). Moving keeps the screen's invariant: its exact pass is the
        head's own GEMM, so greedy tokens and `compute_logits` agree.
        """
        if not screen_supported(weight, "panel"):
            return
        screen = GreedyScreen(weight)
        screen.max_rows = measure_rows_limit(screen, self._full_greedy_tokens)
        moved = screen.max_rows > 0 and self._lm_head_backend != "panel"
        logger.info("screened greedy LM head against %s: faster up to %d rows%s",
                    self._lm_head_backend, screen.max_rows,
                    ", LM head moved to panel" if moved else "")
        if moved:
            self._lm_head_backend = "panel"
            self._packed_lm_head = pack_weight(weight, "panel")
        self._greedy_screen = screen if self._lm_head_backend == "panel" else None

    def greedy_tokens(self, hidden: torch.Tensor) -> list[int] | None:
        """The argmax of `compute_logits(hidden)` per row on CPU: by the screened LM head
        (engine.models.greedy_screen) where this machine has one and the batch is within its
        measured rows, else the logits in the model's dtype (upcasting does not change their
        order) and the C++ row argmax; None where neither applies (or a logit is NaN)."""
        if hidden.device.type != "cpu":
            return None
        screen = self._greedy_screen
        if screen is not None and hidden.shape[0] <= screen.max_rows:
            return screen.argmax(hidden)
        return self._full_greedy_tokens(hidden)

    def _full_greedy_tokens(self, hidden: torch.Tensor) -> list[int] | None:
        if not _row_argmax_available():
            return None
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = apply_linear(hidden, weight, None, self._lm_head_backend, self._packed_lm_head)
        ids = torch.ops.kvfleet_cpu.argmax_rows(logits.contiguous())
        return None if bool((ids < 0).any()) else ids.tolist()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into our parameters (casting to their dtype).

        Raises ValueError on an unknown name, a shape mismatch, or a parameter left unloaded
        (engine.models.weight_names says which part of which parameter each tensor fills).
        """
        names = WeightNames(self.config, self.lm_head is None)
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            target = names.target(hf_name)
            if target is None:
                continue
            if target.param not in params:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has no parameter ({target.param!r})")
            dest: torch.Tensor = params[target.param]
            if target.expert is not None:
                dest = dest[target.expert]
            if target.rows is not None:
                dest = dest.narrow(0, *target.rows)
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"shape mismatch for {hf_name!r}: checkpoint {tuple(tensor.shape)}, "
                    f"model {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            loaded.update(f"{target.param}#{piece}" for piece in target.pieces)
        missing = [f"{name}#{piece}".removesuffix("#") for name in params
                   for piece in names.expected_pieces(name) if f"{name}#{piece}" not in loaded]
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} tensors: {shown}")
