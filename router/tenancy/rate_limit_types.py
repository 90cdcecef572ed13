"""What a rate-limit check asks and answers, independent of where the state lives.

Role: `Rates` turns a tenant's `TenantLimits` into GCRA parameters (ms per unit, burst),
`Admission` is the verdict with what OpenAI clients read back (`x-ratelimit-*`,
`Retry-After`), and `RateLimitedError` carries a refusal to the front doors: HTTP 429 with
headers, gRPC RESOURCE_EXHAUSTED with `retry-after` and a google.rpc.RetryInfo detail.

Invariants: units are milliseconds throughout (Redis TIME and the injected test clocks
both give ms); a retry delay of None means "never fits" (the request alone exceeds the
bucket), so no Retry-After is sent for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvfleet.contracts.errors import OverloadedError
from router.tenancy.tenant_policy import TenantLimits


@dataclass(frozen=True)
class Rates:
    request_ms: float = 0.0  # ms per request; 0: no request rate limit
    request_burst: int = 0
    token_ms: float = 0.0  # ms per token; 0: no token rate limit
    token_burst: int = 0
    max_concurrent: int = 0  # 0: no concurrency limit

    @classmethod
    def of(cls, limits: TenantLimits, share: int = 1) -> Rates:
        """GCRA parameters; `share` > 1 splits every limit that many ways (per replica)."""
        request_ms, request_burst = 0.0, 0
        if limits.requests_per_second is not None and limits.burst is not None:
            request_ms = 1000.0 * share / limits.requests_per_second
            request_burst = max(1, math.ceil(limits.burst / share))
        token_ms, token_burst = 0.0, 0
        if limits.tokens_per_minute is not None:
            token_ms = 60_000.0 * share / limits.tokens_per_minute
            token_burst = max(1, math.ceil(limits.tokens_per_minute / share))
        concurrent = 0
        if limits.max_concurrent_requests is not None:
            concurrent = max(1, math.ceil(limits.max_concurrent_requests / share))
        return cls(request_ms, request_burst, token_ms, token_burst, concurrent)

    @property
    def any(self) -> bool:
        return bool(self.request_ms or self.token_ms or self.max_concurrent)


@dataclass(frozen=True)
class Bucket:
    """One limit as clients see it: size, what is left now, ms until it is full again."""

    limit: int
    remaining: int
    reset_ms: int


@dataclass(frozen=True)
class Admission:
    allowed: bool
    refused: str | None = None  # "requests", "tokens" or "concurrency"
    retry_after_ms: int | None = None  # None: this request can never fit
    requests: Bucket | None = None
    tokens: Bucket | None = None
    lease_id: str = ""
    # "redis" (shared by every replica), "local" (the per-replica fallback) or "none".
    backend: str = "none"

    def headers(self) -> dict[str, str]:
        """OpenAI's rate-limit headers, plus Retry-After on a refusal that can succeed."""
        headers: dict[str, str] = {}
        for name, bucket in (("requests", self.requests), ("tokens", self.tokens)):
            if bucket is not None:
                headers[f"x-ratelimit-limit-{name}"] = str(bucket.limit)
                headers[f"x-ratelimit-remaining-{name}"] = str(bucket.remaining)
                headers[f"x-ratelimit-reset-{name}"] = format_duration(bucket.reset_ms)
        if not self.allowed and self.retry_after_ms is not None:
            headers["retry-after"] = str(max(1, math.ceil(self.retry_after_ms / 1000)))
            headers["retry-after-ms"] = str(self.retry_after_ms)
        return headers


class RateLimitedError(OverloadedError):
    """A tenant over one of its limits (HTTP 429, gRPC RESOURCE_EXHAUSTED)."""

    def __init__(self, tenant: str, admission: Admission) -> None:
        self.admission = admission
        super().__init__(_message(tenant, admission))

    def http_headers(self) -> dict[str, str]:
        """Retry-After and OpenAI's `x-ratelimit-*` headers."""
        return self.admission.headers()

    def grpc_trailing_metadata(self) -> list[tuple[str, str | bytes]]:
        """`retry-after` (seconds) and google.rpc.RetryInfo, as gRPC clients read them."""
        retry_ms = self.admission.retry_after_ms
        metadata: list[tuple[str, str | bytes]] = [
            (name, value) for name, value in self.http_headers().items()
            if name != "retry-after-ms"
        ]
        if retry_ms is not None:
            metadata.append(("grpc-status-details-bin", _retry_info_status(self, retry_ms)))
        return metadata


def format_duration(ms: int) -> str:
    """OpenAI's reset format: '1s', '6m0s', '250ms'."""
    if ms < 1000:
        return f"{max(0, ms)}ms"
    seconds = ms / 1000
    minutes, seconds = divmod(seconds, 60)
    text = f"{seconds:.3g}s" if minutes == 0 else f"{int(minutes)}m{seconds:.0f}s"
    return text


def _message(tenant: str, admission: Admission) -> str:
    if admission.refused == "tokens" and admission.retry_after_ms is None:
        limit = admission.tokens.limit if admission.tokens is not None else 0
        return (f"Request too large for tenant {tenant}: its prompt exceeds the tenant's "
                f"tokens per minute ({limit}); send a shorter prompt")
    what = {"requests": "requests per second", "tokens": "tokens per minute",
            "concurrency": "concurrent requests"}.get(admission.refused or "", "rate limit")
    wait = admission.retry_after_ms or 0
    return f"Rate limit reached for tenant {tenant} on {what}; retry in {wait / 1000:.3g}s"


def _retry_info_status(error: RateLimitedError, retry_ms: int) -> bytes:
    from google.protobuf import any_pb2, duration_pb2
    from google.rpc import code_pb2, error_details_pb2, status_pb2

    delay = duration_pb2.Duration(seconds=retry_ms // 1000, nanos=(retry_ms % 1000) * 1_000_000)
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    status = status_pb2.Status(
        code=code_pb2.RESOURCE_EXHAUSTED, message=str(error), details=[detail]
    )
    return status.SerializeToString()
