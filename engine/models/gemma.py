"""Gemma 2 and Gemma 3 (text) decoders: Llama's projections and attention, Gemma's layout.

Differences from the Llama layer, each as transformers' modeling_gemma2 / modeling_gemma3:
- embeddings are multiplied by sqrt(hidden_size), rounded to the model dtype first;
- every RMSNorm is `GemmaRMSNorm` ((1 + w) in float32), and each layer has four: input,
  post-attention, pre- and post-feed-forward; the residual adds follow each block's post norm;
- GeGLU MLP (gelu_pytorch_tanh), attention scale query_pre_attn_scalar ** -0.5;
- sliding-window layers alternate with global ones (`ModelConfig.layer_windows`); Gemma 2
  soft-caps attention scores and final logits; Gemma 3 norms q and k per head and gives its
  sliding layers their own RoPE base (`sliding_rope_theta`).
Windowed or capped layers attend through engine.attention.masked_reference (exact, not fast).

Invariants: the residual stream is the `hidden` tensor, updated out of place once per block
(as transformers' `residual + h`); LM head weights are the (tied) embedding matrix unless the
checkpoint has its own; greedy decoding never skips the final cap (`greedy_tokens` -> None
with a cap, so the sampler's argmax sees the capped logits, ties included).
"""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata
from engine.models.config import ModelConfig
from engine.models.layer_ops import LayerOps
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine.models.norms import GemmaRMSNorm
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
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        h = self.self_attn.forward(self.input_layernorm.forward(hidden), cos, sin, kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm.forward(h)
        h = self.mlp.forward(self.pre_feedforward_layernorm.forward(hidden))
        return hidden + self.post_feedforward_layernorm.forward(h)

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
        hook, last = self.layer_hook, len(self.layers) - 1
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            assert isinstance(layer, GemmaDecoderLayer)
            cos, sin = local if layer.sliding else tables
            hidden = layer.forward_gemma(hidden, cos, sin, kv_cache, meta)
            if hook is not None and index < last:
                hook(index)
        hidden = self.norm.forward(hidden)
        return hidden if keep_rows is None else hidden.index_select(0, keep_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcap
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap

    def greedy_tokens(self, hidden: torch.Tensor) -> list[int] | None:
        if self.config.final_logit_softcap is not None:
            return None  # capping can tie logits in float32: argmax the capped ones
        return super().greedy_tokens(hidden)
