"""Long-prompt limit per step: shared prefixes land early, short prompts jump long ones.

vLLM's names: a prompt is *long* when more than `long_prefill_token_threshold` of its tokens
are left to compute (prefix-cache hits, and blocks that the step itself computes, are free);
a step starts at most `max_long_partial_prefills` long prompts, and short prompts are admitted
ahead of long ones. With `short_prefill_steps`, a step that admits short prompts starts no
long prompt that has not waited yet: it waits one step, once, and the short prompts' first
tokens do not wait for its compute.

Why: in a step every prompt gets its first token only when the whole step ends, and a request
whose prefix another request computes in that step must wait for the next step anyway
(engine.core.scheduler). At rate inf, 48 requests of 4 shared 512-token prefixes on one engine
used to make step 1 compute the 4 prefixes (2,048 tokens) and step 2 every suffix, so 45 of the
48 first tokens came after both. With one long prompt a step, step 1 computes prefix A, step 2
A's 11 suffixes (32 tokens each) beside prefix B, and so on: each prefix's followers get their
first token one prefix-time after it instead of after all four. Both policies are opt-in: at
rate inf every request ends near the run's end anyway, so TTFT gained is TPOT lost
(docs/architecture.md, with the measured pairs). Under Poisson arrivals the worst TTFTs are
of requests whose step also started another prefix's 512 tokens: with short-prefill steps they
get their first token after a step of ~32-token prompts instead.

Invariants:
- The limit binds only in a step with followers: some waiting request whose first uncached
  block that step computes. Without shared prefixes a long prompt has nothing to let through
  first, so the step batches prompts exactly as without the limit (same throughput).
- Short prompts go first within a priority; the base order (fair share or FCFS) is kept
  within short and within long ones.
- No starvation: short-prefill steps hold a long prompt back once; a long prompt passed over
  (by the limit, or by short prompts that used the budget) in `MAX_WAITS` steps is from then
  on ordered and admitted as a short one.
- Prompts already running are never held back: the limit counts their long chunks and only
  delays admissions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.core.scheduler_output import SchedulerConfig
from kvfleet.contracts.block_hash import BlockHash

# Steps a long prompt may be passed over before it is treated as short (the starvation bound).
MAX_WAITS = 8
# Only the head of a deep queue is reordered, so a step's lookups stay bounded.
WINDOW = 256


def default_threshold(max_model_len: int) -> int:
    """vLLM's default long_prefill_token_threshold: 4% of the context length."""
    return max(1, max_model_len * 4 // 100)


def for_step(config: SchedulerConfig, kv: KVCacheManager,
             computing: set[BlockHash]) -> LongPrefillLimit | None:
    """The limit of a step whose blocks being computed are `computing` (filled as the step is
    scheduled); None when there is no limit."""
    limit = config.max_long_partial_prefills or None
    if limit is None and not config.short_prefill_steps:
        return None
    threshold = config.long_prefill_token_threshold or default_threshold(config.max_model_len)

    def looked_up(request: Request) -> tuple[int, int]:
        """(cached blocks, those plus the ones this step computes) of a waiting request."""
        if request.kv_imported or request.needs_prompt_logprobs:
            return 0, 0
        cached = len(kv.get_computed_blocks(request)[0])
        end = cached
        max_blocks = (request.num_tokens - 1) // kv.block_size
        while end < max_blocks and request.block_hashes[end] in computing:
            end += 1
        return cached, end

    def cost(request: Request) -> int:
        if request.kv_imported:
            return request.num_tokens - request.num_computed_tokens
        return request.num_tokens - looked_up(request)[1] * kv.block_size

    def follows(request: Request) -> bool:
        cached, end = looked_up(request)
        return end > cached

    return LongPrefillLimit(limit, threshold, cost, follows, config.short_prefill_steps)


class LongPrefillLimit:
    """One step's view: which waiting prompts are long, and how many long ones it holds.

    `cost(request)` is the tokens the request would compute if admitted now (its uncached
    tokens, blocks being computed this step counted as cached); `follows(request)` whether
    its first uncached block is being computed this step.
    """

    def __init__(self, limit: int | None, threshold: int, cost: Callable[[Request], int],
                 follows: Callable[[Request], bool], short_steps: bool = False) -> None:
        self.limit = limit
        self.threshold = threshold
        self._cost = cost
        self._follows = follows
        self.short_steps = short_steps
        self.num_long = 0
        self.num_short = 0
        self._long: dict[int, bool] = {}

    def is_long(self, request: Request) -> bool:
        key = id(request)
        if key not in self._long:
            self._long[key] = (request.long_prefill_waits < MAX_WAITS
                               and self._cost(request) > self.threshold)
        return self._long[key]

    def note_running(self, request: Request, num_left: int) -> None:
        """A running prompt with `num_left` tokens to compute was scheduled this step."""
        if num_left > self.threshold:
            self.num_long += 1

    def order(self, base: Sequence[Request]) -> list[Request]:
        """Short prompts ahead of long ones within each priority; base order otherwise."""
        head = sorted(base[:WINDOW], key=lambda r: (r.priority, self.is_long(r)))
        return [*head, *base[WINDOW:]]

    def admits(self, request: Request, waiting: Sequence[Request]) -> bool:
        """Whether `request` may start now; False keeps it waiting for the next step."""
        if not self.is_long(request):
            return True
        if self.short_steps and self.num_short and not request.long_prefill_waits:
            return False  # the short prompts' first tokens do not wait for its compute
        if self.limit is None or self.num_long < self.limit:
            return True
        return not any(r is not request and self._follows(r) for r in waiting[:WINDOW])

    def admitted(self, request: Request) -> None:
        if self.is_long(request):
            self.num_long += 1
        else:
            self.num_short += 1

    def passed_over(self, requests: Sequence[Request]) -> None:
        """The step ends with these still waiting: long ones age toward the bound."""
        for request in requests[:WINDOW]:
            if self.is_long(request):
                request.long_prefill_waits += 1
