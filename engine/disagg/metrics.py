"""The KV handoff's metrics: bytes sent and received, and how long a transfer takes.

Role: one place that names them (`kvfleet:kv_transfer_sent_bytes_total`,
`kvfleet:kv_transfer_received_bytes_total`, `kvfleet:kv_transfer_seconds`,
`kvfleet:kv_transfers_total{side,outcome}`, `kvfleet:kv_transfer_blocks_total{transport}`),
registered in the engine's registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class TransferMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name"]
        self._model = model_name
        self.sent_bytes = Counter(
            "kvfleet:kv_transfer_sent_bytes", "KV bytes a prefill engine pushed to decode engines",
            labels, registry=registry,
        )
        self.received_bytes = Counter(
            "kvfleet:kv_transfer_received_bytes", "KV bytes a decode engine received",
            labels, registry=registry,
        )
        self.seconds = Histogram(
            "kvfleet:kv_transfer_seconds", "Time to push one request's KV (prefill side)",
            labels, buckets=SECONDS_BUCKETS, registry=registry,
        )
        self.blocks = Counter(
            "kvfleet:kv_transfer_blocks", "KV blocks a prefill engine pushed, by transport",
            ["model_name", "transport"], registry=registry,
        )
        self.transfers = Counter(
            "kvfleet:kv_transfers", "KV transfers by side and outcome",
            ["model_name", "side", "outcome"], registry=registry,
        )

    def sent(self, num_bytes: int, seconds: float, blocks: int, transport: str) -> None:
        self.sent_bytes.labels(self._model).inc(num_bytes)
        self.blocks.labels(self._model, transport).inc(blocks)
        self.seconds.labels(self._model).observe(seconds)
        self.transfers.labels(self._model, "send", "ok").inc()

    def received(self, num_bytes: int) -> None:
        self.received_bytes.labels(self._model).inc(num_bytes)
        self.transfers.labels(self._model, "receive", "ok").inc()

    def failed(self, side: str) -> None:
        self.transfers.labels(self._model, side, "failed").inc()
