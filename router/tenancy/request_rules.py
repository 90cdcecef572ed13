"""A tenant's per-request rules, applied before anything is tokenized or routed.

Role: `TenantRules.of(request, tenant, params)` checks and settles what the tenant policy
says about one request: the model (allowed ones only; an unnamed model becomes the
tenant's first allowed one), the priority (clamped to the tenant's range; unset takes the
tenant's default), prompts x n (`max_choices`) and max_tokens (at most the tenant's cap;
unset takes the tenant's default, or the cap, bounded by what the context leaves).

Invariants:
- Refusals are the usual request errors: a max_tokens over the cap or too many choices is
  a 400 naming the field (INVALID_ARGUMENT), a model the tenant may not use is a 404 (as
  OpenAI answers for a model a key cannot see).
- An explicit priority is clamped, never refused: a client asking for more than it may have
  gets the most it may have.
- An unset max_tokens is never refused because of the tenant's default or cap: it becomes
  min(default or cap, max_model_len - prompt tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.contracts.errors import InvalidFieldError, NotFoundError
from kvfleet.contracts.sampling_params import SamplingParams
from kvfleet.v1 import router_pb2
from router.tenancy.tenant_policy import Tenant


@dataclass(frozen=True)
class TenantRules:
    model: str
    priority: int
    # What an unset max_tokens becomes (before the context bound); None: vLLM's rule.
    implicit_max_tokens: int | None

    @classmethod
    def of(cls, request: router_pb2.RouterGenerateRequest, tenant: Tenant,
           params: SamplingParams) -> TenantRules:
        limits = tenant.limits
        check_choices(tenant, params.n, 1)
        model = request.model
        if limits.models is not None:
            if not model:
                model = sorted(limits.models)[0]
            elif model not in limits.models:
                raise NotFoundError(f"The model `{model}` does not exist or tenant "
                                    f"{tenant.name} may not use it")
        cap = limits.max_tokens
        if params.max_tokens is not None and cap is not None and params.max_tokens > cap:
            raise InvalidFieldError("max_tokens", f"max_tokens is {params.max_tokens}; "
                                    f"at most {cap} are allowed for tenant {tenant.name}")
        implicit = None
        if params.max_tokens is None:
            implicit = limits.default_max_tokens if limits.default_max_tokens else cap
        requested = request.priority if request.HasField("priority") else None
        return cls(model, limits.priority.clamp(requested), implicit)

    def max_tokens(self, explicit: int | None, num_prompt_tokens: int,
                   max_model_len: int | None) -> int | None:
        """The max_tokens to send the engine (None: the engine's own rule)."""
        if explicit is not None or self.implicit_max_tokens is None:
            return explicit
        if max_model_len is None:
            return self.implicit_max_tokens
        return max(1, min(self.implicit_max_tokens, max_model_len - num_prompt_tokens))


def check_choices(tenant: Tenant, n: int, num_prompts: int) -> None:
    """The tenant's cap on prompts x n (the router's --max-choices applies as well)."""
    cap = tenant.limits.max_choices
    if cap is not None and n * num_prompts > cap:
        what = f"n ({n}) x prompts ({num_prompts})" if num_prompts > 1 else f"n ({n})"
        raise InvalidFieldError(
            "n" if num_prompts == 1 else "prompt",
            f"{what} asks for {n * num_prompts} completions; at most {cap} are allowed per "
            f"request for tenant {tenant.name}",
        )
