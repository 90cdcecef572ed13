"""The engine service's scheduling-policy flags (vLLM's names where vLLM has them), parsed
once at start into `EngineConfig` fields: the order among tenants, the long-prompt limit and
short-prefill steps (engine.core.long_prefill_limit), and step preemption for new tenants.
EngineConfig validates the values; these only name and type them.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvfleet.runtime.arg_types import non_negative_int


def add_scheduling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scheduling-policy", choices=["fair", "fcfs"], default="fair",
                        help="order among tenants: fair (weighted fair share of tokens, "
                             "docs/tenants.md) or fcfs (priority, then arrival) "
                             "(default: %(default)s)")
    parser.add_argument("--max-long-partial-prefills", type=non_negative_int, default=None,
                        help="while waiting requests follow a prefix a step computes, start at "
                             "most this many long prompts in that step, short ones first "
                             "(vLLM's name; 0: no limit; default: %(default)s)")
    parser.add_argument("--long-prefill-token-threshold", type=non_negative_int, default=0,
                        help="a prompt with more tokens than this left to compute is long "
                             "(0: 4%% of --max-model-len; default: %(default)s)")
    parser.add_argument("--short-prefill-steps", action=argparse.BooleanOptionalAction,
                        default=False, help="a step that starts short prompts starts no long "
                        "one, so their first tokens do not wait for it (default: %(default)s)")
    parser.add_argument("--preempt-steps-for-new-tenants",
                        action=argparse.BooleanOptionalAction, default=True,
                        help="pause a step between layers to serve a newly arrived tenant's "
                             "request in a step of its own (CPU, fair share; docs/tenants.md) "
                             "(default: %(default)s)")


def scheduling_config(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields these flags set."""
    return {
        "scheduling_policy": args.scheduling_policy,
        "max_long_partial_prefills": args.max_long_partial_prefills,
        "long_prefill_token_threshold": args.long_prefill_token_threshold,
        "short_prefill_steps": args.short_prefill_steps,
        "preempt_steps_for_new_tenants": args.preempt_steps_for_new_tenants,
    }
