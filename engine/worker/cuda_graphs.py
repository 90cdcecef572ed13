"""CUDA graphs for decode-only steps, captured once per batch size at start-up (like vLLM).

A step whose every request computes exactly one token (decodes, and one-token prompt chunks)
has a shape fixed by its request count alone, so its forward pass can be replayed from a
captured graph instead of launching ~10 kernels per layer from Python. Steps of B requests run
the graph captured for the smallest size >= B (`padded_size`); steps larger than the largest
size, and steps with any multi-token chunk, run eagerly.

Static buffers hold the graph's inputs; a step copies its rows in and pads the rest: padded
rows are one-token sequences with `seq_lens` 1, reading (never writing: slot -1 makes the KV
write skip them) some block's first slot, and their outputs are dropped. Real rows' block
tables are written over the first columns of their rows; columns past a row's `seq_lens` are
never read, so what earlier steps left there does not matter.

`DecodeGraphs(capture=False)` runs the same padded static-buffer path eagerly: on CPU (Triton
interpreted) that is how the padding is tested against transformers without a GPU.

Invariant: the output of `run` is a view of a static buffer, valid until the next `run`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from engine.attention import AttentionMetadata
from engine.attention.unified_batch import UnifiedBatch
from engine.models.llama import LlamaForCausalLM

# vLLM's default capture list: 1, 2, 4, then every multiple of 8 up to 512.
DEFAULT_CAPTURE_SIZES = (1, 2, 4, *range(8, 513, 8))


def capture_sizes(max_num_seqs: int, requested: Sequence[int] | None = None) -> tuple[int, ...]:
    """The sizes to capture: `requested` (or vLLM's list) up to `max_num_seqs`, ascending."""
    sizes = DEFAULT_CAPTURE_SIZES if requested is None else tuple(requested)
    return tuple(sorted({s for s in sizes if 1 <= s <= max_num_seqs}))


def padded_size(sizes: Sequence[int], num_requests: int) -> int | None:
    """The smallest captured size that holds `num_requests` rows; None when none does."""
    for size in sizes:  # ascending
        if size >= num_requests:
            return size
    return None


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        sizes: Sequence[int],
        max_blocks_per_seq: int,
        capture: bool = True,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = tuple(sizes)
        self.device = kv_caches[0].device
        largest = max(self.sizes)
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=self.device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=self.device)
        int32 = torch.int32
        self.query_start_loc = torch.arange(largest + 1, dtype=int32, device=self.device)
        self.seq_lens = torch.ones(largest, dtype=int32, device=self.device)
        self.block_tables = torch.zeros(
            largest, max_blocks_per_seq, dtype=int32, device=self.device
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # Steps run per padded size (replayed or, without capture, eager).
        self.runs: Counter[int] = Counter()
        if capture:
            self._capture_all()

    @property
    def max_blocks_per_seq(self) -> int:
        return self.block_tables.shape[1]

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            prefills=(),
            decode=None,
            num_tokens=size,
            unified=UnifiedBatch(
                self.query_start_loc[: size + 1], self.seq_lens[:size], self.block_tables[:size]
            ),
        )
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        # Largest first, so the smaller graphs reuse the largest one's pool memory.
        for size in sorted(self.sizes, reverse=True):
            self._forward(size)  # warm-up: Triton compiles, rotary tables move to the device
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)

    def fits(self, num_requests: int, widest_table: int) -> bool:
        return (
            padded_size(self.sizes, num_requests) is not None
            and widest_table <= self.max_blocks_per_seq
        )

    def run(
        self,
        input_ids: torch.Tensor,  # [B] int64, host or device
        positions: torch.Tensor,  # [B] int64
        slot_mapping: torch.Tensor,  # [B] int64
        seq_lens: torch.Tensor,  # [B] int32
        block_tables: torch.Tensor,  # [B, W] int32, W <= max_blocks_per_seq
    ) -> torch.Tensor:  # [B, hidden]
        n = input_ids.shape[0]
        size = padded_size(self.sizes, n)
        if size is None:
            raise ValueError(f"no captured size holds {n} requests (largest {self.sizes[-1]})")
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.block_tables[:n, : block_tables.shape[1]].copy_(block_tables, non_blocking=True)
        # Padding rows: no KV write, a one-token context read through their block-table row,
        # which holds valid block ids (zeros from start-up, or an earlier step's).
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[n:size].fill_(1)
        self.input_ids[n:size].zero_()
        self.positions[n:size].zero_()
        self.runs[size] += 1
        graph = self.graphs.get(size)
        if graph is None:
            with torch.inference_mode():
                return self._forward(size)[:n]
        graph.replay()
        return self.outputs[size][:n]
