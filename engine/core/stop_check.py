"""Whether a request stops on the token just appended to it (vLLM's order of checks).

Role: the scheduler (engine.core.scheduler) calls `check_stop` after appending each sampled
token. Invariants: running out of room (max_tokens, max_model_len) wins over a stop token on
the same step; a grammar that is complete ends the request on the EOS it allows even under
ignore_eos or min_tokens; a prefill-only request (engine.disagg) hands off after its first
token unless something above stopped it. Sets `stop_reason` when a stop token matched.
"""

from __future__ import annotations

from engine.core.request import Request, RequestStatus


def check_stop(request: Request, token: int, max_model_len: int) -> RequestStatus | None:
    if request.num_output_tokens >= request.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    grammar = request.grammar
    if grammar is not None and grammar.is_terminated and token in request.eos_token_ids:
        # Nothing else could follow: the grammar allowed only EOS.
        return RequestStatus.FINISHED_STOPPED
    params = request.sampling_params
    if request.num_output_tokens < params.min_tokens:
        return None
    if token in params.stop_token_ids:
        request.stop_reason = token
        return RequestStatus.FINISHED_STOPPED
    if not params.ignore_eos and token in request.eos_token_ids:
        return RequestStatus.FINISHED_STOPPED
    if request.prefill_only:
        return RequestStatus.FINISHED_HANDOFF  # a decode engine continues it
    return None
