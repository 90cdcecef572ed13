"""The engine service's flags for the KV memory tiers (vLLM's names), parsed once at start.

Role: keeps engine/service/server.py's parser short; `add_kv_tier_arguments` declares the
flags, `kv_tier_config(args)` returns the matching `EngineConfig` fields.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvfleet.runtime.arg_types import non_negative_float, non_negative_int


def add_kv_tier_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--preemption-mode", default="recompute",
                       choices=["recompute", "swap", "auto"],
                       help="what happens to a preempted request's KV: recompute it, swap it "
                            "to host memory, or auto (swap victims holding at least "
                            "--swap-min-computed-tokens) (default: %(default)s)")
    group.add_argument("--swap-space", type=non_negative_float, default=4.0,
                       help="host swap space in GiB, allocated only when --preemption-mode "
                            "can swap (default: %(default)s)")
    group.add_argument("--swap-min-computed-tokens", type=non_negative_int, default=256,
                       help="auto mode swaps victims with at least this many computed tokens "
                            "(default: %(default)s)")
    group.add_argument("--kv-offloading-size", type=non_negative_float, default=None,
                       help="host tier of the prefix cache in GiB: evicted cached blocks are "
                            "kept there and reloaded on a hit (default: off)")
    group.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                       help="every layer keeps every KV block; by default the sliding-window "
                            "layers of Gemma 2/3 free the blocks that left their window "
                            "(always off for --role prefill|decode)")


def kv_tier_config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "preemption_mode": args.preemption_mode,
        "swap_space": args.swap_space,
        "swap_min_computed_tokens": args.swap_min_computed_tokens,
        "kv_offloading_size": args.kv_offloading_size,
        "disable_hybrid_kv_cache_manager": args.disable_hybrid_kv_cache_manager,
    }
