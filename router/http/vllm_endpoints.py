"""vLLM's serving endpoints beside the OpenAI API: /tokenize, /detokenize, /version, /ping,
and Prometheus /metrics.

Role: what tools built for vLLM probe (`vllm bench serve` aligns its prompts with
/tokenize and /detokenize; load balancers ping /ping). Text work goes to the tokenizer
service, so /tokenize returns exactly the ids a completion or chat request is routed with;
`max_model_len` is the largest one the live engines serving the model report.

Invariants:
- /tokenize and /detokenize take the API key like /v1/* when the router has a key file
  (vLLM leaves them open; here they spend the shared tokenizer service's time).
- /metrics answers 200 in place (a mounted app would redirect /metrics to /metrics/) and
  leaves out every series with a `tenant` label: this port faces API clients, who must not
  learn other tenants' names; scrapers read the whole registry on the metrics port.
- Errors are OpenAI error JSON (`router.http.errors`): 400 naming the field, 401, 404 for a
  model no engine serves, 503 when no engine is live (no max_model_len to report).
"""

from __future__ import annotations

import copy
import importlib.metadata
from collections.abc import Iterator

import grpc
import grpc.aio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from kvfleet.contracts.errors import InvalidFieldError, NotFoundError, UnavailableError
from router.http.body import read_json
from router.http.errors import error_response, status_of
from router.metrics import RouterMetrics
from router.openai.tokenize_bodies import (
    DetokenizeResponse,
    TokenizeResponse,
    VersionResponse,
    parse_detokenize,
    parse_tokenize,
)
from router.pipeline import GenerationPipeline
from router.tenancy.policy_reload import PolicyStore

DISTRIBUTION = "kvfleet"
TENANT_LABEL = "tenant"


def kvfleet_version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "0+unknown"


class ServingExtras:
    def __init__(
        self, pipeline: GenerationPipeline, policies: PolicyStore, metrics: RouterMetrics
    ) -> None:
        self._pipeline = pipeline
        self._policies = policies
        self._metrics = metrics

    def install(self, app: FastAPI) -> None:
        for method in ("GET", "POST"):  # one route each: one OpenAPI operation id each
            app.add_api_route("/ping", self.ping, methods=[method], name=f"ping_{method}")
        app.add_api_route("/version", self.version, methods=["GET"])
        app.add_api_route("/metrics", self.prometheus, methods=["GET"])
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"])

    async def ping(self) -> Response:
        return Response(status_code=200)

    async def version(self) -> Response:
        return JSONResponse(VersionResponse(version=kvfleet_version()).model_dump())

    async def prometheus(self) -> Response:
        text = generate_latest(WithoutTenantLabels(self._metrics.registry))
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    async def tokenize(self, request: Request) -> Response:
        try:
            self._policies.current.identify(list(request.headers.items()))
            body = parse_tokenize(await read_json(request), self._pipeline.request_limits)
            max_model_len = await self._context_len(body.model)
            response = await self._pipeline.tokenize_for_endpoint(body.tokenizer_request())
        except Exception as exc:
            return _failed(exc)
        ids = list(response.token_ids)
        return JSONResponse(
            TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids).model_dump()
        )

    async def detokenize(self, request: Request) -> Response:
        try:
            self._policies.current.identify(list(request.headers.items()))
            body = parse_detokenize(await read_json(request))
            await self._context_len(body.model)
            # Special tokens kept, as vLLM does: detokenize(tokenize(x)) gives x back.
            text = await self._detokenize(body.tokens)
        except Exception as exc:
            return _failed(exc)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    async def _detokenize(self, tokens: list[int]) -> str:
        try:
            return await self._pipeline.detokenize(tokens, skip_special_tokens=False)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.INVALID_ARGUMENT:
                raise
            # The tokenizer service names its own field (token_ids); the body's is tokens.
            raise InvalidFieldError(
                "tokens", (e.details() or "invalid tokens").replace("token_ids", "tokens")
            ) from None

    async def _context_len(self, model: str | None) -> int:
        """max_model_len of `model` (default: the first served one); 404 / 503 errors."""
        lens = await self._pipeline.served_context_lens()
        if not lens:
            raise UnavailableError("no live engine serves a model")
        if not model:
            return next(iter(lens.values()))
        if model not in lens:
            raise NotFoundError(f"The model `{model}` does not exist; served: {', '.join(lens)}")
        return lens[model]


class WithoutTenantLabels:
    """A view of a registry without the samples that carry a `tenant` label."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self._registry.collect():
            if any(TENANT_LABEL in sample.labels for sample in metric.samples):
                metric = copy.copy(metric)
                metric.samples = [s for s in metric.samples if TENANT_LABEL not in s.labels]
            yield metric


def _failed(exc: BaseException) -> JSONResponse:
    status, message, param = status_of(exc)
    return error_response(status, message, param)
