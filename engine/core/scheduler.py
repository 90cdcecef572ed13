"""Continuous-batching scheduler: who computes how many tokens in the next step.

Each step spends a token budget (`max_num_batched_tokens`) on running requests first, in
priority-then-FCFS order, then admits waiting ones while `max_num_seqs` allows. With chunked
prefill a prompt is computed over several steps; without it a prompt is scheduled whole or not
at all. When blocks run out, the running request that sorts last (lowest priority, then newest)
is preempted by recompute: its blocks are freed and it returns to the waiting queue, keeping its
place by arrival. Finished requests free their blocks at once, including those ended from
outside: aborted, or stopped by a stop string that the caller matched on the detokenized text.
Each update carries the sampled tokens' logprobs when the request asked for them.

Prompt logprobs (vLLM semantics): a request that still owes them (`Request.needs_prompt_logprobs`)
is admitted without a prefix-cache lookup, since positions served from the cache would have no
logits; its blocks are still cached for others. Each chunk's entries are written into the
request by prompt position, and the whole list, [None, entry for token 1, ...], goes out once,
on the update carrying the first sampled token. Once it has gone out, a request resuming from
preemption looks up the cache like any other: its recompute needs no prompt logits.

Prefix caching: a block becomes a hit only after the step computing its KV has completed
(`update_from_output` registers it), so a step that raises leaves no poisoned hash behind. A
waiting request whose first uncached block is being computed in the current step is skipped
for this step (it keeps its queue place; those behind it may be admitted) and hits that block
in the next, rather than computing it a second time.

Fair share (`engine.core.fair_share`, when given): waiting requests are admitted in
(priority, tenant's weighted service, arrival) order, and a running prompt of a tenant that
has received more service than another tenant with prompt work gives way for the step: it
is skipped in the first pass and gets the budget left after admission (without preempting
anyone), so the engine stays work-conserving.

Urgent steps (engine.core.urgent_schedule, engine.core.urgent_step): while a step is paused between
layers, a step of only some just-added waiting requests is scheduled with `admit_one`, the
same admission as here, touching nothing of the paused step.

LoRA (when on): a step holds at most `max_loras` distinct adapters; a waiting or swapped
request whose adapter would exceed that waits, in order (engine.lora.admission).

Swap preemption (`preemption_mode` swap or auto, with swap space): the victim's blocks go to
host memory instead (engine.core.kv_cache_manager.swap_out) and it joins `swapped`, keeping
its computed tokens. Swapped requests resume (swap-in) before any waiting request is admitted,
in `sort_key` order, and waiting requests wait while any is swapped (vLLM's rule), so swapped
ones cannot starve. `auto` swaps a victim holding at least `swap_min_computed_tokens`
computed tokens; smaller ones are cheaper to recompute. Either mode recomputes when the swap
space has no room. If nothing runs and no swapped request fits back (shared blocks kept by
other swapped requests), the swapped ones fall back to recompute, so the engine cannot stall.

Speculative decoding (engine.spec_decode.spec_scheduling): a decoding running request with
drafts verifies them as 1 + k query tokens in the same budget (no preemption for drafts);
its update appends the kept drafts and one more token, stopping at a stop as plain decoding
would, and rolls its KV back past them.

Structured outputs (engine.structured): each appended token advances the request's grammar
matcher; a complete grammar allows only EOS, which then finishes the request with "stop"
even under ignore_eos or min_tokens (vLLM stops on the EOS the grammar allows, too).

Long-prompt limit and short-prefill steps: engine.core.long_prefill_limit (opt-in).

Decode-role prompt cap (`max_prefill_tokens_per_decode_step`, engine.core.decode_prefill_cap):
in a step that decodes, prompts get at most that many tokens between them; decodes and imported
requests are never held back by it.

Invariants: a request is in exactly one of `waiting` (sorted by `sort_key`), `running` or
`swapped` (sorted by `sort_key`); no waiting or swapped request is admitted in a step that
preempted (so no swap-in reads a host block that a swap-out of the same step writes); a
request's prompt logprobs are sent at most once, complete (one entry per prompt token) and
free of duplicates, even when preemption made it recompute its prompt.
"""

from __future__ import annotations

import bisect
import time

from engine.core.decode_prefill_cap import PrefillCap, is_prefilling
from engine.core.fair_share import FairShare
from engine.core.kv_cache_manager import HostHit, KVCacheManager
from engine.core.long_prefill_limit import LongPrefillLimit
from engine.core.long_prefill_limit import for_step as long_prefill_limit
from engine.core.prompt_logprobs import store_prompt_logprobs, take_prompt_logprobs
from engine.core.request import Request, RequestStatus
from engine.core.scheduler_integrity import check_scheduler
from engine.core.scheduler_output import (
    RequestUpdate,
    ScheduledRequest,
    SchedulerConfig,
    SchedulerOutput,
)
from engine.core.stop_check import check_stop
from engine.logprobs import TokenLogprobs
from engine.lora.admission import LoRAAdmission, LoRAAdmissionPass
from engine.spec_decode.spec_scheduling import (
    VerifiedTokens,
    drafts_to_verify,
    roll_back,
    step_tokens,
)
from engine.structured.advance import advance_grammar
from kvfleet.contracts.block_hash import BlockHash


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 fair_share: FairShare | None = None,
                 lora_admission: LoRAAdmission | None = None) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.fair_share = fair_share
        # At most max_loras adapters per step (engine.lora.admission); None: LoRA is off.
        self.lora_admission = lora_admission
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._swap_enabled = (
            config.preemption_mode != "recompute" and kv_cache_manager.swap is not None
        )

    # ------------------------------------------------------------------ queue management
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        if self.fair_share is not None:
            self.fair_share.on_arrival(request, self.requests.values())
        self._enqueue_waiting(request)

    def _enqueue_waiting(self, request: Request) -> None:
        _insert_sorted(self.waiting, request)

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def stop_request(self, request_id: str, stop_reason: str) -> Request | None:
        """Finish a request as stopped by a stop string its caller matched on the text."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        request.stop_reason = stop_reason
        self._finish(request, RequestStatus.FINISHED_STOPPED)
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=lambda r: r.sort_key)
        # Full blocks this step will compute: cache hits only after the step completes.
        computing: set[BlockHash] = set()
        deferred = (self.fair_share.deferred(self.running, self.waiting)
                    if self.fair_share is not None else set())
        cap = self.prefill_cap()
        longs = long_prefill_limit(self.config, self.kv, computing)
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            prefilling = is_prefilling(request)
            if id(request) in deferred or cap.limit(request, budget) <= 0:
                index += 1  # a prompt past the cap keeps its place; decodes behind it go
                continue
            drafts = drafts_to_verify(request, budget, len(self.running),
                                      self.config.spec_disable_by_batch_size, self.kv,
                                      len(self.running) - index - 1)
            if drafts and self.kv.allocate_slots(request, 1 + len(drafts)) is not None:
                num_new = 1 + len(drafts)
            else:
                drafts = ()
                num_new = min(request.num_tokens - request.num_computed_tokens,
                              cap.limit(request, budget))
                if not self._allocate_or_preempt(request, num_new, out):
                    break
                if longs is not None and prefilling:
                    longs.note_running(request, request.num_tokens - request.num_computed_tokens)
            out.scheduled.append(ScheduledRequest(request, num_new, drafts))
            self.note_computing(request, num_new, computing)
            cap.take(request, num_new, prefilling)
            budget -= num_new
            index += 1
        # Waiting requests that sort after a deferred prompt (its own tenant's later ones) are
        # admitted only after it has had the budget left.
        first_deferred = min((r for r in self.running if id(r) in deferred),
                             key=self.fair_share.key) if deferred and self.fair_share else None
        admits = not out.preempted
        lora = None
        if admits:
            lora = None if self.lora_admission is None else self.lora_admission.begin()
            if self.swapped:
                budget = self._resume_swapped(out, budget, computing, lora)
                if not self.running and self.swapped:
                    self._recompute_swapped()
            admits = not self.swapped
            if admits:
                budget = self._admit_waiting(out, budget, computing, cap, lora, first_deferred,
                                             longs)
        if deferred:
            budget = self._schedule_deferred(out, budget, deferred, computing, cap)
            if admits and first_deferred is not None:
                budget = self._admit_waiting(out, budget, computing, cap, lora, longs=longs)
        if longs is not None:
            longs.passed_over(self.waiting)
        if self.fair_share is not None:
            self.fair_share.charge((s.request, s.num_new_tokens) for s in out.scheduled)
        return out

    def _schedule_deferred(self, out: SchedulerOutput, budget: int, deferred: set[int],
                           computing: set[BlockHash], cap: PrefillCap) -> int:
        """Prompts that gave way, in running order, with what budget is left; no preemption."""
        for request in list(self.running):
            if budget <= 0:
                break
            if id(request) not in deferred:
                continue
            prefilling = is_prefilling(request)
            num_new = min(request.num_tokens - request.num_computed_tokens,
                          cap.limit(request, budget))
            if num_new <= 0 or self.kv.allocate_slots(request, num_new) is None:
                break
            out.scheduled.append(ScheduledRequest(request, num_new))
            self.note_computing(request, num_new, computing)
            cap.take(request, num_new, prefilling)
            budget -= num_new
        return budget

    def _resume_swapped(self, out: SchedulerOutput, budget: int, computing: set[BlockHash],
                        lora: LoRAAdmissionPass | None = None) -> int:
        """Swap requests back in, in order, while blocks, budget, max_num_seqs (and the
        LoRA slots) allow."""
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.swapped[0]
            if lora is not None and not lora.admits(request, self.running):
                break
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if self.kv.swap_in(request, num_new) is None:
                break
            self.swapped.pop(0)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            out.swapped_in.append(request)
            self.note_computing(request, num_new, computing)
            budget -= num_new
        return budget

    def _recompute_swapped(self) -> None:
        """Nothing runs and no swapped request fits back: drop their swap, recompute them."""
        for request in self.swapped:
            self.kv.drop_swapped(request)
            self._reset_for_recompute(request)
            request.status = RequestStatus.PREEMPTED
            self._enqueue_waiting(request)
        self.swapped.clear()

    def note_computing(self, request: Request, num_new: int, computing: set[BlockHash]) -> None:
        if not self.kv.enable_caching:
            return
        block_size = self.kv.block_size
        start = request.num_computed_tokens // block_size
        end = (request.num_computed_tokens + num_new) // block_size
        computing.update(request.block_hashes[start:end])

    def _waits_for_computing_block(
        self, request: Request, num_hit_blocks: int, computing: set[BlockHash]
    ) -> bool:
        """Whether the request's first uncached block is being computed in this step.

        Admitting it now would compute that block a second time; next step it is a hit.
        """
        max_blocks = (request.num_tokens - 1) // self.kv.block_size
        return num_hit_blocks < max_blocks and request.block_hashes[num_hit_blocks] in computing

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Allocate, preempting from the unscheduled tail; False if `request` itself was."""
        while self.kv.allocate_slots(request, num_new) is None:
            victim = self.running.pop()
            self._preempt(victim, out)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def prefill_cap(self) -> PrefillCap:
        """The decode-role prompt cap of a step scheduled now (engine.core.decode_prefill_cap)."""
        return PrefillCap.for_step(self.config.max_prefill_tokens_per_decode_step,
                                   self.config.enable_chunked_prefill, self.running)

    def _admit_waiting(self, out: SchedulerOutput, budget: int, computing: set[BlockHash],
                       cap: PrefillCap, lora: LoRAAdmissionPass | None = None,
                       before: Request | None = None,
                       longs: LongPrefillLimit | None = None) -> int:
        """Admit waiting requests in order while budget and seats last (and, with `before`,
        while they sort before it in fair-share order; with `longs`, short prompts first and
        long ones within its limit); the budget left."""
        order = (self.fair_share.admission_order(self.waiting)
                 if self.fair_share is not None else list(self.waiting))
        if longs is not None:
            order = longs.order(order)
        for request in order:
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if (before is not None and self.fair_share is not None
                    and self.fair_share.key(request) > self.fair_share.key(before)):
                break
            if lora is not None and not lora.admits(request, self.running):
                continue  # a step holds at most max_loras adapters; it keeps its place
            if cap.limit(request, budget) <= 0:
                continue  # the step's prompt tokens are spent; an imported one may still go
            if longs is not None and not longs.admits(request, self.waiting):
                continue  # next step, after the prefix its followers wait on has landed
            prefilling = is_prefilling(request)
            admitted = self.admit_one(request, cap.limit(request, budget), computing, out)
            if admitted is None:
                break
            if admitted and longs is not None:
                longs.admitted(request)
            cap.take(request, admitted, prefilling)
            budget -= admitted
        return budget

    def admit_one(self, request: Request, budget: int, computing: set[BlockHash],
                  out: SchedulerOutput) -> int | None:
        """Admit one waiting request with at most `budget` tokens: its token count; 0 when it
        must wait for a block this step computes (it keeps its place); None when it does not
        fit (budget without chunked prefill, or blocks). Also used by
        engine.core.urgent_schedule."""
        if request.kv_imported:
            return self._admit_imported(request, budget, out)
        # Cached positions would have no logits, so a request owing prompt logprobs
        # computes its whole prompt (vLLM); it makes no lookup and counts as no query.
        looked_up = not request.needs_prompt_logprobs
        hits, num_hit_tokens = self.kv.get_computed_blocks(request) if looked_up else ([], 0)
        if looked_up and self._waits_for_computing_block(request, len(hits), computing):
            return 0  # keeps its place; the ones behind it may go
        num_new = request.num_tokens - num_hit_tokens
        if not self.config.enable_chunked_prefill and num_new > budget:
            return None
        num_new = min(num_new, budget)
        if self.kv.allocate_slots(request, num_new, hits) is None:
            return None
        self.waiting.remove(request)
        if looked_up:
            self.kv.record_prefix_lookup(request.num_tokens, hits)
        request.num_computed_tokens = num_hit_tokens
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_hit_tokens
            request.num_host_cached_tokens = self.kv.block_size * sum(
                1 for hit in hits if isinstance(hit, HostHit)
            )
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        out.scheduled.append(ScheduledRequest(request, num_new))
        self.note_computing(request, num_new, computing)
        return num_new

    def _admit_imported(self, request: Request, budget: int, out: SchedulerOutput) -> int | None:
        """Admit a request whose KV a prefill engine computed (engine.disagg): its blocks are
        already its own, so no lookup; only the tokens past its computed ones are scheduled."""
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        if self.kv.allocate_slots(request, num_new) is None:
            return None
        self.waiting.remove(request)
        request.kv_imported = False  # from here on an ordinary request (recompute if preempted)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        out.scheduled.append(ScheduledRequest(request, num_new))
        return num_new

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        request.num_preemptions += 1
        request.preemption_times.append(time.monotonic())
        self.num_preemptions += 1
        if self._swap_enabled and self._should_swap(request):
            self.kv.swap_out(request)
            request.status = RequestStatus.SWAPPED
            _insert_sorted(self.swapped, request)
            out.swapped_out.append(request)
            return
        self.kv.free(request)
        self._reset_for_recompute(request)
        request.status = RequestStatus.PREEMPTED
        self._enqueue_waiting(request)

    def _should_swap(self, request: Request) -> bool:
        if request.num_computed_tokens == 0:
            return False  # nothing to keep
        if (
            self.config.preemption_mode == "auto"
            and request.num_computed_tokens < self.config.swap_min_computed_tokens
        ):
            return False
        return self.kv.can_swap_out(request)

    @staticmethod
    def _reset_for_recompute(request: Request) -> None:
        request.num_computed_tokens = 0
        # Its prompt is recomputed from position 0, rewriting any entries still owed; drop
        # them now rather than hold them while it waits.
        request.pending_prompt_logprobs.clear()

    # ------------------------------------------------------------------ step results
    def update_from_output(
        self,
        out: SchedulerOutput,
        sampled: dict[str, int],
        logprobs: dict[str, TokenLogprobs] | None = None,
        prompt_logprobs: dict[str, list[TokenLogprobs]] | None = None,
        verified: dict[str, VerifiedTokens] | None = None,
    ) -> list[RequestUpdate]:
        """Advance computed counts, append sampled tokens, finish and free stopped requests.

        `logprobs` holds the sampled tokens' logprobs of the requests that asked for them;
        `prompt_logprobs` this step's prompt entries of requests owing them, one per scheduled
        position p with p + 1 < num_prompt_tokens (the entry of prompt token p + 1);
        `verified` the tokens of requests that verified drafts (kept drafts, then one more).
        Tokens are appended one by one and a stop among them ends the request there, as if
        it had decoded them one step at a time; the drafts' KV past the kept ones is rolled
        back (engine.spec_decode.spec_scheduling.roll_back).
        """
        logprobs = logprobs or {}
        prompt_logprobs = prompt_logprobs or {}
        verified = verified or {}
        updates = []
        for item in out.scheduled:
            request = item.request
            if request.status.finished:
                continue  # aborted while the step ran
            start = request.num_computed_tokens
            request.num_computed_tokens += item.num_new_tokens - len(item.spec_token_ids)
            entries = prompt_logprobs.get(request.request_id)
            if entries is not None:
                store_prompt_logprobs(request, start, entries)
            result = step_tokens(item, sampled, logprobs, verified)
            if result is None:
                # Only now is this step's KV written: its full blocks may become cache hits.
                self.kv.cache_computed_blocks(request)
                continue
            owes_prompt_logprobs = request.needs_prompt_logprobs
            tokens, status = self._append_tokens(request, result.token_ids)
            if item.spec_token_ids:
                roll_back(self.kv, request, len(result.token_ids) - 1, len(tokens))
            self.kv.cache_computed_blocks(request)
            token_logprobs = result.logprobs
            if status is not None:
                self._finish(request, status)
            new_logprobs = None if token_logprobs is None else token_logprobs[: len(tokens)]
            prompt = take_prompt_logprobs(request) if owes_prompt_logprobs else None
            updates.append(
                RequestUpdate(request, tokens, status is not None, new_logprobs, prompt)
            )
        return updates

    def _append_tokens(
        self, request: Request, tokens: list[int]
    ) -> tuple[list[int], RequestStatus | None]:
        """Append one by one; a stop ends the request there (later tokens are dropped)."""
        for index, token in enumerate(tokens):
            request.append_output_token(token)
            if request.grammar is not None:
                advance_grammar(request, token)
            status = check_stop(request, token, self.config.max_model_len)
            if status is not None:
                return tokens[: index + 1], status
        return tokens, None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        if status is RequestStatus.FINISHED_HANDOFF:
            # Read before the free: the engine copies these blocks out before any allocation.
            request.handoff_block_ids = self.kv.get_block_ids(request.request_id)
        self.kv.free(request)
        self.requests.pop(request.request_id, None)

    # ------------------------------------------------------------------ introspection
    num_running = property(lambda self: len(self.running))
    num_waiting = property(lambda self: len(self.waiting))
    num_swapped = property(lambda self: len(self.swapped))

    def check_integrity(self) -> None:
        check_scheduler(self.kv, self.requests, self.waiting, self.running, self.swapped)


def _insert_sorted(queue: list[Request], request: Request) -> None:
    keys = [r.sort_key for r in queue]
    queue.insert(bisect.bisect_right(keys, request.sort_key), request)
