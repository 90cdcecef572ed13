"""A model served straight from a GGUF file, its projections kept quantized.

`load_gguf_model(path, dtype)` builds our decoder for the file's architecture (Llama's from
`engine.models.llama`, Gemma 3's from `engine.models.gemma`; engine.quant.gguf_arch maps the
names and conventions) on the meta device, swaps every projection for a `QuantLinear` over
the file's quantized rows (q/k/v and gate/up fused by stacking rows), the embedding for a
`QuantEmbedding` (which, tied, is also the LM head), and fills the norms from the file.
Tensor names follow llama.cpp's (`blk.N.attn_q.weight`, ...).

GGUF's llama Q/K rows (not Gemma's) are permuted (llama.cpp's converter interleaves each
head's two RoPE halves); `_unpermute` applies transformers' inverse
(`reverse_permute_weights`) to the rows, exact on quantized data: a row's blocks never mix
rows.

Formats the kernels read (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K) stay quantized; any other
quantized type is dequantized to float32 at load (bit-equal to gguf-py), so every GGUF gguf-py
reads loads, those without the memory saving.

Invariants: every tensor of the file is used and every parameter is filled (ValueError
otherwise); the model is in eval mode with no gradients.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from gguf import GGUFReader
from torch import nn

from engine.models.config import ModelConfig
from engine.models.gemm_select import MAX_PREFILL_ROWS
from engine.models.gemma import GemmaForCausalLM
from engine.models.linear import pack_weight
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, _row_argmax_available
from engine.quant import formats
from engine.quant.dense_head import choose_head_backend
from engine.quant.gguf_arch import BY_MODEL_ARCHITECTURE, GgufArch, arch_of
from engine.quant.gguf_file import iter_tensors
from engine.quant.qlinear import QuantEmbedding, QuantLinear, QuantTensor

logger = logging.getLogger("kvfleet.engine")

_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def _unpermute(t: QuantTensor, heads: int) -> QuantTensor:
    """transformers' reverse_permute_weights on the rows of `t` (a q or k projection)."""
    n = t.rows
    order = torch.arange(n).view(heads, n // heads // 2, 2).transpose(1, 2).reshape(n)
    return QuantTensor(t.raw.index_select(0, order), t.qtype, t.k)


def _kept_format(t: QuantTensor) -> QuantTensor:
    """Kernel formats as they are; anything else as float32 rows (dequantized once)."""
    if t.qtype in formats.QUANTIZED_KERNEL_TYPES or t.qtype == formats.F32:
        return t
    dense = t.dequantize().contiguous()
    return QuantTensor(dense.view(torch.uint8), formats.F32, t.k)


def _as_float(t: QuantTensor, dtype: torch.dtype) -> torch.Tensor:
    return t.dequantize().reshape(-1).to(dtype)


class QuantLlamaForCausalLM(LlamaForCausalLM):
    """`LlamaForCausalLM` with QuantLinear projections and a quantized embedding / LM head."""

    def prepack(self, requested: str = "auto", prefill_rows: int = MAX_PREFILL_ROWS) -> str:
        """Choose each batch size's GEMM path (measured unless `requested` forces one)."""
        from engine.quant.select import choose_plan

        plan = choose_plan(self, requested)
        for module in self.modules():
            if isinstance(module, QuantLinear):
                module.plan = plan
        if self.quant_head is None:  # int8 at load: the head stays dense, packed as measured
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            self._lm_head_backend = choose_head_backend(weight.detach(), requested)
            self._packed_lm_head = pack_weight(weight, self._lm_head_backend)
        return "gguf-kernel" if plan else "gguf-dequant"

    @property
    def quant_head(self) -> QuantLinear | None:
        """The LM head over quantized rows (submodule `head`, set by the GGUF loader); None:
        the base class's dense head (int8 at load). Read from `_modules`: a class-level
        default would shadow the registered submodule."""
        head = self._modules.get("head")
        return head if isinstance(head, QuantLinear) else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.quant_head
        if head is None:
            return super().compute_logits(hidden)
        return head.forward(hidden).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> list[int] | None:
        head = self.quant_head
        if head is None:
            return super().greedy_tokens(hidden)
        if hidden.device.type != "cpu" or not _row_argmax_available():
            return None  # the sampler's argmax over compute_logits
        # The logits compute_logits gives, in the model's dtype (its float32 copy orders them
        # alike), straight to the C++ row argmax: no float32 copy, no sampler pass over them.
        ids = torch.ops.kvfleet_cpu.argmax_rows(head.forward(hidden).contiguous())
        return None if bool((ids < 0).any()) else ids.tolist()

    @property
    def weight_bytes(self) -> int:
        """Bytes of every weight as held (a tied head shares the embedding's rows)."""
        seen: set[int] = set()
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        for m in self.modules():
            tensors = (m.segments if isinstance(m, QuantLinear)
                       else [m.table] if isinstance(m, QuantEmbedding) else [])
            for t in tensors:
                if t.raw.data_ptr() not in seen:
                    seen.add(t.raw.data_ptr())
                    total += t.raw.numel()
                    # The load-time panel-ordered copy, where the plan kept it.
                    packed = getattr(t, "packed", None)
                    total += 0 if packed is None else packed.numel()
        return total


class QuantGemmaForCausalLM(GemmaForCausalLM, QuantLlamaForCausalLM):
    """Gemma 3 over quantized rows: Gemma's forward and logit cap, the quantized head, embedding
    and prepack of `QuantLlamaForCausalLM` (next in the MRO, so Gemma's `super()` reaches it)."""


def load_gguf_model(path: str | Path, config: ModelConfig, dtype: torch.dtype,
                    device: str | torch.device = "cpu") -> QuantLlamaForCausalLM:
    """The model of GGUF file `path` (config from its companion directory) in `dtype`."""
    if torch.device(device).type != "cpu":
        raise ValueError("GGUF models run on CPU only (the quantized kernel is a CPU kernel)")
    arch = arch_of(BY_MODEL_ARCHITECTURE.get(config.architecture, config.architecture))
    cls = QuantGemmaForCausalLM if arch.name == "gemma3" else QuantLlamaForCausalLM
    with torch.device("meta"):
        model = cls(config)
    tensors = dict(iter_tensors(GGUFReader(str(path))))
    _fill(model, arch, tensors, dtype)
    if tensors:
        raise ValueError(f"GGUF tensors with no place in the model: {sorted(tensors)[:8]}")
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"GGUF file is missing {len(missing)} tensors: {missing[:8]}")
    model.eval()
    model.requires_grad_(False)
    logger.info("GGUF %s: weights %.1f MiB as loaded (%s)", Path(path).name,
                model.weight_bytes / 2**20, _type_counts(model))
    if dtype == torch.bfloat16:
        # The panel-ordered Q4 copies (PANEL_Q4P) beside the rows; prepack's plan frees them
        # unless it takes that path.
        added = sum(m.pack_panels() for m in model.modules() if isinstance(m, QuantLinear))
        if added:
            logger.info("GGUF %s: panel-ordered Q4 copies %.1f MiB (kept only if the GEMM plan "
                        "takes panel-q4p)", Path(path).name, added / 2**20)
    return model


def _fill(model: QuantLlamaForCausalLM, arch: GgufArch,
          tensors: dict[str, QuantTensor], dtype: torch.dtype) -> None:
    embed = _kept_format(tensors.pop("token_embd.weight"))
    model.embed_tokens = QuantEmbedding(embed, dtype)  # type: ignore[assignment]
    head = tensors.pop("output.weight", None)
    model.add_module("head", QuantLinear([embed if head is None else _kept_format(head)]))
    model.norm.weight = _norm(tensors.pop("output_norm.weight"), arch, dtype)
    for index, layer in enumerate(model.layers):
        assert isinstance(layer, LlamaDecoderLayer)
        _fill_layer(layer, index, model.config, arch, tensors, dtype)


def _norm(t: QuantTensor, arch: GgufArch, dtype: torch.dtype) -> nn.Parameter:
    # The offset comes off in float32 before any cast, as transformers' GGUF loader does it.
    return nn.Parameter((t.dequantize().reshape(-1) - arch.norm_offset).to(dtype))


def _fill_layer(layer: LlamaDecoderLayer, i: int, config: ModelConfig, arch: GgufArch,
                tensors: dict[str, QuantTensor], dtype: torch.dtype) -> None:
    def take(name: str, kind: str = "weight") -> QuantTensor | None:
        return tensors.pop(f"blk.{i}.{name}.{kind}", None)

    def need(name: str) -> QuantTensor:
        t = take(name)
        if t is None:
            raise ValueError(f"GGUF file is missing blk.{i}.{name}.weight")
        return _kept_format(t)

    q, k = need("attn_q"), need("attn_k")
    if arch.unpermute_qk:
        q, k = _unpermute(q, config.num_attention_heads), _unpermute(k, config.num_key_value_heads)
    biases = [take(n, "bias") for n in ("attn_q", "attn_k", "attn_v")]
    qkv_bias = None
    if all(b is not None for b in biases):
        bq, bk, bv = (_as_float(b, torch.float32) for b in biases if b is not None)
        if arch.unpermute_qk:
            bq = bq.view(config.num_attention_heads, -1, 2).transpose(1, 2).reshape(-1)
            bk = bk.view(config.num_key_value_heads, -1, 2).transpose(1, 2).reshape(-1)
        qkv_bias = torch.cat([bq, bk, bv])
    attn = layer.self_attn
    attn.qkv_proj = QuantLinear([q, k, need("attn_v")], qkv_bias)  # type: ignore[assignment]
    o_bias = take("attn_output", "bias")
    attn.o_proj = QuantLinear(  # type: ignore[assignment]
        [need("attn_output")], None if o_bias is None else _as_float(o_bias, torch.float32))
    mlp = layer.mlp
    mlp.gate_up_proj = QuantLinear([need("ffn_gate"), need("ffn_up")])
    mlp.down_proj = QuantLinear([need("ffn_down")])
    for gguf_name, ours in arch.norms.items():
        norm = layer.get_submodule(ours)
        norm.weight = _norm(tensors.pop(f"blk.{i}.{gguf_name}.weight"), arch, dtype)


def _type_counts(model: nn.Module) -> str:
    counts: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, QuantLinear):
            for s in m.segments:
                counts[formats.type_name(s.qtype)] = counts.get(formats.type_name(s.qtype), 0) + 1
    return ", ".join(f"{n} x{c}" for n, c in sorted(counts.items()))
