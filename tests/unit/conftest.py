"""Shared scheduler harness for the pure-Python engine-core unit tests.

A `Harness` owns a Scheduler on a tiny config, hands out increasing arrival sequence numbers, and
simulates engine steps: schedule(), sample one token for every request whose scheduled chunk
reaches the end of its known tokens, update_from_output(), with check_integrity() in between.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest

from engine.core.fair_share import FairShare
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, TenantShare
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import RequestUpdate, SchedulerConfig, SchedulerOutput
from engine.kv_tiers.host_tier import HostKVTier
from engine.kv_tiers.swap_space import SwapSpace
from engine.kv_tiers.transfer import TransferPlan
from kvfleet.contracts.sampling_params import SamplingParams

BLOCK_SIZE = 4
DEFAULT_TOKEN = 500


class Harness:
    def __init__(
        self,
        *,
        num_blocks: int = 10,
        max_num_seqs: int = 4,
        max_num_batched_tokens: int = 16,
        max_model_len: int = 64,
        enable_chunked_prefill: bool = True,
        enable_caching: bool = True,
        fair_share: bool = False,
        num_swap_blocks: int = 0,
        num_host_blocks: int = 0,
        preemption_mode: str = "recompute",
        swap_min_computed_tokens: int = 0,
        max_prefill_tokens_per_decode_step: int | None = None,
        max_long_partial_prefills: int | None = None,
        long_prefill_token_threshold: int = 0,
        short_prefill_steps: bool = False,
    ) -> None:
        # Host ids as the engine lays them out: swap space first, then the host tier.
        self.kv = KVCacheManager(
            num_blocks, BLOCK_SIZE, enable_caching,
            swap=SwapSpace(num_swap_blocks) if num_swap_blocks else None,
            host_tier=HostKVTier(num_host_blocks, num_swap_blocks) if num_host_blocks else None,
        )
        self.config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
            preemption_mode=preemption_mode,
            swap_min_computed_tokens=swap_min_computed_tokens,
            max_prefill_tokens_per_decode_step=max_prefill_tokens_per_decode_step,
            max_long_partial_prefills=max_long_partial_prefills,
            long_prefill_token_threshold=long_prefill_token_threshold,
            short_prefill_steps=short_prefill_steps,
        )
        # The copies planned by the last schedule() (the engine runs them before the step).
        self.last_plan = TransferPlan()
        self.scheduler = Scheduler(self.config, self.kv, FairShare() if fair_share else None)
        self._next_seq = 0

    def add(
        self,
        request_id: str,
        prompt: int | Iterable[int],
        *,
        max_tokens: int = 8,
        priority: int = 0,
        eos_token_ids: Iterable[int] = (),
        cache_salt: str | None = None,
        share: TenantShare | None = None,
        lora_id: str | None = None,
        **sampling_kwargs,
    ) -> Request:
        tokens = list(range(1, prompt + 1)) if isinstance(prompt, int) else list(prompt)
        sampling_kwargs.setdefault("ignore_eos", True)
        request = Request(
            request_id=request_id,
            prompt_token_ids=tokens,
            sampling_params=SamplingParams(max_tokens=max_tokens, **sampling_kwargs),
            max_tokens=max_tokens,
            block_size=BLOCK_SIZE,
            arrival_seq=self._next_seq,
            priority=priority,
            eos_token_ids=frozenset(eos_token_ids),
            cache_salt=cache_salt,
            lora_id=lora_id,
            share=share,
        )
        self._next_seq += 1
        self.scheduler.add_request(request)
        self.scheduler.check_integrity()
        return request

    def schedule(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        self.scheduler.check_integrity()
        self.last_plan = self.kv.transfers.take()
        self.scheduler.check_integrity()
        assert out.total_num_scheduled_tokens <= self.config.max_num_batched_tokens
        assert self.scheduler.num_running <= self.config.max_num_seqs
        return out

    def update(
        self, out: SchedulerOutput, token: int | Callable[[Request], int] = DEFAULT_TOKEN
    ) -> list[RequestUpdate]:
        sampled = {
            s.request.request_id: token(s.request) if callable(token) else token
            for s in out.scheduled
            if s.samples
        }
        updates = self.scheduler.update_from_output(out, sampled)
        self.scheduler.check_integrity()
        return updates

    def step(
        self, token: int | Callable[[Request], int] = DEFAULT_TOKEN
    ) -> tuple[SchedulerOutput, list[RequestUpdate]]:
        out = self.schedule()
        return out, self.update(out, token)

    def run_to_completion(self, max_steps: int = 1000) -> int:
        steps = 0
        while self.scheduler.has_unfinished_requests():
            self.step()
            steps += 1
            assert steps <= max_steps, "scheduler made no progress"
        return steps

    # ---------------------------------------------------------------- views for assertions
    @staticmethod
    def scheduled(out: SchedulerOutput) -> list[tuple[str, int]]:
        """(request id, num_new_tokens) in scheduling order."""
        return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]

    @property
    def waiting(self) -> list[str]:
        return [r.request_id for r in self.scheduler.waiting]

    @property
    def running(self) -> list[str]:
        return [r.request_id for r in self.scheduler.running]

    @property
    def swapped(self) -> list[str]:
        return [r.request_id for r in self.scheduler.swapped]

    def block_ids(self, request_id: str) -> list[int]:
        return self.kv.get_block_ids(request_id)

    def assert_all_blocks_free(self) -> None:
        assert self.kv.num_free_blocks == self.kv.num_blocks
        assert all(b.ref_cnt == 0 for b in self.kv.pool.blocks)
        assert self.kv.req_to_blocks == {}


@pytest.fixture
def make_harness() -> Callable[..., Harness]:
    return Harness
