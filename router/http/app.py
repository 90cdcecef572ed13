"""The OpenAI-compatible HTTP API on the router: /v1/completions, /v1/chat/completions,
/v1/models, /health; vLLM's /tokenize, /detokenize, /version, /ping and Prometheus
/metrics (`router.http.vllm_endpoints`); the OpenAPI document at /openapi.json and /docs
(`router.http.openapi_doc`).

Role: the HTTP front door's parse and render stages around the shared pipeline:
authenticate (`Authorization: Bearer KEY` or `x-api-key`, as on gRPC), parse the body
(`router.openai.requests`), run each prompt through the same `router.pipeline`
`GenerationPipeline` as gRPC (admit, tokenize, route, stream), and render OpenAI's JSON or
SSE chunks (`router.openai.render`, `router.openai.responses`). It asks the pipeline only
through its public methods (`generate`, `check_requests`, `request_limits`,
`served_models`, ...), never through its collaborators.

Invariants:
- Errors are OpenAI error JSON, {"error": {"message", "type", "param", "code"}}, with
  400 (bad request, `param` naming the field), 401 (API key), 404 (unknown model or
  route), 408 / 413 (body too slow / too large, `router.http.body`), 429 (overloaded, or
  the tenant over a rate limit: then with `Retry-After` and OpenAI's `x-ratelimit-*`
  headers), 503 (no engine); see `router.http.errors`. An admitted request of a
  rate-limited tenant carries the `x-ratelimit-*` headers too.
- Every prompt of a request is checked (`router.request_limits`, sampling rules) before any of
  them is tokenized or routed.
- A streamed response starts only once the first token exists, so every failure before
  it (validation, tokenization, routing, an engine refusing) is a proper HTTP status. A
  failure after it is sent as an error chunk, then `data: [DONE]`.
- The client's disconnect is watched from the moment the body is read, streaming or not:
  a client that leaves while its request waits in an engine queue or is being prefilled
  closes the pipeline just as one that leaves mid-stream does. Engine calls are cancelled
  (the engines abort the requests and free their KV blocks) and nothing more is computed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import propagate, trace
from starlette.background import BackgroundTask

from kvfleet.runtime.logs import set_tenant
from kvfleet.runtime.tracing import tracer
from kvfleet.v1 import router_pb2
from router.engines.merge import merge_tagged
from router.http.body import BodyReader, read_json
from router.http.errors import (
    error_body,
    error_response,
    failure_response,
    install_handlers,
    logged_failure,
    status_of,
)
from router.http.lora_endpoints import LoRAEndpoints, RuntimeLoRAConfig
from router.http.openapi_doc import install_openapi
from router.http.vllm_endpoints import ServingExtras, kvfleet_version
from router.metrics import RouterMetrics
from router.openai.chat_output import ChatOutputConfig, ChatOutputPlan, plan_chat_output
from router.openai.render import Choices, new_id
from router.openai.requests import ChatCompletionRequest, CompletionRequest, parse_body
from router.openai.responses import StreamRenderer
from router.pipeline import GenerationPipeline
from router.tenancy.api_keys import AuthenticationError
from router.tenancy.policy_reload import PolicyStore
from router.tenancy.rate_limit_types import Admission
from router.tenancy.tenant_policy import Tenant

logger = logging.getLogger(__name__)

__all__ = ["OpenAIApi", "status_of"]

Tagged = tuple[int, router_pb2.RouterGenerateResponse]
Body = CompletionRequest | ChatCompletionRequest
T = TypeVar("T")
# What a request that has its first message carries on to the response (and its headers).
Started = tuple[StreamRenderer, Tagged, AsyncGenerator[Tagged, None], dict[str, str]]


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was complete."""


class OpenAIApi:
    def __init__(
        self, pipeline: GenerationPipeline, policies: PolicyStore, metrics: RouterMetrics,
        chat_output: ChatOutputConfig | None = None,
        runtime_lora: RuntimeLoRAConfig | None = None,
    ) -> None:
        self._pipeline = pipeline
        self._policies = policies
        self._metrics = metrics
        self._chat_output = chat_output or ChatOutputConfig()
        self._runtime_lora = runtime_lora or RuntimeLoRAConfig()

    def app(self) -> FastAPI:
        app = FastAPI(
            title="kvfleet", version=kvfleet_version(),
            description="kvfleet's router: OpenAI-compatible API plus vLLM's serving "
                        "endpoints. Errors are OpenAI error JSON.",
            docs_url="/docs", redoc_url=None, openapi_url="/openapi.json",
            # The handler owns the request's server span (it carries the tenant and parents
            # the engine calls); FastAPI's native one would be a second "POST /v1/..." span.
            telemetry={"tracing": False, "operation_spans": False},
        )
        install_handlers(app)
        app.add_middleware(BodyReader, limits=self._pipeline.request_limits)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        ServingExtras(self._pipeline, self._policies, self._metrics).install(app)
        if self._runtime_lora.allow_updates:  # else unknown routes (404), as in vLLM
            LoRAEndpoints(self._pipeline, self._policies, self._runtime_lora.roots).install(app)
        install_openapi(app)
        return app

    async def health(self) -> Response:
        return Response(status_code=200)

    async def models(self, request: Request) -> Response:
        try:
            self._tenant(request)
        except AuthenticationError as e:
            return error_response(*status_of(e))
        names = await self._pipeline.served_models()
        adapters = await self._pipeline.served_adapters()
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "kvfleet", "root": name,
             "parent": None}
            for name in names
        ] + [  # LoRA adapters, as vLLM lists them: their base model is the parent
            {"id": name, "object": "model", "created": 0, "owned_by": "kvfleet", "root": name,
             "parent": parent}
            for name, parent in adapters.items() if name not in names
        ]})

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, CompletionRequest, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, ChatCompletionRequest, "chat")

    async def _serve(self, request: Request, cls: type[Body], kind: str) -> Response:
        tenant = "unknown"
        span_cm = tracer().start_as_current_span(
            f"POST {request.url.path}", context=propagate.extract(dict(request.headers)),
            kind=trace.SpanKind.SERVER, end_on_exit=False,
        )
        with span_cm as span:
            try:
                who = self._tenant(request)
                tenant = who.name
                set_tenant(tenant)
                # Here, not only in the pipeline: the span this handler owns carries its
                # tenant whatever context the pipeline's first step later runs in.
                span.set_attribute("kvfleet.tenant", tenant)
                body = parse_body(cls, await read_json(request),
                                  self._pipeline.request_limits)
                router_requests, plan = self._checked(body, who)
                started = await until_disconnected(
                    request, self._start(body, router_requests, who, kind, plan)
                )
            except ClientDisconnected:
                span.end()
                self._count(tenant, "499")
                return Response(status_code=499)
            except Exception as exc:
                span.end()
                return self._failed(tenant, exc)
        renderer, first, stream, headers = started
        if body.stream:
            # The background task closes the stream even if the response never iterated
            # it (the client left as the first message arrived).
            return StreamingResponse(
                self._sse(span, renderer, first, stream, body.include_usage, tenant),
                media_type="text/event-stream", background=BackgroundTask(stream.aclose),
                headers=headers,
            )
        with trace.use_span(span, end_on_exit=True):
            response = await self._whole(request, renderer, first, stream, tenant)
            if response.status_code == 200:
                response.headers.update(headers)
            return response

    def _checked(
        self, body: Body, tenant: Tenant
    ) -> tuple[list[router_pb2.RouterGenerateRequest], ChatOutputPlan | None]:
        """The body's router requests, every one checked before any is started, and how a
        chat's output is read (tool calls, reasoning)."""
        requests = body.to_router_requests()
        plan = None
        if isinstance(body, ChatCompletionRequest):
            plan = plan_chat_output(
                body.tools, body.checked_tool_choice(), body.parallel_tool_calls is not False,
                self._chat_output, requests,
            )
        self._pipeline.check_requests(requests, tenant, body.n)
        return requests, plan

    async def _start(
        self, body: Body, requests: Sequence[router_pb2.RouterGenerateRequest], tenant: Tenant,
        kind: str, plan: ChatOutputPlan | None = None,
    ) -> Started:
        """Run the prompts up to their first message (tokenize, route, queue, prefill)."""
        model = await self._model(body.model)
        echo = await self._echo_texts(body, requests)
        admissions: list[Admission] = []
        stream = _run_prompts(self._pipeline, requests, tenant, admissions.append)
        first = await anext(stream)
        # The latest verdict has the freshest remaining counts.
        headers = admissions[-1].headers() if admissions else {}
        choices = Choices(n=body.n, kind=kind, logprobs=_wants_logprobs(body))
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        renderer = StreamRenderer(choices, *new_id(prefix), model, echo, plan)
        return renderer, first, stream, headers

    async def _whole(
        self, request: Request, renderer: StreamRenderer, first: Tagged,
        stream: AsyncGenerator[Tagged, None], tenant: str,
    ) -> Response:
        async def fold() -> None:
            async with contextlib.aclosing(stream):
                await renderer.fold(first)
                async for item in stream:
                    await renderer.fold(item)

        try:
            await until_disconnected(request, fold())
        except ClientDisconnected:
            self._count(tenant, "499")
            return Response(status_code=499)
        except Exception as exc:
            return self._failed(tenant, exc)
        finally:
            await stream.aclose()  # a no-op unless fold() never got to run
        self._count(tenant, "200")
        return JSONResponse(renderer.body())

    async def _sse(
        self, span: trace.Span, renderer: StreamRenderer, first: Tagged,
        stream: AsyncGenerator[Tagged, None], include_usage: bool, tenant: str,
    ) -> AsyncIterator[str]:
        code = "200"
        with trace.use_span(span, end_on_exit=True):
            try:
                async with contextlib.aclosing(stream):
                    for chunk in await renderer.chunks(first):
                        yield _event(chunk)
                    async for item in stream:
                        for chunk in await renderer.chunks(item):
                            yield _event(chunk)
                if include_usage:
                    yield _event(renderer.usage_chunk())
            except (asyncio.CancelledError, GeneratorExit):
                code = "499"
                raise
            except Exception as exc:
                status, message, param = status_of(exc)
                code = str(status)
                yield _event(error_body(status, message, param))
            finally:
                self._count(tenant, code)
            yield "data: [DONE]\n\n"

    def _tenant(self, request: Request) -> Tenant:
        return self._policies.current.identify(list(request.headers.items()))

    async def _model(self, requested: str | None) -> str:
        """The model name to answer with; routing answers 404 for one no engine serves."""
        if requested:
            return requested
        served = await self._pipeline.served_models()
        return served[0] if served else ""

    async def _echo_texts(
        self,
        body: Body,
        requests: Sequence[router_pb2.RouterGenerateRequest],
    ) -> list[str]:
        if not isinstance(body, CompletionRequest) or not body.echo:
            return []
        texts = []
        for request in requests:
            if request.WhichOneof("input") == "prompt":
                texts.append(request.prompt)
            else:
                texts.append(await self._pipeline.detokenize(
                    request.prompt_token_ids.ids, body.skip_special_tokens
                ))
        return texts

    def _failed(self, tenant: str, exc: BaseException) -> JSONResponse:
        failure = logged_failure(exc)  # status, body and headers: kvfleet.contracts.errors
        self._count(tenant, str(failure.http_status))
        return failure_response(failure)

    def _count(self, tenant: str, code: str) -> None:
        self._metrics.http_requests.labels(tenant, code).inc()


def _run_prompts(
    pipeline: GenerationPipeline, requests: Sequence[router_pb2.RouterGenerateRequest],
    tenant: Tenant, on_admitted: Callable[[Admission], None],
) -> AsyncGenerator[Tagged, None]:
    """Every prompt's messages, tagged with the prompt's index, in arrival order."""
    return merge_tagged(
        [pipeline.generate(request, tenant, on_admitted) for request in requests]
    )


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, unless the client disconnects first: then `work` is cancelled (and
    with it every engine call it opened) and ClientDisconnected is raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():  # the client left (or we are cancelled): stop the work
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected
    return task.result()


async def _disconnected(request: Request) -> None:
    # The body has been read (router.http.body), so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _wants_logprobs(body: Body) -> bool:
    if isinstance(body, ChatCompletionRequest):
        return body.logprobs
    return body.logprobs is not None


def _event(chunk: dict[str, Any]) -> str:
    return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
