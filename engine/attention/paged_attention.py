"""Per-layer paged attention: the compiled CPU kernels, PyTorch as their fallback, or Triton.

With `meta.unified` set (Triton backend, engine.attention.triton_backend) the layer is one
KV write and one unified-attention launch for the whole step; what follows describes the CPU
paths.

Invariants: the layer's cache is one tensor [2, num_blocks, block_size, num_kv_heads,
head_dim] (index 0 = K, 1 = V). This step's K/V is written to every token's slot first; then
each query attends causally to its request's context read back from the cache.

With `meta.prefill_batch` set (compiled kernels loaded) all prefill segments are one
`paged_prefill_attention` call reading the cache in place through block tables; otherwise each
segment gathers its context and runs `F.scaled_dot_product_attention`. Decodes use
`paged_decode_attention` when `meta.use_decode_kernel`, else a padded PyTorch batch.

A layer built with a sliding window or a logit cap (Gemma) passes both to the kernels (C++
and Triton), which implement them; the shared-prefix decode kernel does not, so such a layer
decodes every request alone. Where the compiled kernels are not used (PyTorch backend, head
sizes or dtypes they lack) it attends through `engine.attention.masked_reference`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.masked_reference import masked_attention_into
from engine.attention.metadata import AttentionMetadata, DecodeBatch, PrefillSegment
from engine.attention.triton_backend import triton_attention


class PagedAttention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        logit_cap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logit_cap = logit_cap
        self.masked = sliding_window is not None or logit_cap is not None
        # The compiled kernels are instantiated for these head sizes only; other models keep
        # the PyTorch paths.
        self.kernel_fits = head_dim in (16, 32, 64, 128, 256)
        # The KV group whose block tables this layer reads (engine.core.kv_groups); 0 is the
        # full-attention group, the step's `meta` itself.
        self.kv_group = 0

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        kv_written: bool = False,
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        """Attention of this step's queries; `kv_written`: the caller already wrote key/value
        to the slots `kv_write_slots` gave (the fused RoPE + K/V write), so this call does not."""
        if self.kv_group:
            meta = meta.groups[self.kv_group - 1]
        if meta.unified is not None:  # Triton backend (CUDA, or CPU interpreted)
            return triton_attention(
                query, key, value, kv_cache, meta.slot_mapping, meta.unified, self.scale,
                self.sliding_window, self.logit_cap,
            )
        kernels = meta.use_decode_kernel  # the compiled kernels are loaded
        if not kv_written:
            if kernels and key.dtype == value.dtype == kv_cache.dtype:
                torch.ops.kvfleet_cpu.write_kv_cache.default(
                    kv_cache, key, value, meta.slot_mapping)
            else:
                self._flat(kv_cache, 0).index_copy_(0, meta.slot_mapping, key.to(kv_cache.dtype))
                self._flat(kv_cache, 1).index_copy_(
                    0, meta.slot_mapping, value.to(kv_cache.dtype))
        # Contiguous (query may be a strided view of the fused qkv projection).
        out = query.new_empty(query.shape)
        use_kernels = (
            self.kernel_fits and query.dtype == kv_cache.dtype and query.stride(-1) == 1
        )
        decode = meta.decode
        if kernels and use_kernels and meta.decode_only:
            assert decode is not None
            # The common decode-only step: the kernel reads the whole query and fills the whole
            # output, so nothing is sliced and the cache's flat views are never built.
            self._decode_kernel(out, query, kv_cache, decode)
            return out.view(meta.num_tokens, self.num_heads * self.head_dim)
        if self.masked and not (use_kernels and kernels):
            masked_attention_into(out, query, self._flat(kv_cache, 0), self._flat(kv_cache, 1),
                                  meta, self.scale, self.sliding_window, self.logit_cap)
            return out.view(meta.num_tokens, self.num_heads * self.head_dim)
        batch = meta.prefill_batch
        if batch is not None and use_kernels:
            # Reads the strided query in place; writes every prefill row of `out`.
            torch.ops.kvfleet_cpu.paged_prefill_attention(
                out, query, kv_cache[0], kv_cache[1], batch.block_tables, batch.query_starts,
                batch.query_lens, batch.context_lens, self.scale, self.sliding_window or 0,
                self.logit_cap or 0.0,
            )
            prefills: tuple[PrefillSegment, ...] = ()
        else:
            prefills = meta.prefills
        for seg in prefills:
            out[seg.query_start : seg.query_end] = self._prefill(
                query[seg.query_start : seg.query_end],
                key[seg.query_start : seg.query_end],
                value[seg.query_start : seg.query_end],
                self._flat(kv_cache, 0),
                self._flat(kv_cache, 1),
                seg.num_context_tokens,
                seg.context_slots,
            )
        if decode is not None:
            self._decode_into(out, query, kv_cache, meta, use_kernels)
        return out.view(meta.num_tokens, self.num_heads * self.head_dim)

    def kv_write_slots(self, meta: AttentionMetadata) -> torch.Tensor | None:
        """The cache slots of this layer's K/V rows where the caller may write them itself with
        the compiled kernels (then passing `kv_written=True`); None where `forward` must write
        them (Triton, PyTorch fallback)."""
        if self.kv_group:
            meta = meta.groups[self.kv_group - 1]
        if meta.unified is not None or not meta.use_decode_kernel:
            return None
        return meta.slot_mapping

    def _flat(self, kv_cache: torch.Tensor, index: int) -> torch.Tensor:
        """K (0) or V (1) of the cache as [slots, num_kv_heads, head_dim], for the PyTorch paths."""
        return kv_cache[index].view(-1, self.num_kv_heads, self.head_dim)

    def _decode_kernel(
        self, result: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, decode: DecodeBatch
    ) -> None:
        """Decode attention of `q` ([B, H, D], read through its strides) into `result`."""
        k_cache, v_cache = kv_cache.unbind(0)
        if decode.shared is not None and not self.masked:  # shared prefixes once per group
            torch.ops.kvfleet_cpu.paged_decode_attention_shared.default(
                result, q, k_cache, v_cache, decode.block_tables, decode.context_lens,
                self.scale, decode.shared.group_of, decode.shared.shared_lens,
            )
        else:
            torch.ops.kvfleet_cpu.paged_decode_attention.default(
                result, q, k_cache, v_cache, decode.block_tables, decode.context_lens,
                self.scale, self.sliding_window or 0, self.logit_cap or 0.0,
            )

    def _decode_into(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        use_kernels: bool,
    ) -> None:
        decode = meta.decode
        assert decode is not None
        # Decodes usually sit in one run of the flat batch: slice instead of gather/scatter.
        span = decode.query_span
        q = query[span[0] : span[1]] if span else query[decode.query_indices]
        dest = out[span[0] : span[1]] if span else None
        if meta.use_decode_kernel and use_kernels:
            result = dest if dest is not None else torch.empty_like(q)
            self._decode_kernel(result, q, kv_cache, decode)
        else:
            result = self._decode(q, self._flat(kv_cache, 0), self._flat(kv_cache, 1), meta)
            if dest is not None:
                dest.copy_(result)
        if dest is None:
            out[decode.query_indices] = result

    def _prefill(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        flat_k: torch.Tensor,
        flat_v: torch.Tensor,
        num_context: int,
        context_slots: torch.Tensor,
    ) -> torch.Tensor:
        q_len = q.shape[0]
        if num_context == 0:
            # The whole context is this chunk: use the fresh K/V, no gather needed.
            k, v = k_new, v_new
        else:
            k = flat_k.index_select(0, context_slots).to(q.dtype)
            v = flat_v.index_select(0, context_slots).to(q.dtype)
        kv_len = k.shape[0]
        # [1, H, q, D] against [1, KVH, kv, D]
        qh = q.transpose(0, 1).unsqueeze(0)
        kh = k.transpose(0, 1).unsqueeze(0)
        vh = v.transpose(0, 1).unsqueeze(0)
        if num_context == 0:
            o = F.scaled_dot_product_attention(
                qh, kh, vh, is_causal=True, scale=self.scale, enable_gqa=True
            )
        else:
            q_pos = torch.arange(num_context, num_context + q_len).unsqueeze(1)
            k_pos = torch.arange(kv_len).unsqueeze(0)
            mask = k_pos <= q_pos
            o = F.scaled_dot_product_attention(
                qh, kh, vh, attn_mask=mask, scale=self.scale, enable_gqa=True
            )
        return o.squeeze(0).transpose(0, 1)

    def _decode(
        self,
        q: torch.Tensor,  # [B, H, D]
        flat_k: torch.Tensor,
        flat_v: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        assert meta.decode is not None
        slots = meta.decode.context_slots
        b, max_len = slots.shape
        k = flat_k.index_select(0, slots.reshape(-1)).view(b, max_len, self.num_kv_heads, -1)
        v = flat_v.index_select(0, slots.reshape(-1)).view(b, max_len, self.num_kv_heads, -1)
        qh = q.unsqueeze(2)  # [B, H, 1, D]
        kh = k.transpose(1, 2).to(q.dtype)  # [B, KVH, L, D]
        vh = v.transpose(1, 2).to(q.dtype)
        o = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=meta.decode.context_mask, scale=self.scale, enable_gqa=True
        )
        return o.squeeze(2)
