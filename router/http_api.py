"""The OpenAI-compatible HTTP API on the router: /v1/completions, /v1/chat/completions,
/v1/models, /health (and Prometheus /metrics).

Role: authenticate (`Authorization: Bearer KEY` or `x-api-key`, as on gRPC), parse the body
(`openai_protocol`), run each prompt through the same `GenerationPipeline` as gRPC, and
answer in OpenAI's JSON or SSE chunk format (`openai_format`).

Invariants:
- Errors are OpenAI error JSON, {"error": {"message", "type", "param", "code"}}, with
  400 (bad request), 401 (API key), 404 (unknown model), 429 (overloaded), 503 (no engine).
- A streamed response starts only once the first token exists, so every failure before
  it (validation, tokenization, routing, an engine refusing) is a proper HTTP status. A
  failure after it is sent as an error chunk, then `data: [DONE]`.
- A client that disconnects (streaming or not) closes the pipeline: engine calls are
  cancelled and their KV blocks freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import propagate, trace
from prometheus_client import make_asgi_app

from kvfleet.errors import HTTP_STATUS_FOR_CODE, status_for_exception
from kvfleet.logs import set_tenant
from kvfleet.tracing import tracer
from kvfleet.v1 import router_pb2
from router.auth import AuthenticationError, Authenticator
from router.merge import merge_tagged
from router.metrics import RouterMetrics
from router.openai_format import Choices, new_id
from router.openai_protocol import ChatCompletionRequest, CompletionRequest
from router.openai_stream import StreamRenderer
from router.pipeline import GenerationPipeline

logger = logging.getLogger(__name__)

Tagged = tuple[int, router_pb2.RouterGenerateResponse]
_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    429: "RateLimitError",
    503: "ServiceUnavailableError",
}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": _ERROR_TYPES.get(status, "InternalServerError"),
                      "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def status_of(exc: BaseException) -> tuple[int, str]:
    if isinstance(exc, AuthenticationError):
        return 401, str(exc)
    code, message, unexpected = status_for_exception(exc)
    if unexpected:
        logger.error("request failed", exc_info=exc)
    return HTTP_STATUS_FOR_CODE.get(code, 500), message


class OpenAIApi:
    def __init__(
        self, pipeline: GenerationPipeline, auth: Authenticator, metrics: RouterMetrics
    ) -> None:
        self._pipeline = pipeline
        self._auth = auth
        self._metrics = metrics

    def app(self) -> FastAPI:
        app = FastAPI(title="kvfleet", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_exception_handler(RequestValidationError, _validation_error)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.mount("/metrics", make_asgi_app(self._metrics.registry))
        return app

    async def health(self) -> Response:
        return Response(status_code=200)

    async def models(self, request: Request) -> Response:
        try:
            self._tenant(request)
        except AuthenticationError as e:
            return error_response(401, str(e))
        names = await self._pipeline.selector.served_models()
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "kvfleet", "root": name,
             "parent": None}
            for name in names
        ]})

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        return await self._serve(body, request, "completion")

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        return await self._serve(body, request, "chat")

    async def _serve(
        self, body: CompletionRequest | ChatCompletionRequest, request: Request, kind: str
    ) -> Response:
        tenant = "unknown"
        span_cm = tracer().start_as_current_span(
            f"POST {request.url.path}", context=propagate.extract(dict(request.headers)),
            kind=trace.SpanKind.SERVER, end_on_exit=False,
        )
        with span_cm as span:
            try:
                tenant = self._tenant(request)
                set_tenant(tenant)
                router_requests = body.to_router_requests()
                model = await self._model(body.model)
                echo = await self._echo_texts(body, router_requests)
                stream = _run_prompts(self._pipeline, router_requests, tenant)
                first = await anext(stream)
            except Exception as exc:
                span.end()
                return self._failed(tenant, exc)
            choices = Choices(n=body.n, kind=kind, logprobs=_wants_logprobs(body))
            prefix = "cmpl" if kind == "completion" else "chatcmpl"
            renderer = StreamRenderer(choices, *new_id(prefix), model, echo)
        if body.stream:
            return StreamingResponse(
                self._sse(span, renderer, first, stream, body.include_usage, tenant),
                media_type="text/event-stream",
            )
        with trace.use_span(span, end_on_exit=True):
            return await self._whole(request, renderer, first, stream, tenant)

    async def _whole(
        self, request: Request, renderer: StreamRenderer, first: Tagged,
        stream: AsyncGenerator[Tagged, None], tenant: str,
    ) -> Response:
        async def fold() -> None:
            async with contextlib.aclosing(stream):
                await renderer.fold(first)
                async for item in stream:
                    await renderer.fold(item)

        work = asyncio.ensure_future(fold())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():  # the client left (or we are cancelled): close engine calls
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
        if work.cancelled():
            self._count(tenant, "499")
            return Response(status_code=499)
        try:
            work.result()
        except Exception as exc:
            return self._failed(tenant, exc)
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
                status, message = status_of(exc)
                code = str(status)
                yield _event(json.loads(bytes(error_response(status, message).body)))
            finally:
                self._count(tenant, code)
            yield "data: [DONE]\n\n"

    def _tenant(self, request: Request) -> str:
        return self._auth.tenant_for(list(request.headers.items()))

    async def _model(self, requested: str | None) -> str:
        """The model name to answer with; routing answers 404 for one no engine serves."""
        if requested:
            return requested
        served = await self._pipeline.selector.served_models()
        return served[0] if served else ""

    async def _echo_texts(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        requests: Sequence[router_pb2.RouterGenerateRequest],
    ) -> list[str]:
        if not isinstance(body, CompletionRequest) or not body.echo:
            return []
        texts = []
        for request in requests:
            if request.WhichOneof("input") == "prompt":
                texts.append(request.prompt)
            else:
                texts.append(await self._pipeline.tokenizer.detokenize(
                    request.prompt_token_ids.ids, body.skip_special_tokens
                ))
        return texts

    def _failed(self, tenant: str, exc: BaseException) -> JSONResponse:
        status, message = status_of(exc)
        self._count(tenant, str(status))
        return error_response(status, message)

    def _count(self, tenant: str, code: str) -> None:
        self._metrics.http_requests.labels(tenant, code).inc()


def _run_prompts(
    pipeline: GenerationPipeline, requests: Sequence[router_pb2.RouterGenerateRequest],
    tenant: str,
) -> AsyncGenerator[Tagged, None]:
    """Every prompt's messages, tagged with the prompt's index, in arrival order."""
    return merge_tagged([pipeline.generate(request, tenant) for request in requests])


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _wants_logprobs(body: CompletionRequest | ChatCompletionRequest) -> bool:
    if isinstance(body, ChatCompletionRequest):
        return body.logprobs
    return body.logprobs is not None


def _event(chunk: dict[str, Any]) -> str:
    return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    problems = []
    param = None
    for error in exc.errors():
        loc = [str(p) for p in error.get("loc", ()) if p != "body"]
        param = param or (".".join(loc) or None)
        problems.append(f"{'.'.join(loc) or 'body'}: {error.get('msg', 'invalid')}")
    return error_response(400, "; ".join(problems) or "invalid request", param)
