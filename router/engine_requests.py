"""A client request's engine requests: validation, ids and one engine request per sample.

Role: the pure part of `router.pipeline` that needs no I/O. `validate_request` is the first
check every request passes (sampling rules and a compiling grammar, before any tokens or
engine work); `engine_samples` turns the admitted, tokenized and routed request into the
engine `GenerateRequest` of each of its n samples.

Invariants:
- The tenant is every engine request's `cache_salt` and `tenant`, so tenants never share
  cached blocks.
- n > 1 becomes n engine requests with `kvfleet.contracts.parallel_sampling`'s ids and
  seeds (seed + i per sample); n == 1 keeps the request id and seed as they are.
- Client request ids need only be unique per client, so a client-given id gets a random
  suffix before it names an engine request; a missing one is made up once.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from kvfleet.contracts.parallel_sampling import child_request_id, child_seed
from kvfleet.contracts.sampling_params import SamplingParams
from kvfleet.contracts.sampling_proto import to_sampling_params
from kvfleet.contracts.structured_grammar import check_compiles
from kvfleet.v1 import common_pb2, engine_pb2, router_pb2

# Engines accept 256 characters; the router appends up to 18 (suffix and sample index).
MAX_REQUEST_ID_LEN = 200


@dataclass(frozen=True)
class EngineFields:
    """What the tenant's policy and routing set in every engine request of one client request."""

    priority: int
    max_tokens: int | None
    weight: float
    lora_id: str  # the LoRA adapter the model named (router.routing.lora_engines), or ""


@dataclass(frozen=True)
class Sample:
    index: int
    engine_request: engine_pb2.GenerateRequest



def validate_request(request: router_pb2.RouterGenerateRequest) -> SamplingParams:
    """The request's sampling parameters; ValueError naming the field for a bad request."""
    if request.WhichOneof("input") is None:
        raise ValueError("input must be set: one of prompt, messages or prompt_token_ids")
    if len(request.request_id) > MAX_REQUEST_ID_LEN:
        raise ValueError(f"request_id must be at most {MAX_REQUEST_ID_LEN} characters")
    params = to_sampling_params(request.sampling_params)
    if params.structured_outputs is not None:
        # Before any engine work: a grammar that does not compile is the client's error.
        check_compiles(params.structured_outputs)
    return params


def traced_prompt(request: router_pb2.RouterGenerateRequest) -> str:
    """The prompt as a span attribute: text, the messages as JSON, or the token ids."""
    kind = request.WhichOneof("input")
    if kind == "prompt":
        return request.prompt
    if kind == "messages":
        return json.dumps([{"role": m.role, "content": m.content}
                           for m in request.messages.messages], ensure_ascii=False)
    return json.dumps(list(request.prompt_token_ids.ids))


def prompt_param(request: router_pb2.RouterGenerateRequest) -> str:
    """The field a prompt-size error names."""
    return "messages" if request.WhichOneof("input") == "messages" else "prompt"


def request_ids(request: router_pb2.RouterGenerateRequest) -> tuple[str, str]:
    """The client's request id (made up when it sent none) and the engines' base id."""
    request_id = request.request_id or uuid.uuid4().hex
    # Client ids need only be unique per client; engines need them unique per engine.
    if request.request_id:
        return request_id, f"{request_id}-{uuid.uuid4().hex[:12]}"
    return request_id, request_id


def engine_samples(
    request: router_pb2.RouterGenerateRequest,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    engine_request_id: str,
    tenant: str,
    fields: EngineFields,
) -> list[Sample]:
    samples = []
    for index in range(params.n):
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(request.sampling_params)
        sampling.ClearField("n")
        if fields.max_tokens is not None:
            sampling.max_tokens = fields.max_tokens
        request_id = engine_request_id
        if params.n > 1:
            request_id = child_request_id(engine_request_id, index)
            seed = child_seed(params.seed, index)
            if seed is not None:
                sampling.seed = seed
        samples.append(Sample(index, engine_pb2.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling_params=sampling,
            priority=fields.priority,
            cache_salt=tenant,
            tenant=tenant,
            fair_share_weight=fields.weight,
            lora_id=fields.lora_id,
        )))
    return samples
