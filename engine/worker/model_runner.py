"""Runs one engine step on the model: flat batch in, one sampled token per finishing request out
(plus its logprobs when the request asked for them), and the prompt logprobs of this step's
prefill chunks for requests that still owe them.

Owns the paged KV cache tensors (one [2, num_blocks, block_size, num_kv_heads, head_dim] tensor
per layer, in the model's dtype, on the engine's device; with sliding-window KV groups,
engine.core.kv_groups, one tensor per slot, shared by that slot's layer of every group, and
each layer's attention reads its group's block tables), the sampler and the per-request
generators of seeded requests. On CUDA the inputs are built on the host and sent non-blocking
(engine.worker.device_inputs), decode-only steps replay captured CUDA graphs when enabled
(engine.worker.cuda_graphs), and the only host<->device sync of a step is reading its samples back.

Structured outputs: when the engine set `structured` (engine.structured.manager), the sampled
rows of constrained requests carry their grammar's allowed-token mask into the sampler;
batches without a constrained request only pay one list scan for it.

Prompt logprobs use the sampled-token definition (engine.worker.sampler): raw log_softmax of the
float32 logits at position p, gathered at prompt token p + 1, rank and top-k by
`gather_logprobs`. Their logits are computed at most `PROMPT_LOGPROBS_MAX_ROWS` rows at a time,
so a long chunk never holds [chunk, vocab] float32 logits at once. Batches where no request
owes them skip all of this (an empty list check).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.triton_backend import load_kernels
from engine.attention.unified_batch import UnifiedBatch, build_unified_batch
from engine.core.kv_groups import KVGroupLayout
from engine.core.request import Request
from engine.core.scheduler_output import ScheduledRequest
from engine.logprobs import TokenLogprobs
from engine.models.config import ModelConfig
from engine.models.gemm_select import MAX_PREFILL_ROWS
from engine.models.layer_ops import FUSED_DTYPES
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine.spec_decode.spec_scheduling import VerifiedTokens
from engine.spec_decode.verifier import VerifyRows, verify_drafts
from engine.structured.manager import StructuredOutputManager
from engine.worker.cuda_graphs import DecodeGraphs
from engine.worker.device_inputs import model_input_to_device
from engine.worker.group_inputs import for_groups
from engine.worker.input_batch import ModelInput, PromptLogprobRows, build_model_input
from engine.worker.sampler import Sampler, SamplerOutput, SamplingRow, gather_logprobs, plain_greedy

# Rows of prompt-logprob logits per piece: 256 x 49,152 (SmolLM2's vocab) float32 is 48 MiB,
# against 384 MiB for a whole 2,048-token chunk.
PROMPT_LOGPROBS_MAX_ROWS = 256


def kv_cache_bytes_per_block(
    config: ModelConfig, block_size: int, dtype: torch.dtype,
    groups: KVGroupLayout | None = None,
) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    num_tensors = config.num_hidden_layers if groups is None else groups.group_size
    per_token = 2 * num_tensors * config.num_key_value_heads * config.head_dim
    return per_token * block_size * itemsize


@dataclass(frozen=True)
class RunnerOutput:
    """One step's samples by request id; `logprobs` only has requests that asked for them;
    `prompt_logprobs` the entries of this step's prompt positions of requests owing them
    (position p's entry is prompt token p + 1's)."""

    token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Requests that verified drafts (engine.spec_decode): their tokens of this step.
    verified: dict[str, VerifiedTokens] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        model_config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        seed: int,
        attention_backend: str = "auto",
        linear_backend: str = "auto",
        device: torch.device | None = None,
        max_batch_rows: int = MAX_PREFILL_ROWS,
        kv_groups: KVGroupLayout | None = None,
    ) -> None:
        self.model = model
        self.device = device or torch.device("cpu")
        self.linear_backend = model.prepack(linear_backend, max_batch_rows)
        # "triton" comes resolved from engine.worker.device: always on CUDA, on CPU only when asked
        # for (interpreted, for tests).
        self.use_triton = attention_backend == "triton"
        if self.use_triton:
            load_kernels(self.device)
            self.use_decode_kernel = False
        else:
            self.use_decode_kernel = self._choose_decode_kernel(attention_backend)
        # The fused elementwise kernels come from the same build; float32 and bfloat16 only
        # (bfloat16 ones bit-identical to the PyTorch path), float16 keeps the PyTorch ops.
        model.use_fused_ops(self.use_decode_kernel and dtype in FUSED_DTYPES)
        self.block_size = block_size
        self.vocab_size = model_config.vocab_size
        shape = (2, num_blocks, block_size, model_config.num_key_value_heads, model_config.head_dim)
        self.kv_groups = kv_groups
        self.kv_caches = self._allocate_kv(shape, dtype, model_config.num_hidden_layers)
        self.sampler = Sampler(seed)
        # Set by the engine: masks for constrained requests (engine.structured).
        self.structured: StructuredOutputManager | None = None
        self._generators: dict[str, torch.Generator] = {}
        self.decode_graphs: DecodeGraphs | None = None

    def enable_decode_graphs(
        self, sizes: tuple[int, ...], max_blocks_per_seq: int, capture: bool = True
    ) -> None:
        """Decode-only steps through `DecodeGraphs` (Triton backend only); `capture=False`
        runs their padded static-buffer path eagerly (how CPU tests check it)."""
        if not self.use_triton:
            raise ValueError("decode graphs need the Triton attention backend")
        if self.kv_groups is not None:
            raise ValueError("decode graphs read one block table; sliding-window KV groups "
                             "have several")
        self.decode_graphs = DecodeGraphs(
            self.model, self.kv_caches, sizes, max_blocks_per_seq, capture
        )

    def _allocate_kv(
        self, shape: tuple[int, ...], dtype: torch.dtype, num_layers: int
    ) -> list[torch.Tensor]:
        """One KV tensor per layer; with KV groups, layers of one slot share a tensor and
        their attention is told its group."""
        groups = self.kv_groups
        if groups is None:
            return [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        shared = [torch.zeros(shape, dtype=dtype, device=self.device)
                  for _ in range(groups.group_size)]
        for layer, group in zip(self.model.layers, groups.layer_group, strict=True):
            assert isinstance(layer, LlamaDecoderLayer)
            layer.self_attn.attn.kv_group = group
        return [shared[slot] for slot in groups.layer_slot]

    @staticmethod
    def _choose_decode_kernel(backend: str) -> bool:
        if backend == "torch":
            return False
        from kernels.cpu import load

        ok = load()
        if backend == "cpu_kernel" and not ok:
            raise RuntimeError(
                "attention_backend='cpu_kernel' but the CPU kernels failed to build"
            )
        return ok

    def add_request(self, request_id: str, seed: int | None) -> None:
        if seed is not None:
            self._generators[request_id] = torch.Generator().manual_seed(seed)

    def remove_request(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _sampling_row(self, request: Request) -> SamplingRow:
        params = request.sampling_params
        banned: tuple[int, ...] = ()
        grammar_done = request.grammar is not None and request.grammar.is_terminated
        if request.num_output_tokens < params.min_tokens and not grammar_done:
            # Like vLLM: before min_tokens, EOS and stop tokens cannot be sampled at all
            # (unless a complete grammar allows nothing but EOS).
            eos = () if params.ignore_eos else tuple(request.eos_token_ids)
            banned = tuple(params.stop_token_ids) + eos
        return SamplingRow(
            params,
            self._generators.get(request.request_id),
            banned,
            request.prompt_token_ids,
            request.output_token_ids,
        )

    @torch.inference_mode()
    def execute(
        self, scheduled: list[ScheduledRequest], block_ids: dict[str, list[int]],
        group_block_ids: dict[str, list[list[int]]] | None = None,
    ) -> RunnerOutput:
        """`group_block_ids`: per request, the sliding KV groups' tables (group 1 first)."""
        batch = build_model_input(scheduled, block_ids, self.block_size, self.use_decode_kernel)
        if self.use_triton:
            unified = build_unified_batch(scheduled, block_ids, self.block_size)
            batch = replace(batch, meta=replace(batch.meta, unified=unified))
        if group_block_ids:
            batch = replace(batch, meta=replace(batch.meta, groups=self._group_metas(
                batch.meta, batch.positions, scheduled, group_block_ids)))
        if batch.meta.unified is not None:
            hidden = self._graph_forward(batch, batch.meta.unified)
            batch = model_input_to_device(batch, self.device)
            if hidden is None:
                hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        elif batch.prompt_logprob_rows or batch.verify_rows:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        else:  # only the sampled rows' hidden states are wanted: the last layer skips the rest
            kept = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta,
                              keep_rows=batch.sample_indices)
            return self._sampled_output(batch, kept, {}, {})
        prompt_logprobs = {
            rows.request_id: self._prompt_logprobs(hidden, rows)
            for rows in batch.prompt_logprob_rows
        }
        verified = (
            verify_drafts(self.model, hidden, batch.verify_rows, self._sampling_row, self.sampler,
                          self._draft_masks(batch.verify_rows))
            if batch.verify_rows else {}
        )
        return self._sampled_output(batch, hidden[batch.sample_indices], prompt_logprobs,
                                    verified)

    def _group_metas(
        self, meta: AttentionMetadata, positions: torch.Tensor,
        scheduled: list[ScheduledRequest], group_block_ids: dict[str, list[list[int]]],
    ) -> tuple[AttentionMetadata, ...]:
        """The step's attention metadata through each sliding group's block tables."""
        assert self.kv_groups is not None
        metas = for_groups(meta, scheduled, group_block_ids, positions, self.block_size)
        assert len(metas) == self.kv_groups.num_sliding_groups
        return metas

    def _sampled_output(
        self,
        batch: ModelInput,
        sample_hidden: torch.Tensor,
        prompt_logprobs: dict[str, list[TokenLogprobs]],
        verified: dict[str, VerifiedTokens],
    ) -> RunnerOutput:
        """The step's output from the sampled rows' hidden states, in `sampled_requests` order."""
        if not batch.sampled_requests:
            return RunnerOutput(prompt_logprobs=prompt_logprobs, verified=verified)
        rows = [self._sampling_row(item.request) for item in batch.sampled_requests]
        if self.structured is not None:
            rows = self._constrain(rows, [item.request for item in batch.sampled_requests])
        sampled = self._sample(sample_hidden, rows)
        ids = [item.request.request_id for item in batch.sampled_requests]
        token_ids = dict(zip(ids, sampled.token_ids, strict=True))
        if sampled.logprobs is None:
            return RunnerOutput(token_ids, prompt_logprobs=prompt_logprobs, verified=verified)
        logprobs = {
            rid: lp for rid, lp in zip(ids, sampled.logprobs, strict=True) if lp is not None
        }
        return RunnerOutput(token_ids, logprobs, prompt_logprobs, verified)

    def _constrain(self, rows: list[SamplingRow], requests: list[Request]) -> list[SamplingRow]:
        """Rows of constrained requests with their allowed-token masks (others unchanged)."""
        index = [i for i, request in enumerate(requests) if request.grammar is not None]
        if not index or self.structured is None:
            return rows
        matchers = [grammar for i in index if (grammar := requests[i].grammar) is not None]
        allowed = self.structured.allowed_masks(matchers, self.vocab_size)
        rows = list(rows)
        for j, i in enumerate(index):
            if allowed[j] is not None:
                rows[i] = replace(rows[i], allowed_token_mask=allowed[j])
        return rows

    def _draft_masks(self, verify_rows: list[VerifyRows]) -> dict[str, torch.Tensor]:
        """Allowed tokens per row of the constrained requests verifying drafts."""
        out: dict[str, torch.Tensor] = {}
        for rows in verify_rows:
            request = rows.item.request
            if request.grammar is not None and self.structured is not None:
                out[request.request_id] = self.structured.draft_masks(
                    request.grammar, rows.item.spec_token_ids, self.vocab_size
                )
        return out

    def _sample(self, hidden: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        if all(plain_greedy(row) for row in rows):
            token_ids = self.model.greedy_tokens(hidden)
            if token_ids is not None:
                return SamplerOutput(token_ids)
        return self.sampler(self.model.compute_logits(hidden), rows)

    def _graph_forward(self, batch: ModelInput, unified: UnifiedBatch) -> torch.Tensor | None:
        """Hidden states from the decode graphs when the step is decode-only and fits one."""
        graphs = self.decode_graphs
        num_tokens = batch.meta.num_tokens
        if graphs is None or num_tokens != unified.seq_lens.shape[0]:
            return None
        if not graphs.fits(num_tokens, unified.block_tables.shape[1]):
            return None
        return graphs.run(
            batch.input_ids, batch.positions, batch.meta.slot_mapping, unified.seq_lens,
            unified.block_tables,
        )

    def _prompt_logprobs(
        self, hidden: torch.Tensor, rows: PromptLogprobRows
    ) -> list[TokenLogprobs]:
        targets = torch.tensor(rows.target_ids, dtype=torch.int64, device=hidden.device)
        num_rows = len(rows.target_ids)
        entries: list[TokenLogprobs] = []
        for lo in range(0, num_rows, PROMPT_LOGPROBS_MAX_ROWS):
            hi = min(lo + PROMPT_LOGPROBS_MAX_ROWS, num_rows)
            # A request's rows are contiguous, so the slice is a view, not a copy.
            piece = hidden[rows.offset + lo : rows.offset + hi]
            logprobs = self.model.compute_logits(piece).log_softmax(dim=-1)
            entries.extend(gather_logprobs(logprobs, targets[lo:hi], [rows.num_top] * (hi - lo)))
        return entries
