"""Urgent steps: a step paused between two layers while a newly arrived tenant is served.

Why: on a CPU one step of a prompt flood takes most of a second (256 prompt tokens of SmolLM2
on one thread), and fair share (engine.core.fair_share) can only put a new tenant first in the
*next* step, so its first token waits for the step in flight and then for its own step, which
work conservation fills with the flood's chunks. With `preempt_steps_for_new_tenants`, the
engine looks for new requests between the layers of a step's forward pass; a qualifying one is
added and runs a complete step of its own right there (schedule, forward pass, sampling, first
token delivered), then the paused step resumes at its next layer. Between two steps, waiting
requests of a less served tenant get a step of their own the same way, before the next ordinary
step (which would otherwise fill its budget with other tenants' prompt chunks).

The rules. Inside a paused step (`qualifying`): a new request is served when fair share ranks it
ahead of every prompt chunk of the paused step and of every other waiting request, i.e. when
the next ordinary step would have served it first anyway. That is a tenant with less weighted
service than the flood's (VTC's lift makes an idle tenant tie with the least served one, and
the tie goes to the tenant active most recently), at a priority no worse; a tenant's own
requests stay in their order (a later one never overtakes an earlier one's prompt). Pausing
only pays off in a long step, so a step without prompt chunks is never paused for. Between
steps (`due`): the waiting requests ranked ahead of every running prompt and of the
last-ranked tenant's waiting prompts, whether they arrived just now or during a step that did
not serve them (a decode-only step, or one whose chunks they did not beat). Without that,
a chat arriving during a flood's decode-only step would share the next step with a chunk of
the flood's next prompt: most of a second. Requests that qualify for neither wait for the
next ordinary step, as before.

Why nesting is sound (on the configurations `unsupported_reason` lets through):
- The paused forward pass keeps all of its state in its own locals: the step's inputs and
  attention metadata (block tables, slot mapping, positions, prefill/decode batches) are built
  fresh per step by engine.worker.input_batch, nothing persistent is shared between steps on
  CPU, and the decode-kernel choice is fixed at start-up. The urgent step builds its own.
- The urgent step's requests get their own blocks (engine.core.urgent_schedule): no shared
  block, no hit on a block the paused step is computing, no preemption, so neither step writes
  KV the other reads. The scheduler's queues, block reference counts and fair-share counters
  hold after both steps; the paused step's `update_from_output` runs after the urgent one's.
- Off where that does not hold: CUDA (the host reaches a layer boundary long before the
  device does, and decode steps replay graphs with static buffers), LoRA (the adapters'
  per-step row maps are step-global state), speculative decoding (per-step drafter state),
  and KV tiers (swap and host-tier copies are planned per step).
Metrics: the urgent step is reported as a step of its own (`last_step_num_tokens`), and the
paused step's figures are restored before it resumes (engine.core.step_report).

Wiring: the engine hands over what an urgent step uses (`UrgentStepParts`: the scheduler, the
model whose layer hook pauses a step, a callable running a scheduled step, the step report),
not itself, so this module sits below the engine loop and never imports it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.config import EngineConfig
from engine.core.fair_share import tenant_of
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import RequestUpdate, SchedulerOutput
from engine.core.step_report import StepReport
from engine.core.urgent_schedule import schedule_urgent

logger = logging.getLogger("kvfleet.engine")

# Called on the engine thread between two layers of a paused step, with the index of the layer
# just computed; it may add requests and call `UrgentSteps.run` for them.
LayerPoll = Callable[[int], None]


class PausableModel(Protocol):
    """A model whose forward pass calls `layer_hook` (when set) after each layer."""

    layer_hook: Callable[[int], None] | None


@dataclass(frozen=True)
class UrgentStepParts:
    """What urgent steps use of the engine loop; the engine builds it from its own parts."""

    scheduler: Scheduler
    model: PausableModel
    # The forward pass, sampling and the requests' update of a scheduled step (which never
    # pauses: the hook is off while an urgent step runs).
    run_step: Callable[[SchedulerOutput], list[RequestUpdate]]
    # Shared with the engine: the urgent step reports itself there.
    report: StepReport


def unsupported_reason(config: EngineConfig, device: torch.device) -> str | None:
    """Why urgent steps cannot run on this configuration; None when they can."""
    if config.scheduling_policy != "fair":
        return "they need --scheduling-policy fair"
    if device.type != "cpu":
        return "CPU only (on CUDA the host reaches a layer boundary before the device does)"
    if config.enable_lora:
        return "not with LoRA (the adapters' row maps are per step)"
    if config.speculative_config is not None:
        return "not with speculative decoding"
    if (
        config.preemption_mode != "recompute"
        or config.kv_offloading_size
        or config.num_host_kv_blocks
    ):
        return "not with KV swap space or a host KV tier (copies are planned per step)"
    if config.max_prefill_tokens_per_decode_step:
        # An urgent step is one more forward pass that decoding streams wait for: what the
        # cap (engine.core.decode_prefill_cap) keeps their steps from carrying.
        return "not with --max-prefill-tokens-per-decode-step (a decode engine's default)"
    return None


class UrgentSteps:
    """The engine's urgent-step state: whether it is on, the paused step, the poll."""

    def __init__(self, parts: UrgentStepParts, enabled: bool) -> None:
        self._parts = parts
        self.enabled = enabled
        # Set by the driver (engine.service.async_engine, or a test); None: steps never pause.
        self.poll: LayerPoll | None = None
        self._paused: SchedulerOutput | None = None
        self.num_urgent_steps = 0

    @classmethod
    def from_config(
        cls, config: EngineConfig, device: torch.device, parts: UrgentStepParts
    ) -> UrgentSteps:
        enabled = config.preempt_steps_for_new_tenants
        if enabled:
            reason = unsupported_reason(config, device)
            if reason is not None:
                logger.info("preempt_steps_for_new_tenants is off: %s", reason)
                enabled = False
        return cls(parts, enabled)

    @contextlib.contextmanager
    def pausable(self, out: SchedulerOutput) -> Iterator[None]:
        """Around the forward pass of the step `out`: between its layers, `poll` is called."""
        model = self._parts.model
        if not self.enabled or self.poll is None or self._paused is not None:
            yield
            return
        self._paused = out
        model.layer_hook = self._between_layers
        try:
            yield
        finally:
            model.layer_hook = None
            self._paused = None

    @property
    def paused(self) -> SchedulerOutput | None:
        """The step paused between layers right now (inside `poll` only)."""
        return self._paused

    def qualifying(self, request_ids: Sequence[str]) -> list[str]:
        """Those of these requests, just added while a step is paused, that an urgent step
        serves now: the ones fair share ranks ahead of every prompt chunk of the paused step
        and of every other waiting request. None when the paused step has no prompt chunk (a
        decode-only step is short; `due` looks at them again once it ends)."""
        paused, scheduler = self._paused, self._parts.scheduler
        fair = scheduler.fair_share
        if paused is None or fair is None:
            return []
        chunks = [s.request for s in paused.scheduled if s.num_new_tokens > 1]
        if not chunks:
            return []
        new = set(request_ids)
        bar = min(fair.key(r) for r in [*chunks, *scheduler.waiting] if r.request_id not in new)
        return [
            rid
            for rid in request_ids
            if rid in scheduler.requests and fair.key(scheduler.requests[rid]) < bar
        ]

    def due(self) -> list[str]:
        """Between two steps: the waiting requests an urgent step serves before the next
        ordinary step, which would put them in one step with other tenants' prompt work.

        All prompt work (waiting requests, running requests with more than one token to
        compute) in fair-share order: the waiting requests ahead of the first running prompt
        qualify. When no running prompt is behind them, the work they would share a step with
        is the last-ranked tenant's waiting requests, which stay out. Empty when all prompt
        work is one tenant's (its order is the ordinary steps' own; a request of it that was
        preempted is not raced back in) or when any request is swapped out (waiting requests
        wait, vLLM's rule)."""
        if not self.enabled or self._paused is not None:
            return []
        scheduler = self._parts.scheduler
        fair = scheduler.fair_share
        if fair is None or not scheduler.waiting or scheduler.swapped:
            return []
        prompts = [r for r in scheduler.running if r.num_tokens - r.num_computed_tokens > 1]
        if len({tenant_of(r) for r in [*prompts, *scheduler.waiting]}) < 2:
            return []  # one tenant: its requests keep the ordinary steps' order
        running = {id(r) for r in prompts}
        work = sorted([*prompts, *scheduler.waiting], key=fair.key)
        lead = list(itertools.takewhile(lambda r: id(r) not in running, work))
        if len(lead) == len(work):
            last = tenant_of(work[-1])
            lead = [r for r in lead if tenant_of(r) != last]
        return [r.request_id for r in lead]

    def run(self, request_ids: Sequence[str]) -> list[RequestUpdate]:
        """One complete step of only these just-added (waiting) requests, inside the paused
        step or between two steps; their updates (the first token of those whose prompt fits
        the budget)."""
        scheduler = self._parts.scheduler
        requests = [scheduler.requests[rid] for rid in request_ids]
        out = schedule_urgent(scheduler, requests, self._paused)
        self._parts.report.record(out)  # an urgent step never preempts: no victims
        if not out.scheduled:
            return []
        self.num_urgent_steps += 1
        return self._parts.run_step(out)

    def _between_layers(self, layer: int) -> None:
        poll = self.poll
        if poll is None:
            return
        model, report = self._parts.model, self._parts.report
        saved = dataclasses.replace(report)
        model.layer_hook = None  # the urgent step's own forward pass never pauses
        try:
            poll(layer)
        finally:
            model.layer_hook = self._between_layers
            report.restore(saved)
