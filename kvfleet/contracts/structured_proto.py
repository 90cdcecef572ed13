"""StructuredOutputsParams <-> kvfleet.v1.StructuredOutputs (proto), without importing torch.

Invariants: a `json` schema travels as JSON text with its key order kept (the order of the
generated properties); the proto's presence rules (`optional` strings, non-empty `choice`)
decide which constraint is set, and `StructuredOutputsParams` refuses none or several with an
`InvalidFieldError` naming `structured_outputs`.
"""

from __future__ import annotations

import json

from kvfleet.contracts.structured_outputs import StructuredOutputsParams
from kvfleet.v1 import common_pb2


def to_proto(params: StructuredOutputsParams) -> common_pb2.StructuredOutputs:
    proto = common_pb2.StructuredOutputs(
        json_object=bool(params.json_object),
        choice=params.choice or [],
        disable_any_whitespace=params.disable_any_whitespace,
    )
    if params.json is not None:
        proto.json = params.json if isinstance(params.json, str) else json.dumps(params.json)
    if params.regex is not None:
        proto.regex = params.regex
    if params.grammar is not None:
        proto.grammar = params.grammar
    if params.reasoning_start is not None:
        proto.reasoning_start = params.reasoning_start
    if params.reasoning_end is not None:
        proto.reasoning_end = params.reasoning_end
    return proto


def from_proto(proto: common_pb2.StructuredOutputs) -> StructuredOutputsParams:
    return StructuredOutputsParams(
        json=proto.json if proto.HasField("json") else None,
        json_object=proto.json_object or None,
        regex=proto.regex if proto.HasField("regex") else None,
        choice=list(proto.choice) or None,
        grammar=proto.grammar if proto.HasField("grammar") else None,
        disable_any_whitespace=proto.disable_any_whitespace,
        reasoning_start=proto.reasoning_start if proto.HasField("reasoning_start") else None,
        reasoning_end=proto.reasoning_end if proto.HasField("reasoning_end") else None,
    )
