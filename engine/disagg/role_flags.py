"""The engine service's role-dependent scheduling flag, parsed once at start.

`--max-prefill-tokens-per-decode-step N`: in a step that also decodes, prompts get at most N
tokens between them (engine.core.decode_prefill_cap). Unset, it depends on `--role`: a
decode engine caps prompts at `DECODE_ROLE_DEFAULT` tokens a step, since its streams'
inter-token latency is what it is there for; prefill and colocated (`both`) engines keep
today's behaviour (no cap). 0 turns the cap off on a decode engine.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvfleet.contracts.redis_schema import ROLE_DECODE

# On SmolLM2-135M, one CPU thread: 4 prompt tokens beside 4 decode rows took a step to
# 1.05x its decode-only time, 8 to 1.31x, 32 to 3.0x (docs/disaggregation.md).
DECODE_ROLE_DEFAULT = 4


def add_role_scheduling_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-prefill-tokens-per-decode-step", type=int, default=None, metavar="N",
        help="in a step that also decodes, prompts get at most N tokens between them, so "
             "decoding streams' steps stay near decode size (0: no cap; default: "
             f"{DECODE_ROLE_DEFAULT} with --role decode, no cap otherwise)")


def role_scheduling_config(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig fields; ValueError naming the flag when it is negative."""
    cap = args.max_prefill_tokens_per_decode_step
    if cap is not None and cap < 0:
        raise ValueError(f"--max-prefill-tokens-per-decode-step must be 0 (no cap) or "
                         f"positive, got {cap}")
    if cap is None:
        cap = DECODE_ROLE_DEFAULT if args.role == ROLE_DECODE else 0
    return {"max_prefill_tokens_per_decode_step": cap or None}
