"""One simulated engine: a vLLM-like continuous-batching scheduler over a `PrefixCache`.

Role: turns requests into step durations (from the `Calibration`) and first-token / finish
times, keeping the prefix cache the real engine would keep. Hashes are the real ones
(`kvfleet.contracts.block_hash`, salted with the tenant), so the blocks it publishes are the
blocks a router looks up.

Scheduling, per step (vLLM V1's shape): running requests first, in order — a decoding request
takes one token, a prefilling one its next chunk within the token budget — then waiting ones,
first come first served, while the budget, `max_num_seqs` and the KV capacity allow. A request
is admitted only when its prompt and `max_tokens` fit (blocks reserved up front, so there is no
preemption; a head-of-line request that does not fit blocks the queue, as in vLLM).
A prompt's leading cached blocks are hits (at most (prompt - 1) // block_size: the last token
is always computed). Blocks are stored in the cache as each chunk completes them; output
blocks when the request finishes (multi-turn follow-ups hit them).

Invariants: pure function of the calls made (no clocks, no randomness); `now` is the caller's
virtual time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from benchmarks.fleet_sim.calibration import Calibration
from benchmarks.fleet_sim.prefix_cache import BlockHash, PrefixCache
from kvfleet.contracts.block_hash import hash_token_blocks


@dataclass
class SimRequest:
    request_id: int
    tenant: str
    prompt: Sequence[int]
    hashes: list[BlockHash]  # full blocks of the prompt, salted with the tenant
    max_tokens: int
    output: Sequence[int]
    arrival_s: float
    # Filled in by the engine.
    cached_tokens: int = 0
    computed: int = 0
    generated: int = 0
    first_token_s: float = -1.0
    finish_s: float = -1.0
    held: list[BlockHash] = field(default_factory=list)
    anonymous: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)


@dataclass(frozen=True)
class StepResult:
    duration_s: float
    prefill_tokens: int
    decoding: int
    first_tokens: list[SimRequest]
    finished: list[SimRequest]


class SimEngine:
    def __init__(self, engine_id: str, cal: Calibration) -> None:
        self.engine_id = engine_id
        self.cal = cal
        self.cache = PrefixCache(cal.kv_blocks)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.busy = False  # a step is in progress (its end is scheduled)
        self.busy_s = 0.0
        self.requests = 0

    def add(self, request: SimRequest) -> None:
        self.waiting.append(request)
        self.requests += 1

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    def plan_step(self) -> tuple[float, list[tuple[SimRequest, int]]]:
        """Schedules one step: (duration, [(request, tokens)]); admits waiting requests."""
        budget = self.cal.max_num_batched_tokens
        scheduled: list[tuple[SimRequest, int]] = []
        for r in self.running:
            if budget <= 0:
                break
            n = 1 if r.computed >= r.prompt_len else min(r.prompt_len - r.computed, budget)
            scheduled.append((r, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.cal.max_num_seqs:
            r = self.waiting[0]
            if not self._admit(r):
                break
            self.waiting.popleft()
            self.running.append(r)
            n = min(r.prompt_len - r.computed, budget)
            scheduled.append((r, n))
            budget -= n
        return self._duration(scheduled), scheduled

    def finish_step(self, scheduled: list[tuple[SimRequest, int]], now: float,
                    duration: float) -> StepResult:
        first: list[SimRequest] = []
        done: list[SimRequest] = []
        prefill = decoding = 0
        bs = self.cal.block_size
        for r, n in scheduled:
            if r.computed >= r.prompt_len:  # a decode step
                decoding += 1
                r.generated += 1
            else:
                prefill += n
                before = r.computed // bs
                r.computed += n
                for h in r.hashes[before:r.computed // bs]:
                    if r.anonymous <= 0:
                        break  # squeezed in with fewer blocks than it needs: not cached
                    self.cache.store(h)
                    r.held.append(h)
                    r.anonymous -= 1
                if r.computed >= r.prompt_len:
                    r.generated = 1
                    r.first_token_s = now
                    first.append(r)
            if r.computed >= r.prompt_len and r.generated >= r.max_tokens:
                r.finish_s = now
                done.append(r)
        for r in done:
            self._release(r)
        self.busy_s += duration
        return StepResult(duration, prefill, decoding, first, done)

    def _admit(self, r: SimRequest) -> bool:
        bs = self.cal.block_size
        hits = self.cache.match(r.hashes, (r.prompt_len - 1) // bs)
        needed = -(-(r.prompt_len + r.max_tokens) // bs) - hits
        hit_hashes = r.hashes[:hits]
        if not self.cache.can_allocate(hit_hashes, needed):
            if self.running:
                return False
            needed = max(self.cache.capacity - self.cache.used - hits, 0)  # too big: squeeze in
        self.cache.acquire(hit_hashes, needed)
        r.held = list(hit_hashes)
        r.anonymous = needed
        r.cached_tokens = r.computed = hits * bs
        return True

    def _release(self, r: SimRequest) -> None:
        self.running.remove(r)
        bs = self.cal.block_size
        tokens = [*r.prompt, *r.output[: r.generated]]
        start = len(r.hashes)
        parent = r.hashes[-1] if r.hashes else None
        out_hashes = hash_token_blocks(tokens, bs, cache_salt=r.tenant if start == 0 else None,
                                       parent=parent, start_block=start)
        for h in out_hashes[: max(r.anonymous, 0)]:
            self.cache.store(h)
            r.held.append(h)
            r.anonymous -= 1
        self.cache.release(r.held, max(r.anonymous, 0))
        r.held, r.anonymous = [], 0

    def _duration(self, scheduled: list[tuple[SimRequest, int]]) -> float:
        prefill = decoding = ctx_d = 0
        ctx_p = 0.0
        for r, n in scheduled:
            if r.computed >= r.prompt_len:
                decoding += 1
                ctx_d += r.prompt_len + r.generated
            else:
                prefill += n
                ctx_p += n * (r.computed + n / 2.0)
        if not scheduled:
            return 0.0
        mean_ctx = ctx_p / prefill if prefill else 0.0
        return self.cal.step_s(prefill, mean_ctx, decoding, ctx_d)

    # -- what the engine publishes (engine.service.prefill_work's semantics) --------------

    def queued_prefill_tokens(self, max_scanned: int = 256) -> int:
        """Prompt tokens still to compute; a prefix shared by queued requests counted once."""
        bs = self.cal.block_size
        total = sum(r.prompt_len - r.computed for r in self.running if r.computed < r.prompt_len)
        claimed: set[BlockHash] = set()
        for i, r in enumerate(self.waiting):
            if i >= max_scanned:
                total += r.prompt_len
                continue
            limit = (r.prompt_len - 1) // bs
            hits = 0
            for h in r.hashes[:limit]:
                if not (h in claimed or self.cache.contains(h)):
                    break
                hits += 1
            claimed.update(r.hashes[hits:limit])
            total += r.prompt_len - hits * bs
        return total

    def num_decoding(self) -> int:
        return sum(1 for r in self.running if r.computed >= r.prompt_len)
