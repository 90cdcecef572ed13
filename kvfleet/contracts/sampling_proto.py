"""kvfleet.v1.SamplingParams (proto) -> engine `SamplingParams`, without importing torch.

Both the engine service and the router use it, so a request the engine would refuse is
refused by the router before it tokenizes or routes anything, with the same message.

Invariant: proto3 `optional` presence is respected: an unset field takes the default written
in common.proto (max_tokens unset = up to the remaining context), an explicit zero stays zero.
Every problem is an `InvalidFieldError` (a ValueError) naming the field.
"""

from __future__ import annotations

from kvfleet.contracts.errors import InvalidFieldError
from kvfleet.contracts.sampling_params import SamplingParams
from kvfleet.contracts.structured_proto import from_proto
from kvfleet.v1 import common_pb2


def to_sampling_params(proto: common_pb2.SamplingParams) -> SamplingParams:
    top_k = -1
    if proto.HasField("top_k"):
        if proto.top_k < 1:
            raise InvalidFieldError(
                "top_k", f"top_k must be at least 1 when set (unset disables it), got {proto.top_k}"
            )
        top_k = proto.top_k
    return SamplingParams(
        n=proto.n if proto.HasField("n") else 1,
        temperature=proto.temperature if proto.HasField("temperature") else 1.0,
        top_p=proto.top_p if proto.HasField("top_p") else 1.0,
        top_k=top_k,
        min_p=proto.min_p,
        seed=proto.seed if proto.HasField("seed") else None,
        max_tokens=proto.max_tokens if proto.HasField("max_tokens") else None,
        min_tokens=proto.min_tokens,
        stop_token_ids=list(proto.stop_token_ids),
        ignore_eos=proto.ignore_eos,
        skip_special_tokens=(
            proto.skip_special_tokens if proto.HasField("skip_special_tokens") else True
        ),
        presence_penalty=proto.presence_penalty,
        frequency_penalty=proto.frequency_penalty,
        repetition_penalty=(
            proto.repetition_penalty if proto.HasField("repetition_penalty") else 1.0
        ),
        logprobs=_logprobs(proto),
        prompt_logprobs=proto.prompt_logprobs if proto.HasField("prompt_logprobs") else None,
        stop=list(proto.stop),
        include_stop_str_in_output=proto.include_stop_str_in_output,
        structured_outputs=(
            from_proto(proto.structured_outputs) if proto.HasField("structured_outputs") else None
        ),
    )


def _logprobs(proto: common_pb2.SamplingParams) -> int | None:
    # OpenAI chat's top_logprobs is the same k; a client setting both must agree.
    both = proto.HasField("logprobs") and proto.HasField("top_logprobs")
    if both and proto.logprobs != proto.top_logprobs:
        raise InvalidFieldError(
            "logprobs",
            f"logprobs ({proto.logprobs}) and top_logprobs ({proto.top_logprobs}) disagree",
        )
    if proto.HasField("logprobs"):
        return proto.logprobs
    if proto.HasField("top_logprobs"):
        return proto.top_logprobs
    return None
