"""Structured-output metrics of the engine (Prometheus, `kvfleet:` prefix, `model_name` label).

Names:
- counter kvfleet:structured_output_requests (`_total` in the exposition): samples whose
  grammar compiled and that entered the scheduler;
- histogram kvfleet:structured_output_compile_seconds: one observation per grammar compiled
  (cache hits are not compiles);
- histogram kvfleet:structured_output_mask_seconds: per engine step with constrained rows,
  the time spent filling and unpacking their token masks.

Threading: `observe` runs on the engine thread (EngineMetrics.on_step), the only thread that
touches the manager.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from engine.structured.manager import StructuredOutputManager

COMPILE_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
MASK_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
)


class StructuredOutputMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry) -> None:
        labels = ["model_name"]
        self._model = model_name
        self.requests = Counter(
            "kvfleet:structured_output_requests",
            "Requests (samples) decoded under a grammar", labels, registry=registry,
        )
        self.compile_seconds = Histogram(
            "kvfleet:structured_output_compile_seconds", "Grammar compile time", labels,
            buckets=COMPILE_BUCKETS, registry=registry,
        )
        self.mask_seconds = Histogram(
            "kvfleet:structured_output_mask_seconds",
            "Token-mask time per engine step with constrained rows", labels,
            buckets=MASK_BUCKETS, registry=registry,
        )
        self._last_requests = 0

    def observe(self, manager: StructuredOutputManager) -> None:
        delta = manager.num_requests - self._last_requests
        if delta > 0:
            self.requests.labels(self._model).inc(delta)
            self._last_requests = manager.num_requests
        compile_s, mask_s = manager.take_observations()
        for seconds in compile_s:
            self.compile_seconds.labels(self._model).observe(seconds)
        if mask_s:  # called once per engine iteration: its fills add up to the step's time
            self.mask_seconds.labels(self._model).observe(sum(mask_s))
