"""The engine service's LoRA flags (vLLM's names), parsed once at start.

`--enable-lora`, `--max-loras`, `--max-lora-rank`, `--max-cpu-loras` become `EngineConfig`
fields; `--lora-modules name=path ...` names adapters loaded (and validated) at start, before
the engine registers, so a bad one stops the start with its message. `--lora-allowed-dirs`
bounds where adapters may come from (`kvfleet.contracts.adapter_paths`): runtime loads
(LoadLoRAAdapter) and, so that the router can place any adapter on any engine, the start-up
ones too.
"""

from __future__ import annotations

import argparse
from typing import Any

from engine.lora.request import LoRARequest
from kvfleet.contracts.adapter_paths import AdapterRoots, add_allowed_dirs_argument


def parse_lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules entries are name=path, got {text!r}")
    return name, path


def add_lora_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--enable-lora", action="store_true",
                       help="serve LoRA adapters (default: off)")
    group.add_argument("--max-loras", type=int, default=1,
                       help="adapters one step may mix (compute slots) (default: %(default)s)")
    group.add_argument("--max-lora-rank", type=int, default=16,
                       help="largest adapter rank accepted (default: %(default)s)")
    group.add_argument("--max-cpu-loras", type=int, default=None,
                       help="loaded adapters kept in host memory, LRU (default: --max-loras)")
    group.add_argument("--lora-modules", nargs="+", type=parse_lora_module, default=[],
                       metavar="NAME=PATH", help="adapters to serve from the start")
    add_allowed_dirs_argument(group)


def lora_config(args: argparse.Namespace) -> dict[str, Any]:
    if args.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    return {
        "enable_lora": args.enable_lora,
        "max_loras": args.max_loras,
        "max_lora_rank": args.max_lora_rank,
        "max_cpu_loras": args.max_cpu_loras,
    }


def lora_roots(args: argparse.Namespace) -> AdapterRoots:
    """--lora-allowed-dirs, resolved; ValueError for a root that is not a directory."""
    return AdapterRoots.of(args.lora_allowed_dirs)


def lora_modules(args: argparse.Namespace) -> tuple[LoRARequest, ...]:
    roots = lora_roots(args)
    modules = []
    for index, (name, path) in enumerate(args.lora_modules, start=1):
        try:
            path = roots.check_inside(path)
        except ValueError:
            raise ValueError(
                f"--lora-modules {name}={path} is outside --lora-allowed-dirs"
            ) from None
        modules.append(LoRARequest(name, index, path))
    return tuple(modules)
