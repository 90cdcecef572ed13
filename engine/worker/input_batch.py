"""Turns a scheduler step into the flat tensors one forward pass needs.

For each scheduled request the step computes tokens [num_computed, num_computed + n). Their ids
and positions are concatenated into one flat batch; every token gets a cache slot
(block_id * block_size + offset) from the request's block table. Requests computing one token
form the decode batch; the rest are prefill segments (with the compiled kernels, also gathered
into one `PrefillBatch` of int32 tensors that every layer's prefill kernel call shares).
`sample_indices` are the flat positions whose hidden states produce logits: the last token of
each request that reaches the end of its known tokens this step.

A request still owing prompt logprobs (`Request.needs_prompt_logprobs`) also gets a
`PromptLogprobRows`: its positions p in this chunk with p + 1 < num_prompt_tokens, which are
contiguous flat rows, and the prompt tokens p + 1 they predict. Other requests add nothing.

A request verifying drafts (speculative decoding) computes its last known token and then its
drafts; all of its 1 + k rows need logits, so it gets a `VerifyRows` (engine.spec_decode.verifier)
instead of a sample index.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata, DecodeBatch, PrefillBatch, PrefillSegment
from engine.attention.shared_prefix import find_shared_prefixes
from engine.core.scheduler_output import ScheduledRequest
from engine.spec_decode.verifier import VerifyRows


@dataclass(frozen=True)
class PromptLogprobRows:
    """Flat rows [offset, offset + len(target_ids)) of one request's chunk: the logits of row
    j give the logprob of prompt token target_ids[j] (the token after row j's position)."""

    request_id: str
    offset: int
    target_ids: list[int]
    num_top: int


@dataclass(frozen=True)
class ModelInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_indices: torch.Tensor
    sampled_requests: list[ScheduledRequest]
    prompt_logprob_rows: list[PromptLogprobRows]
    verify_rows: list[VerifyRows]


def _context_slots(block_ids: list[int], num_tokens: int, block_size: int) -> torch.Tensor:
    table = torch.tensor(block_ids, dtype=torch.int64)
    slots = (table.unsqueeze(1) * block_size + torch.arange(block_size)).flatten()
    return slots[:num_tokens]


def build_model_input(
    scheduled: list[ScheduledRequest],
    block_ids: dict[str, list[int]],
    block_size: int,
    use_decode_kernel: bool = False,
) -> ModelInput:
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    prefills: list[PrefillSegment] = []
    decode_idx: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    prefill_tables: list[list[int]] = []
    sample_indices: list[int] = []
    sampled: list[ScheduledRequest] = []
    prompt_rows: list[PromptLogprobRows] = []
    verify_rows: list[VerifyRows] = []
    offset = 0
    for item in scheduled:
        request, n = item.request, item.num_new_tokens
        start = request.num_computed_tokens
        num_known = n - len(item.spec_token_ids)
        ids.extend(request.all_token_ids[start : start + num_known])
        ids.extend(item.spec_token_ids)
        # Python ints made a tensor once, like `ids`: an arange per request and a cat took
        # 16 us at a decode batch of 8 and 62 us at 32 (4 and 8 us this way).
        positions.extend(range(start, start + n))
        table = block_ids[request.request_id]
        if n == 1:
            decode_idx.append(offset)
            decode_tables.append(table)
            decode_lens.append(start + 1)
            slots.append(table[start // block_size] * block_size + start % block_size)
        else:
            context = _context_slots(table, start + n, block_size)
            slots.extend(context[start:].tolist())
            prefills.append(PrefillSegment(offset, offset + n, start, context))
            prefill_tables.append(table[: -(-(start + n) // block_size)])
        if request.needs_prompt_logprobs:
            prompt_rows.extend(_prompt_logprob_rows(item, offset))
        if item.spec_token_ids:
            verify_rows.append(VerifyRows(item, offset))
        offset += n
        if item.samples and not item.spec_token_ids:
            sample_indices.append(offset - 1)
            sampled.append(item)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        prefills=tuple(prefills),
        decode=_decode_batch(decode_idx, decode_tables, decode_lens, block_size,
                             use_decode_kernel),
        num_tokens=offset,
        use_decode_kernel=use_decode_kernel,
        prefill_batch=_prefill_batch(prefills, prefill_tables) if use_decode_kernel else None,
    )
    return ModelInput(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        meta=meta,
        sample_indices=torch.tensor(sample_indices, dtype=torch.int64),
        sampled_requests=sampled,
        prompt_logprob_rows=prompt_rows,
        verify_rows=verify_rows,
    )


def _prompt_logprob_rows(item: ScheduledRequest, offset: int) -> list[PromptLogprobRows]:
    request = item.request
    start = request.num_computed_tokens
    # Position p predicts token p + 1, so the prompt's last position has no prompt entry (its
    # logits give the first sampled token instead).
    end = min(start + item.num_new_tokens, request.num_prompt_tokens - 1)
    if end <= start:
        return []
    num_top = request.sampling_params.prompt_logprobs or 0
    targets = request.prompt_token_ids[start + 1 : end + 1]
    return [PromptLogprobRows(request.request_id, offset, targets, num_top)]


def _prefill_batch(
    segments: list[PrefillSegment], tables: list[list[int]]
) -> PrefillBatch | None:
    if not segments:
        return None
    width = max(len(t) for t in tables)
    return PrefillBatch(
        query_starts=torch.tensor([s.query_start for s in segments], dtype=torch.int32),
        query_lens=torch.tensor([s.query_end - s.query_start for s in segments], dtype=torch.int32),
        context_lens=torch.tensor(
            [s.num_context_tokens + s.query_end - s.query_start for s in segments],
            dtype=torch.int32,
        ),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
    )


def _decode_batch(
    indices: list[int], tables: list[list[int]], lens: list[int], block_size: int,
    use_decode_kernel: bool,
) -> DecodeBatch | None:
    if not indices:
        return None
    width = max(len(t) for t in tables)
    start, end = indices[0], indices[-1] + 1
    span = (start, end) if end - start == len(indices) else None
    padded = [t + [0] * (width - len(t)) for t in tables]
    return DecodeBatch(
        query_indices=torch.tensor(indices, dtype=torch.int64),
        block_tables=torch.tensor(padded, dtype=torch.int32),
        context_lens=torch.tensor(lens, dtype=torch.int32),
        block_size=block_size,
        query_span=span,
        shared=find_shared_prefixes(tables, lens, block_size) if use_decode_kernel else None,
    )
