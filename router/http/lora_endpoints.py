"""vLLM's dynamic LoRA endpoints on the router, fanned out to every live engine.

`POST /v1/load_lora_adapter` {"lora_name", "lora_path"} and `POST /v1/unload_lora_adapter`
{"lora_name"} call LoadLoRAAdapter / UnloadLoRAAdapter on each live engine concurrently
(with the router credential). Engines then publish their adapters to Redis, which is where
`/v1/models` and routing read them (router.routing.lora_engines). Success is vLLM's 200 with a text
body. The first engine refusal (a bad adapter, an unknown name) is answered as 400 with the
engine's message; engines that could not be reached make it 503 naming them.

The router itself loads an adapter on one more engine when every engine serving it is
saturated (router.routing.lora_placement); unloading here also makes it forget those loads.

Invariants: a caller needs a valid API key (as for every API route); the path must be
readable by the engines (it is their file system the adapter is read from).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import grpc.aio
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from kvfleet.contracts.errors import InvalidFieldError, UnavailableError
from kvfleet.v1 import engine_pb2
from router.http.body import decode_json
from router.http.errors import error_response, status_of
from router.pipeline import EngineCall, GenerationPipeline
from router.tenancy.policy_reload import PolicyStore

CALL_TIMEOUT_S = 60.0  # loading reads the adapter from disk on every engine


class LoRAEndpoints:
    def __init__(self, pipeline: GenerationPipeline, policies: PolicyStore) -> None:
        self._pipeline = pipeline
        self._policies = policies

    def install(self, app: FastAPI) -> None:
        app.add_api_route("/v1/load_lora_adapter", self.load, methods=["POST"])
        app.add_api_route("/v1/unload_lora_adapter", self.unload, methods=["POST"])

    async def load(self, request: Request) -> Response:
        def call(body: dict[str, str]) -> EngineCall:
            message = engine_pb2.LoadLoRAAdapterRequest(**body)
            return lambda stub, md: stub.LoadLoRAAdapter(
                message, metadata=md, timeout=CALL_TIMEOUT_S)

        return await self._serve(request, ("lora_name", "lora_path"), call, "added")

    async def unload(self, request: Request) -> Response:
        def call(body: dict[str, str]) -> EngineCall:
            # The router's own loads of it no longer count as serving the adapter.
            self._pipeline.forget_adapter(body["lora_name"])
            message = engine_pb2.UnloadLoRAAdapterRequest(**body)
            return lambda stub, md: stub.UnloadLoRAAdapter(
                message, metadata=md, timeout=CALL_TIMEOUT_S)

        return await self._serve(request, ("lora_name",), call, "removed")

    async def _serve(
        self, request: Request, fields: tuple[str, ...],
        call: Callable[[dict[str, str]], EngineCall], done: str,
    ) -> Response:  # fmt: skip
        try:
            self._policies.current.identify(list(request.headers.items()))
            body = _body(decode_json(await request.body()), fields)
            await self._fan_out(call(body))
        except Exception as exc:
            status, text, param = status_of(exc)
            return error_response(status, text, param)
        return PlainTextResponse(
            f"Success: LoRA adapter '{body['lora_name']}' {done} successfully."
        )

    async def _fan_out(self, call: EngineCall) -> None:
        results = await self._pipeline.call_live_engines(call)
        if not results:
            raise UnavailableError("no live engine to load or unload the adapter on")
        unreachable = []
        for engine_id, result in results:
            if isinstance(result, grpc.aio.AioRpcError):
                if result.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidFieldError(None, result.details() or "invalid adapter")
                unreachable.append(engine_id)
            elif isinstance(result, BaseException):
                raise result
        if unreachable:
            raise UnavailableError(f"engines {', '.join(unreachable)} could not be reached")


def _body(data: Any, fields: tuple[str, ...]) -> dict[str, str]:
    if not isinstance(data, dict):
        raise InvalidFieldError(None, "the request body must be a JSON object")
    body = {}
    for name in fields:
        value = data.get(name)
        if not isinstance(value, str) or not value:
            raise InvalidFieldError(name, f"{name} is required (a non-empty string)")
        body[name] = value
    return body
