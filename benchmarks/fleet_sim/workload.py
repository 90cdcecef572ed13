"""Seeded synthetic workloads: sessions of multi-turn chats arriving as a Poisson process.

Shapes:
- `llmd`: llm-d's multi-tenant shape scaled up: every tenant has a long system prompt
  (`system_tokens`, ~6k, +-10% per tenant), several users per tenant; a session is one user's
  chat of `turns` turns, each follow-up carrying the whole conversation (system prompt, earlier
  questions and answers) after a think time; sessions pick tenants uniformly.
- `skewed`: the same, tenants drawn by a Zipf law (a few hot tenants carry most traffic).
- `no_sharing`: every request a unique prompt (no prefix is ever reused): the routing
  policies can only balance load.
- `prefix_repetition`: the real fleet benchmark's case (benchmarks/fleet_bench.py, vLLM's
  dataset of that name), to check the simulator against measured figures: `max_sessions`
  single-turn prompts, `tenants` prefixes of exactly `system_tokens` tokens, each prompt one
  of them (every prefix equally often, in a seeded shuffled order, as vLLM's sampler does)
  plus `user_tokens` own tokens; one tenant (cache salt) for all, as the benchmark sends
  none; arrivals Poisson at `sessions_per_s`, or all at once when it is infinite.

Invariants: a pure function of (config, seed): the same session gets the same tenant, the
same token ids and the same answers whatever the policy (so policies face identical
requests; only follow-up *times* depend on when the previous turn finished). Token ids lie in
[100, 40000) (SmolLM2's vocabulary is 49,152).
"""

from __future__ import annotations

import random
from array import array
from dataclasses import dataclass

SHAPES = ("llmd", "skewed", "no_sharing", "prefix_repetition")
VOCAB_LO, VOCAB_HI = 100, 40000


@dataclass(frozen=True)
class WorkloadConfig:
    shape: str = "llmd"
    tenants: int = 1000
    turns: int = 3
    system_tokens: int = 6000
    user_tokens: int = 120
    output_tokens: int = 64
    sessions_per_s: float = 2.0
    think_s: float = 5.0
    duration_s: float = 1800.0
    zipf_a: float = 1.1
    seed: int = 0
    # Sessions at most (0: as many as arrive within duration_s).
    max_sessions: int = 0

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"shape must be one of {SHAPES}, got {self.shape!r}")
        if self.sessions_per_s <= 0:
            raise ValueError(f"sessions_per_s must be positive, got {self.sessions_per_s}")
        if self.shape == "prefix_repetition" and self.max_sessions <= 0:
            raise ValueError("the prefix_repetition shape needs max_sessions (--num-prompts)")


@dataclass(frozen=True)
class Turn:
    session: int
    index: int
    tenant: str
    prompt: array[int]
    output: array[int]


def _tokens(rng: random.Random, n: int) -> array[int]:
    return array("i", (rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)))


class Workload:
    def __init__(self, config: WorkloadConfig) -> None:
        self.config = config
        self._systems: dict[int, array[int]] = {}
        rng = random.Random(config.seed)
        self.session_starts: list[float] = []
        t = 0.0
        limit = config.max_sessions or None
        while limit is None or len(self.session_starts) < limit:
            if config.sessions_per_s != float("inf"):
                t += rng.expovariate(config.sessions_per_s)
            if t >= config.duration_s:
                break
            self.session_starts.append(t)
        weights = [1.0 / (i + 1) ** config.zipf_a for i in range(config.tenants)]
        if config.shape == "prefix_repetition":
            n = len(self.session_starts)
            self._tenant_of = [i % config.tenants for i in range(n)]
            rng.shuffle(self._tenant_of)
        elif config.shape == "skewed":
            self._tenant_of = rng.choices(range(config.tenants), weights,
                                          k=len(self.session_starts))
        else:
            self._tenant_of = [rng.randrange(config.tenants) for _ in self.session_starts]
        self._history: dict[int, array[int]] = {}

    @property
    def turns_per_session(self) -> int:
        single = self.config.shape in ("no_sharing", "prefix_repetition")
        return 1 if single else self.config.turns

    def think_s(self, session: int, index: int) -> float:
        return random.Random(f"{self.config.seed}:think:{session}:{index}").expovariate(
            1.0 / self.config.think_s)

    def turn(self, session: int, index: int) -> Turn:
        """Turn `index` of `session` (turns are asked for in order, each once)."""
        c = self.config
        rng = random.Random(f"{c.seed}:turn:{session}:{index}")
        tenant_ix = self._tenant_of[session]
        if c.shape == "no_sharing":
            tenant = f"t{session}"
            prompt = _tokens(rng, c.system_tokens // 4 + c.user_tokens)
        elif c.shape == "prefix_repetition":
            tenant = "default"
            prompt = array("i", self._system(tenant_ix)) + _tokens(rng, c.user_tokens)
        else:
            tenant = f"t{tenant_ix}"
            history = self._history.pop(session, None)
            if history is None:
                history = array("i", self._system(tenant_ix))
            prompt = history + _tokens(rng, c.user_tokens)
        output = _tokens(rng, c.output_tokens)
        if index + 1 < self.turns_per_session:
            self._history[session] = prompt + output
        return Turn(session, index, tenant, prompt, output)

    def _system(self, tenant: int) -> array[int]:
        system = self._systems.get(tenant)
        if system is None:
            rng = random.Random(f"{self.config.seed}:system:{tenant}")
            spread = 0.0 if self.config.shape == "prefix_repetition" else 0.1
            n = int(self.config.system_tokens * rng.uniform(1 - spread, 1 + spread))
            system = self._systems[tenant] = _tokens(rng, n)
        return system
