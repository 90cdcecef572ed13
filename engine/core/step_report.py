"""What the last step did, for metrics and tracing: its token count and preemption victims.

One `StepReport` is owned by the engine (engine.core.llm_engine, which exposes it as
`last_step_num_tokens` / `last_step_preempted`) and shared with urgent steps
(engine.core.urgent_step), which report their own step in it and put the paused step's
figures back before that step resumes. Read and written on the engine thread only.
Invariant: once a step (ordinary or urgent) has been scheduled, it describes that step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.scheduler_output import SchedulerOutput


@dataclass
class StepReport:
    num_tokens: int = 0
    preempted: list[str] = field(default_factory=list)

    def record(self, out: SchedulerOutput) -> None:
        """Describe the step `out`, just scheduled."""
        self.num_tokens = out.total_num_scheduled_tokens
        self.preempted = [r.request_id for r in out.preempted]

    def restore(self, saved: StepReport) -> None:
        """Describe again the step `saved` (a copy taken before a nested step) described."""
        self.num_tokens, self.preempted = saved.num_tokens, saved.preempted
