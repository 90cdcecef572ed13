"""RouterServicer: the kvfleet.v1.Router gRPC service (Generate).

Role: authenticate (the API key in gRPC metadata, against the current tenant policy of
`policy_reload.PolicyStore`) and count; the request itself goes through
`pipeline.GenerationPipeline`, which the HTTP API shares.

Invariants:
- Errors are raised, never set here: the error table (`kvfleet.contracts.errors`, applied by
  `kvfleet.runtime.interceptors`) answers a bad API key UNAUTHENTICATED, ValueError
  INVALID_ARGUMENT, UnavailableError UNAVAILABLE, a tenant over its limits
  RESOURCE_EXHAUSTED with `retry-after` and a RetryInfo detail, and relays downstream statuses.
- A client that goes away closes the pipeline at once, which cancels its engine calls.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator

import grpc
import grpc.aio

from kvfleet.runtime.grpc_server import Service
from kvfleet.runtime.logs import set_tenant
from kvfleet.runtime.metrics import status_label
from kvfleet.v1 import router_pb2, router_pb2_grpc
from router.metrics import RouterMetrics
from router.pipeline import GenerationPipeline
from router.tenancy.policy_reload import PolicyStore

SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(
        self, policies: PolicyStore, pipeline: GenerationPipeline, metrics: RouterMetrics
    ) -> None:
        self._policies = policies
        self._pipeline = pipeline
        self._metrics = metrics

    def as_service(self) -> Service:
        return Service(
            SERVICE_NAME, lambda server: router_pb2_grpc.add_RouterServicer_to_server(self, server)
        )

    async def Generate(
        self, request: router_pb2.RouterGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.RouterGenerateResponse]:
        tenant = ["unknown"]  # known after authentication
        error: BaseException | None = None
        try:
            # aclosing: a client that goes away closes the pipeline now (engine call cancelled).
            async with contextlib.aclosing(self._generate(request, context, tenant)) as stream:
                async for response in stream:
                    yield response
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._metrics.requests.labels(tenant[0], status_label(error, context)).inc()

    async def _generate(
        self,
        request: router_pb2.RouterGenerateRequest,
        context: grpc.aio.ServicerContext,
        tenant_out: list[str],
    ) -> AsyncGenerator[router_pb2.RouterGenerateResponse, None]:
        # AuthenticationError: UNAUTHENTICATED, through the error table.
        tenant = self._policies.current.identify(context.invocation_metadata())
        tenant_out[0] = tenant.name
        set_tenant(tenant.name)
        async with contextlib.aclosing(self._pipeline.generate(request, tenant)) as stream:
            async for response in stream:
                yield response
