"""Gemma 2 and Gemma 3 (text) decoders: Llama's projections and attention, Gemma's layout.

Differences from the Llama layer, each as transformers' modeling_gemma2 / modeling_gemma3:
- embeddings are multiplied by sqrt(hidden_size), rounded to the model dtype first;
- every RMSNorm is `GemmaRMSNorm` ((1 + w) in float32), and each layer has four: input,
  post-attention, pre- and post-feed-forward; the residual adds follow each block's post norm;
- GeGLU MLP (gelu_pytorch_tanh), attention scale query_pre_attn_scalar ** -0.5;
- sliding-window layers alternate with global ones (`ModelConfig.layer_windows`); Gemma 2
  soft-caps attention scores and final logits; Gemma 3 norms q and k per head and gives its
  sliding layers their own RoPE base (`sliding_rope_theta`).
Windowed or capped layers pass the window and cap to the attention kernels
(engine.attention.paged_attention; engine.attention.masked_reference where none is used).

The norms around each residual add run as one step (`LayerOps.gemma_add_norm`, a C++ pass
per row when fused): a block's post norm, the add and the norm that reads the sum, i.e. the
pre-feed-forward norm after attention and the next layer's input norm (or the final norm)
after the MLP. A layer therefore receives its input already normed and returns the next
one's.

Invariants: the residual stream is the `hidden` tensor, updated in place once per block (the
same add as transformers' `residual + h`; the stream is the forward's own tensor from the
embedding scale on); LM head weights are the (tied) embedding matrix unless the
checkpoint has its own; greedy decoding with a final cap returns the argmax of the capped
logits, ties included: it caps only the logits that could tie with a row's maximum once
capped (engine.models.greedy_screen, on the screened LM head or the full logits), the same
ATen ops as `compute_logits`, which caps every logit (sampling, logprobs).
"""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata
from engine.models.config import ModelConfig
from engine.models.gemm_select import MAX_PREFILL_ROWS
from engine.models.greedy_screen import capped_greedy
from engine.models.layer_ops import LayerOps
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine.models.norms import GemmaRMSNorm, RMSNorm
from engine.models.rope import RotaryEmbedding


class GemmaDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig, ops: LayerOps, index: int) -> None:
        super().__init__(config, ops, index)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.sliding = config.window_of(index) is not None

    def forward_gemma(
        self,
        normed: torch.Tensor,
        hidden: torch.Tensor,
        next_norm: RMSNorm,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """`normed`: input_layernorm(hidden). Adds both blocks to `hidden` in place; returns
        next_norm(hidden)."""
        ops, eps = self.ops, self.input_layernorm.eps
        h = self.self_attn.forward(normed, cos, sin, kv_cache, meta)
        h = self.mlp.forward(ops.gemma_add_norm(
            h, hidden, self.post_attention_layernorm.weight,
            self.pre_feedforward_layernorm.weight, eps))
        return ops.gemma_add_norm(
            h, hidden, self.post_feedforward_layernorm.weight, next_norm.weight, eps)

    def row_prunable(self) -> bool:
        return False  # forward_rows is Llama's residual layout


class GemmaForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.sliding_rotary: RotaryEmbedding | None = None
        if config.sliding_rope_theta is not None:
            self.sliding_rotary = RotaryEmbedding(
                config.head_dim, config.max_position_embeddings, config.sliding_rope_theta)

    def make_layer(self, config: ModelConfig, index: int) -> GemmaDecoderLayer:
        return GemmaDecoderLayer(config, self.ops, index)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        keep_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # transformers multiplies by sqrt(hidden) as a float32 tensor cast to the weight dtype;
        # a Python float of that rounded value gives the same products, and creates no tensor
        # (CUDA graph capture replays this forward).
        scale = float(torch.tensor(self.config.hidden_size**0.5).to(hidden.dtype))
        hidden = hidden * scale
        tables = self.rotary.lookup(positions, hidden.dtype)
        local = (self.sliding_rotary.lookup(positions, hidden.dtype)
                 if self.sliding_rotary is not None else tables)
        layers = [layer for layer in self.layers if isinstance(layer, GemmaDecoderLayer)]
        assert len(layers) == len(self.layers)
        first = layers[0].input_layernorm
        normed = self.ops.gemma_norm(hidden, first.weight, first.eps)
        hook, last = self.layer_hook, len(layers) - 1
        for index, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True)):
            cos, sin = local if layer.sliding else tables
            next_norm = layers[index + 1].input_layernorm if index < last else self.norm
            normed = layer.forward_gemma(normed, hidden, next_norm, cos, sin, kv_cache, meta)
            if hook is not None and index < last:
                hook(index)
        return normed if keep_rows is None else normed.index_select(0, keep_rows)

    def prepack(self, requested: str = "auto", prefill_rows: int = MAX_PREFILL_ROWS) -> str:
        """The base choice; for a quantized Gemma whose LM head stays dense (int8 at load: the
        quantized base's prepack measures no screen), the screened head as Llama's measures it."""
        backend = super().prepack(requested, prefill_rows)
        quantized = getattr(type(self), "quant_head", None) is not None
        if requested == "auto" and quantized and self.quant_head is None:
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            self._measure_greedy_screen(weight)
        return backend

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcap
        if cap is None:
            return logits
        # In place on the fresh float32 logits: the same three ops and roundings as
        # transformers' tanh(logits / cap) * cap, without two [N, vocab] temporaries.
        return logits.div_(cap).tanh_().mul_(cap)

    def greedy_tokens(self, hidden: torch.Tensor) -> list[int] | None:
        cap = self.config.final_logit_softcap
        if cap is None:
            return super().greedy_tokens(hidden)
        if hidden.device.type != "cpu" or not _screen_op_available():
            return None
        screen = self._greedy_screen
        if screen is not None and hidden.shape[0] <= screen.max_rows:
            tokens = screen.argmax(hidden, cap)
            if tokens is not None:
                return tokens
        # Why not cap every logit and take the argmax: the tanh pass over [rows, vocab] cost
        # 4 ms a 32-row decode step, more than the rest of the head's argmax.
        return capped_greedy(super().compute_logits(hidden), cap)


def _screen_op_available() -> bool:
    from kernels.cpu import load as load_cpu_kernels

    return load_cpu_kernels() and hasattr(torch.ops.kvfleet_cpu, "screen_candidates")
