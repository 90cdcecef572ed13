"""The discrete-event loop: arrivals, engine steps, routing decisions, in virtual time.

Role: runs one policy over one workload on N simulated engines. Events are (virtual time,
kind, ...) in a heap; engine step ends come before arrivals at the same instant. An arrival
is routed (real router code on real Redis, or the oracle), queued on its engine, and the
engine starts a step if idle. A step's end applies it (first tokens, finishes, cache
stores / evictions), tells the router replica (its pool counts), schedules the session's
next turn after a think time, and starts the next step.

Invariants:
- The virtual clock never reads wall time; wall time is only measured around decisions.
- Before every decision the publisher flushes what changed and expired pending claims are
  removed, so a router sees the fleet as of the decision's instant.
- New sessions arrive until `duration_s`; turns of sessions already started keep coming
  until `duration_s` too; then the fleet drains (at most `drain_s` more), and requests still
  without a first token are recorded as unfinished.
"""

from __future__ import annotations

import heapq
import sys
from dataclasses import dataclass, field

from benchmarks.fleet_sim.calibration import Calibration
from benchmarks.fleet_sim.engine_model import SimEngine, SimRequest
from benchmarks.fleet_sim.publisher import SimPublisher
from benchmarks.fleet_sim.routers import Oracle, PendingExpiry, RouterReplica
from benchmarks.fleet_sim.workload import Workload
from kvfleet.contracts.block_hash import hash_token_blocks
from router.routing.decision import _tie_key  # the router's own tie key
from router.routing.prefix_index import PrefixIndexConfig
from router.routing.ranking import Policy, PrefixPolicyConfig

ORACLE = "oracle"
POLICIES = ("prefix", "round_robin", "least_load", ORACLE)
_STEP, _ARRIVAL = 0, 1


# Seconds a simulated router waits for Redis. Virtual time does not care how long Redis
# takes, and the router's own 1-s timeouts turned an oversubscribed machine (load 27 on 2
# cores) into index outages whose fallback (asking engines over gRPC) a simulated fleet
# cannot answer.
PATIENT_REDIS_S = 60.0


def patient_index(**overrides: int) -> PrefixIndexConfig:
    """The routers' index config with timeouts no machine load reaches."""
    return PrefixIndexConfig(connect_timeout_s=PATIENT_REDIS_S, read_timeout_s=PATIENT_REDIS_S,
                             pool_timeout_s=PATIENT_REDIS_S, **overrides)


@dataclass(frozen=True)
class SimConfig:
    policy: str
    engines: int
    replicas: int = 1
    drain_s: float = 600.0
    # Print a progress line every this many simulated seconds (0: never).
    progress_every_s: float = 0.0
    prefix: PrefixPolicyConfig = field(default_factory=PrefixPolicyConfig)
    # The routers' Redis lookup (fleet size read whole, candidate window).
    index: PrefixIndexConfig = field(default_factory=patient_index)


@dataclass
class RunRecord:
    """What one run produced, for `benchmarks.fleet_sim.metrics`."""

    policy: str
    requests: list[SimRequest]
    engines: list[SimEngine]
    decision_s: list[float]
    decision_cpu_s: list[float]
    end_s: float
    duration_s: float


class FleetSim:
    def __init__(self, config: SimConfig, cal: Calibration, workload: Workload,
                 redis_url: str) -> None:
        self.config = config
        self.cal = cal
        self.workload = workload
        self.now = 0.0
        self.engines = [SimEngine(f"sim-{i:03d}", cal) for i in range(config.engines)]
        self._by_id = {e.engine_id: e for e in self.engines}
        self.publisher = SimPublisher(redis_url, self.engines, epoch=f"{config.policy}")
        self.expiry = PendingExpiry(redis_url)
        self.replicas: list[RouterReplica] = []
        self.oracle: Oracle | None = None
        if config.policy == ORACLE:
            self.oracle = Oracle(self.engines, self.publisher, config.prefix)
        else:
            self.replicas = [RouterReplica(Policy(config.policy), redis_url, self._clock,
                                           self.expiry, config.prefix, config.index)
                             for _ in range(config.replicas)]
        self._heap: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        self._plans: dict[str, tuple[float, list[tuple[SimRequest, int]]]] = {}
        self._index = {e.engine_id: i for i, e in enumerate(self.engines)}
        self._routed: dict[int, tuple[int, str, int]] = {}  # request -> (replica, engine, tokens)
        self._session_of: dict[int, tuple[int, int]] = {}
        self.requests: list[SimRequest] = []
        self.decision_s: list[float] = []
        self.decision_cpu_s: list[float] = []

    def _clock(self) -> float:
        return self.now

    def _push(self, t: float, kind: int, a: int, b: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, kind, self._seq, a, b))

    async def run(self) -> RunRecord:
        self.publisher.register_all()
        for session, start in enumerate(self.workload.session_starts):
            self._push(start, _ARRIVAL, session, 0)
        end_cap = self.workload.config.duration_s + self.config.drain_s
        report_at = self.config.progress_every_s
        while self._heap and self._heap[0][0] <= end_cap:
            t, kind, _, a, b = heapq.heappop(self._heap)
            self.now = t
            if report_at and t >= report_at:
                report_at += self.config.progress_every_s
                print(f"  {self.config.policy}: t={t:.0f}s requests={len(self.requests)}",
                      file=sys.stderr, flush=True)
            if kind == _STEP:
                self._step_done(self.engines[a])
            else:
                await self._arrive(a, b)
        for replica in self.replicas:
            await replica.close()
        self.expiry.close()
        self.publisher.close()
        return RunRecord(self.config.policy, self.requests, self.engines, self.decision_s,
                         self.decision_cpu_s, self.now, self.workload.config.duration_s)

    async def _arrive(self, session: int, index: int) -> None:
        turn = self.workload.turn(session, index)
        rid = len(self.requests)
        hashes = hash_token_blocks(turn.prompt, self.cal.block_size, cache_salt=turn.tenant)
        request = SimRequest(rid, turn.tenant, turn.prompt, hashes, len(turn.output),
                             turn.output, self.now)
        self.requests.append(request)
        self._session_of[rid] = (session, index)
        engine_id = await self._route(request)
        engine = self._by_id[engine_id]
        engine.add(request)
        self.publisher.mark(engine_id)
        if not engine.busy:
            self._start_step(engine)

    async def _route(self, request: SimRequest) -> str:
        self.publisher.flush()
        self.expiry.expire(self.now)
        if self.oracle is not None:
            return self.oracle.route(request, _tie_key(request.prompt, request.tenant))
        replica_ix = request.request_id % len(self.replicas)
        engine_id, tokens, took, cpu = await self.replicas[replica_ix].route(request)
        self.decision_s.append(took)
        self.decision_cpu_s.append(cpu)
        self._routed[request.request_id] = (replica_ix, engine_id, tokens)
        return engine_id

    def _start_step(self, engine: SimEngine) -> None:
        duration, plan = engine.plan_step()
        if not plan:
            engine.busy = False
            return
        engine.busy = True
        self._plans[engine.engine_id] = (duration, plan)
        self.publisher.mark(engine.engine_id)
        self._push(self.now + duration, _STEP, self._index[engine.engine_id])

    def _step_done(self, engine: SimEngine) -> None:
        duration, plan = self._plans.pop(engine.engine_id)
        result = engine.finish_step(plan, self.now, duration)
        self.publisher.rates[engine.engine_id].observe(
            duration, result.prefill_tokens + result.decoding, result.decoding)
        for r in result.first_tokens:
            routed = self._routed.get(r.request_id)
            if routed is not None:
                self.replicas[routed[0]].first_token(routed[1], routed[2])
        for r in result.finished:
            routed = self._routed.pop(r.request_id, None)
            if routed is not None:
                self.replicas[routed[0]].finished(routed[1])
            self._next_turn(r)
        self.publisher.mark(engine.engine_id)
        self._start_step(engine)

    def _next_turn(self, r: SimRequest) -> None:
        session, index = self._session_of.pop(r.request_id)
        if index + 1 >= self.workload.turns_per_session:
            return
        at = self.now + self.workload.think_s(session, index)
        if at < self.workload.config.duration_s:
            self._push(at, _ARRIVAL, session, index + 1)

