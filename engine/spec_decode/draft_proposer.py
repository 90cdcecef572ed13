"""Draft-model proposer: a smaller model with the target's vocabulary drafts k tokens greedily.

The draft keeps its own paged KV cache (its own block pool, no prefix caching) and, per
request, a shadow `Request` whose `num_computed_tokens` counts the positions its cache holds
for the target's current tokens. Each proposal feeds the shadow the target tokens it has not
computed yet (a prefill the first time, then the few tokens the last step appended), takes
the argmax, and feeds each draft back in, k forward passes over all proposing requests at
once. Afterwards the shadow's computed count is cut back to the target's known tokens: the
positions of drafts are recomputed next time (their KV may hold rejected tokens).

Drafts are greedy, so the rejection sampler treats them as one-hot proposals and sampled
output keeps the target's distribution. A request whose draft KV does not fit gets no drafts
(it decodes plainly); finished requests' draft blocks are freed on the next proposal.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.core.scheduler_output import ScheduledRequest
from engine.models.config import ModelConfig
from engine.models.loader import load_model
from engine.spec_decode.speculator import max_drafts
from engine.worker.input_batch import build_model_input


def check_draft_vocabulary(draft_dir: Path, target: ModelConfig) -> ModelConfig:
    """The draft's config; ValueError when its vocabulary differs from the target's."""
    if not (draft_dir / "config.json").is_file():
        raise ValueError(
            f"speculative_config model {str(draft_dir)!r} is not a Hugging Face-format "
            "directory with config.json"
        )
    config = ModelConfig.from_dir(draft_dir)
    if config.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft model vocabulary ({config.vocab_size} tokens) differs from the target's "
            f"({target.vocab_size}); the draft must share the target's tokenizer"
        )
    return config


class DraftModelProposer:
    def __init__(
        self,
        draft_dir: Path,
        target_config: ModelConfig,
        num_speculative_tokens: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        linear_backend: str,
    ) -> None:
        config = check_draft_vocabulary(draft_dir, target_config)
        self.model, _ = load_model(draft_dir, dtype)
        self.model.prepack(linear_backend)
        self.num_speculative_tokens = num_speculative_tokens
        self.block_size = block_size
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching=False)
        shape = (2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self._shadows: dict[str, tuple[Request, Request]] = {}

    def propose_for(self, requests: Sequence[Request]) -> None:
        self._free_finished()
        shadows = []
        for request in requests:
            request.spec_token_ids = []
            if max_drafts(request) > 0:
                shadows.append((request, self._shadow(request)))
        with torch.inference_mode():
            self._draft(shadows)
        for request, shadow in shadows:
            known = request.num_tokens
            request.spec_token_ids = shadow.all_token_ids[known : known + max_drafts(request)]
            del shadow.all_token_ids[known:]
            shadow.num_computed_tokens = min(shadow.num_computed_tokens, known)

    def _draft(self, shadows: list[tuple[Request, Request]]) -> None:
        live = [shadow for _, shadow in shadows]
        for _ in range(self.num_speculative_tokens):
            scheduled = []
            for shadow in live:
                num_new = shadow.num_tokens - shadow.num_computed_tokens
                if num_new > 0 and self.kv.allocate_slots(shadow, num_new) is not None:
                    scheduled.append(ScheduledRequest(shadow, num_new))
            if not scheduled:
                return
            block_ids = {
                s.request.request_id: self.kv.get_block_ids(s.request.request_id) for s in scheduled
            }
            batch = build_model_input(scheduled, block_ids, self.block_size)
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
            sampled = hidden[batch.sample_indices]
            tokens = self.model.greedy_tokens(sampled)
            if tokens is None:
                tokens = self.model.compute_logits(sampled).argmax(dim=-1).tolist()
            for item, token in zip(scheduled, tokens, strict=True):
                item.request.num_computed_tokens += item.num_new_tokens
                item.request.all_token_ids.append(token)
            live = [s.request for s in scheduled]

    def _shadow(self, request: Request) -> Request:
        entry = self._shadows.get(request.request_id)
        if entry is None or entry[0] is not request:
            if entry is not None:
                self.kv.free(entry[1])
            shadow = Request(
                request_id=request.request_id,
                prompt_token_ids=[],
                sampling_params=request.sampling_params,
                max_tokens=request.max_tokens,
                block_size=self.block_size,
                arrival_seq=0,
            )
            entry = (request, shadow)
            self._shadows[request.request_id] = entry
        shadow = entry[1]
        # The draft's KV of the target's tokens stays valid: they only ever grow at the end.
        shadow.all_token_ids = list(request.all_token_ids)
        return shadow

    def _free_finished(self) -> None:
        for request_id, (request, shadow) in list(self._shadows.items()):
            if request.status.finished:
                self.kv.free(shadow)
                del self._shadows[request_id]
