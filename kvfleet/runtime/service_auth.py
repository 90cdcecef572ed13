"""The router credential: engines serve only callers that present the fleet's shared secret.

Role: `RouterCredentialInterceptor` (engine side) refuses every RPC of the engine's own
service that lacks `x-kvfleet-router-token: SECRET` with UNAUTHENTICATED, before the
request is even decoded; `credential_metadata` is what routers attach to every engine
call (passed per call: no client interceptor sits in the streaming path). The secret comes
from a file (`--router-secret-file` on both sides), which
`kvfleet up` writes into its run directory and the Helm chart mounts from a Secret it
generates once, so neither needs the user's help.

Why a shared secret and not mTLS: it needs no certificate authority or rotation tooling,
works the same in `kvfleet up` and on Kubernetes, and the chart's NetworkPolicy already
keeps engine ports to the router pods; the token is the second lock. Over untrusted
networks, put the fleet behind a mesh that adds mTLS.

Invariants:
- Health checks, reflection and `Engine/GetLoad` stay open: probes, operators and
  dashboards read them, and they carry load figures only, no tenant, prompt or cache data.
- The comparison is constant time (hmac.compare_digest) on SHA-256 digests, so neither
  timing nor length tells a caller how much of a guess was right.
- No secret configured: the interceptor is not installed and the engine logs that it
  accepts anyone (tests and single-machine use); the tenant and cache salt of a request
  are then as trustworthy as the network.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from kvfleet.runtime.interceptors import EXEMPT_METHOD_PREFIXES

CREDENTIAL_HEADER = "x-kvfleet-router-token"
# Methods anyone may call besides health and reflection (see the module docstring).
OPEN_METHODS = ("/kvfleet.v1.Engine/GetLoad",)


def read_secret(path: str | Path) -> str:
    """The secret in `path`, stripped; ValueError when it is empty or short."""
    try:
        secret = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read the router secret: {e}") from e
    if len(secret) < 16:
        raise ValueError(f"{path}: the router secret must be at least 16 characters")
    return secret


def credential_metadata(secret: str | None) -> tuple[tuple[str, str], ...]:
    return () if secret is None else ((CREDENTIAL_HEADER, secret),)


class RouterCredentialInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, secret: str) -> None:
        self._digest = hashlib.sha256(secret.encode("utf-8")).digest()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        if method.startswith(EXEMPT_METHOD_PREFIXES) or method in OPEN_METHODS or self._presented(
            handler_call_details.invocation_metadata
        ):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        return _refusing(handler)

    def _presented(self, metadata: Any) -> bool:
        for name, value in metadata or ():
            if name == CREDENTIAL_HEADER:
                text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
                digest = hashlib.sha256(text.encode("utf-8")).digest()
                return hmac.compare_digest(digest, self._digest)
        return False


_MESSAGE = "engines serve only routers: missing or wrong router credential"


def _refusing(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
    """A handler of the same shape that aborts with UNAUTHENTICATED."""
    if handler is None:
        return None

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _MESSAGE)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _MESSAGE)
        yield  # pragma: no cover - makes this an async generator

    # Raw bytes in: a request that is refused is never decoded.
    if handler.response_streaming:
        maker = (grpc.stream_stream_rpc_method_handler if handler.request_streaming
                 else grpc.unary_stream_rpc_method_handler)
        return maker(streaming)
    maker = (grpc.stream_unary_rpc_method_handler if handler.request_streaming
             else grpc.unary_unary_rpc_method_handler)
    return maker(unary)
