"""vLLM's dynamic LoRA endpoints on the router, fanned out to every live engine.

They exist only when the operator enables runtime adapter updates (`RuntimeLoRAConfig`,
the router's `--allow-runtime-lora-updating`, vLLM's switch); otherwise both paths are
unknown routes (404), as in vLLM.

`POST /v1/load_lora_adapter` {"lora_name", "lora_path"} and `POST /v1/unload_lora_adapter`
{"lora_name"} call LoadLoRAAdapter / UnloadLoRAAdapter on each live engine concurrently
(with the router credential). Engines then publish their adapters to Redis, which is where
`/v1/models` and routing read them (router.routing.lora_engines). Success is vLLM's 200 with a text
body. The first engine refusal (a bad adapter, an unknown name) is answered as 400 with the
engine's message; engines that could not be reached make it 503 naming them.

The router itself loads an adapter on one more engine when every engine serving it is
saturated (router.routing.lora_placement); unloading here also makes it forget those loads.

Invariants:
- A caller needs a valid API key (401), then must be an admin (`admin: true` in the tenant
  policy, on its tenant or its key): others get 403 before the body is read or any engine is
  contacted.
- `lora_path` must resolve inside `--lora-allowed-dirs` (`kvfleet.contracts.adapter_paths`);
  the engines check again, with the files (it is their file system the adapter is read from).
  Outside, missing and unreadable are one message.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from kvfleet.contracts.adapter_paths import AdapterRoots, add_allowed_dirs_argument
from kvfleet.contracts.errors import InvalidFieldError, PermissionDeniedError, UnavailableError
from kvfleet.v1 import engine_pb2
from router.http.body import read_json
from router.http.errors import error_response, status_of
from router.pipeline import EngineCall, GenerationPipeline
from router.tenancy.policy_reload import PolicyStore

CALL_TIMEOUT_S = 60.0  # loading reads the adapter from disk on every engine
NOT_ADMIN_MESSAGE = "only admin API keys may load or unload LoRA adapters"


@dataclass(frozen=True)
class RuntimeLoRAConfig:
    """Whether the fleet's adapters may change at run time, and from where (start-up flags)."""

    allow_updates: bool = False
    roots: AdapterRoots = field(default_factory=AdapterRoots)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RuntimeLoRAConfig:
        """ValueError when updates are on without roots, or a root is not a directory."""
        # The adapters are on the engines' file system, which the router may not mount.
        roots = AdapterRoots.of(args.lora_allowed_dirs, must_exist=False)
        if args.allow_runtime_lora_updating and not roots.configured:
            raise ValueError("--allow-runtime-lora-updating needs --lora-allowed-dirs (the "
                             "directories adapters may be loaded from)")
        return cls(args.allow_runtime_lora_updating, roots)


def add_runtime_lora_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allow-runtime-lora-updating", action="store_true",
        help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter to admin API keys "
             "(vLLM's switch; needs --lora-allowed-dirs; default: off, the routes are 404)",
    )
    add_allowed_dirs_argument(parser)


class LoRAEndpoints:
    def __init__(
        self, pipeline: GenerationPipeline, policies: PolicyStore, roots: AdapterRoots
    ) -> None:
        self._pipeline = pipeline
        self._policies = policies
        self._roots = roots

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
            caller = self._policies.current.identify(list(request.headers.items()))
            if not caller.admin:
                raise PermissionDeniedError(NOT_ADMIN_MESSAGE)
            body = _body(await read_json(request), fields)
            if "lora_path" in body:
                body["lora_path"] = self._roots.check_inside(body["lora_path"])
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
