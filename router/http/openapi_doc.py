"""The router HTTP API's OpenAPI 3.1 document, served at /openapi.json (Swagger UI at /docs).

Role: FastAPI lists the routes, but the handlers read their bodies themselves (to answer
every problem as OpenAI error JSON), so FastAPI cannot see what they accept. This module
adds it: each operation's request body is the JSON schema of the very pydantic model that
parses it, its answers are the statuses the handler really gives (errors in OpenAI's
shape), and the key schemes are the ones `router.tenancy.api_keys` reads.

Invariant: every route the app serves is described here; an undescribed one makes
building the document fail (and a test with it), so the document cannot fall behind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from router.http.errors import ERROR_TYPES
from router.openai.requests import ChatCompletionRequest, CompletionRequest
from router.openai.tokenize_bodies import (
    DetokenizeBody,
    DetokenizeResponse,
    TokenizeChatBody,
    TokenizeCompletionBody,
    TokenizeResponse,
    VersionResponse,
)

REF = "#/components/schemas/{model}"
# Statuses of the error answers, by what the operation does.
BODY_ERRORS = (400, 408, 413)
GENERATION_ERRORS = (*BODY_ERRORS, 401, 404, 429, 503)
TOKENIZER_ERRORS = (*BODY_ERRORS, 401, 404, 503)
SECURITY_SCHEMES = {
    "bearer": {"type": "http", "scheme": "bearer",
               "description": "`Authorization: Bearer KEY` (the key names the tenant)"},
    "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
}
# Either key header, or none when the router runs without a key file.
SECURITY: list[dict[str, list[str]]] = [{"bearer": []}, {"apiKey": []}, {}]
MODELS: tuple[type[BaseModel], ...] = (
    CompletionRequest, ChatCompletionRequest, TokenizeCompletionBody, TokenizeChatBody,
    DetokenizeBody, TokenizeResponse, DetokenizeResponse, VersionResponse,
)

_ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string", "examples": sorted(ERROR_TYPES.values())},
            "param": {"type": ["string", "null"],
                      "description": "the field at fault, e.g. `max_tokens`"},
            "code": {"type": "integer"},
        },
    }},
}
_USAGE = {
    "type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
        "prompt_tokens_details": {"type": ["object", "null"],
                                  "properties": {"cached_tokens": {"type": "integer"}}},
    },
}


def _response_object(kind: str, choice: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object", "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": {"type": "string"}, "object": {"const": kind},
            "created": {"type": "integer"}, "model": {"type": "string"},
            "choices": {"type": "array", "items": choice},
            "usage": {"$ref": REF.format(model="Usage")},
        },
    }


_FINISH = {"type": ["string", "null"], "enum": ["stop", "length", "abort", None]}
_HAND_SCHEMAS: dict[str, Any] = {
    "ErrorResponse": _ERROR_SCHEMA,
    "Usage": _USAGE,
    "Completion": _response_object("text_completion", {
        "type": "object", "required": ["index", "text", "finish_reason"],
        "properties": {"index": {"type": "integer"}, "text": {"type": "string"},
                       "finish_reason": _FINISH, "logprobs": {"type": ["object", "null"]},
                       "stop_reason": {"type": ["string", "integer", "null"]}},
    }),
    "ChatCompletion": _response_object("chat.completion", {
        "type": "object", "required": ["index", "message", "finish_reason"],
        "properties": {"index": {"type": "integer"}, "finish_reason": _FINISH,
                       "message": {"type": "object", "properties": {
                           "role": {"const": "assistant"}, "content": {"type": "string"}}},
                       "logprobs": {"type": ["object", "null"]},
                       "stop_reason": {"type": ["string", "integer", "null"]}},
    }),
    "ModelList": {
        "type": "object", "required": ["object", "data"],
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {
            "type": "object", "required": ["id", "object"],
            "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                           "created": {"type": "integer"}, "owned_by": {"type": "string"},
                           "root": {"type": "string"},
                           # A LoRA adapter's base model; null for a base model.
                           "parent": {"type": ["string", "null"]}},
        }}},
    },
    "LoadLoRAAdapterBody": {
        "type": "object", "required": ["lora_name", "lora_path"],
        "properties": {"lora_name": {"type": "string", "minLength": 1},
                       "lora_path": {"type": "string", "minLength": 1,
                                     "description": "PEFT directory on the engines' machines"}},
    },
    "UnloadLoRAAdapterBody": {
        "type": "object", "required": ["lora_name"],
        "properties": {"lora_name": {"type": "string", "minLength": 1}},
    },
}


@dataclass(frozen=True)
class Operation:
    summary: str
    # Request body schemas (several: any one of them), by component name.
    body: tuple[str, ...] = ()
    # 200's content: media type -> schema.
    ok: tuple[tuple[str, dict[str, Any]], ...] = ()
    errors: tuple[int, ...] = ()
    auth: bool = False
    description: str = ""


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": REF.format(model=name)}


def _refused(model: type[CompletionRequest] | type[ChatCompletionRequest]) -> str:
    names = ", ".join(f"`{name}`" for name in sorted(model.UNSUPPORTED))
    return (f"Refused with 400 (naming the field) unless set to their no-op value: {names}. "
            "Other unknown fields are ignored.")


_SSE = ("text/event-stream", {"type": "string", "description":
        "with `stream: true`: `data: {chunk}` events, then `data: [DONE]`"})
OPERATIONS: dict[tuple[str, str], Operation] = {
    ("/v1/completions", "post"): Operation(
        "Text completion (OpenAI)", ("CompletionRequest",),
        (("application/json", _ref("Completion")), _SSE), GENERATION_ERRORS, True,
        _refused(CompletionRequest)),
    ("/v1/chat/completions", "post"): Operation(
        "Chat completion (OpenAI)", ("ChatCompletionRequest",),
        (("application/json", _ref("ChatCompletion")), _SSE), GENERATION_ERRORS, True,
        _refused(ChatCompletionRequest)),
    ("/v1/models", "get"): Operation(
        "Models the live engines serve", ok=(("application/json", _ref("ModelList")),),
        errors=(401,), auth=True),
    ("/tokenize", "post"): Operation(
        "Text or chat messages to token ids, as generation requests are tokenized (vLLM)",
        ("TokenizeCompletionBody", "TokenizeChatBody"),
        (("application/json", _ref("TokenizeResponse")),), TOKENIZER_ERRORS, True),
    ("/detokenize", "post"): Operation(
        "Token ids to text, special tokens kept (vLLM)", ("DetokenizeBody",),
        (("application/json", _ref("DetokenizeResponse")),), TOKENIZER_ERRORS, True),
    ("/v1/load_lora_adapter", "post"): Operation(
        "Load a LoRA adapter on every live engine (vLLM)", ("LoadLoRAAdapterBody",),
        (("text/plain", {"type": "string"}),), (400, 401, 503), True),
    ("/v1/unload_lora_adapter", "post"): Operation(
        "Unload a LoRA adapter from every live engine; running requests finish (vLLM)",
        ("UnloadLoRAAdapterBody",), (("text/plain", {"type": "string"}),), (400, 401, 503),
        True),
    ("/version", "get"): Operation(
        "kvfleet's version", ok=(("application/json", _ref("VersionResponse")),)),
    ("/health", "get"): Operation("200 while the router serves"),
    ("/ping", "get"): Operation("200 while the router serves (SageMaker's probe)"),
    ("/ping", "post"): Operation("200 while the router serves (SageMaker's probe)"),
    ("/metrics", "get"): Operation(
        "Prometheus metrics of this router", ok=(("text/plain", {"type": "string"}),)),
}


def build_openapi(app: FastAPI) -> dict[str, Any]:
    """The document for `app`'s routes; KeyError for a route OPERATIONS does not describe."""
    doc = get_openapi(title=app.title, version=app.version, description=app.description,
                      routes=app.routes)
    _, defs = models_json_schema([(m, "validation") for m in MODELS], ref_template=REF)
    components = doc.setdefault("components", {})
    components["schemas"] = {**defs.get("$defs", {}), **_HAND_SCHEMAS}
    components["securitySchemes"] = SECURITY_SCHEMES
    for path, item in doc.get("paths", {}).items():
        for method, operation in item.items():
            spec = OPERATIONS.get((path, method))
            if spec is None:
                raise KeyError(f"{method.upper()} {path} is not described in OPERATIONS")
            _describe(operation, spec)
    return doc


def install_openapi(app: FastAPI) -> None:
    """Serve `build_openapi(app)` (built once, on the first request) at app.openapi_url."""
    cache: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        if not cache:
            cache.update(build_openapi(app))
        return cache

    setattr(app, "openapi", openapi)  # FastAPI's documented override  # noqa: B010


def _describe(operation: dict[str, Any], spec: Operation) -> None:
    operation["summary"] = spec.summary
    if spec.description:
        operation["description"] = spec.description
    if spec.body:
        schemas = [_ref(name) for name in spec.body]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        operation["requestBody"] = {
            "required": True, "content": {"application/json": {"schema": schema}},
        }
    ok: dict[str, Any] = {"description": "OK"}
    if spec.ok:
        ok["content"] = {media: {"schema": schema} for media, schema in spec.ok}
    responses: dict[str, Any] = {"200": ok}
    for status in sorted(spec.errors):
        responses[str(status)] = {
            "description": ERROR_TYPES[status],
            "content": {"application/json": {"schema": _ref("ErrorResponse")}},
        }
    operation["responses"] = responses
    if spec.auth:
        operation["security"] = SECURITY

