"""`make chaos`: every fault scenario under load on a tiny-model fleet, as one table.

Run as `python -m tests.faults.chaos [--concurrency N] [--log-dir DIR]`. The same scenarios
run (at lighter load, with assertions) in `tests/faults/test_faults.py`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvfleet.fleet import Fleet, FleetConfig
from tests.faults.load import LoadConfig
from tests.faults.scenarios import (
    ScenarioResult,
    burst,
    engine_kill9,
    engine_sigstop,
    redis_restart,
    router_sigterm,
    tokenizer_restart,
    vanishing_clients,
)
from tests.fixtures.fleets import long_context_copy

# Deadlines short enough for a test, long enough for a loaded 2-core machine.
ROUTER_FAULT_ARGS = (
    "--first-token-timeout", "3",
    "--stream-stall-timeout", "3",
)
ENGINE_FAULT_ARGS = ("--num-kv-blocks", "512", "--max-num-seqs", "32")

Scenario = Callable[[Fleet, LoadConfig], ScenarioResult]
# router_sigterm restarts the router on a new port: it goes last.
SCENARIOS: tuple[Scenario, ...] = (
    engine_kill9, engine_sigstop, redis_restart, tokenizer_restart, burst, vanishing_clients,
    router_sigterm,
)


# The fault fleet's model: the tiny model with a longer context, so an abandoned request can
# ask for more tokens than it could generate before its cancellation lands (no timing race).
FAULT_CONTEXT = 8192


# The fault fleet's FleetConfig fields, but for its model and log directory (the test suite's
# fleet_options in tests/faults/conftest.py pass the same).
FAULT_FLEET: dict[str, Any] = {
    "num_engines": 2, "metrics": True, "engine_args": ENGINE_FAULT_ARGS,
    "router_args": ROUTER_FAULT_ARGS, "engine_threads": 1,
}


def fault_fleet_config(model_dir: Path, log_dir: Path) -> FleetConfig:
    return FleetConfig(model_dir=model_dir, log_dir=log_dir, **FAULT_FLEET)


def format_table(results: list[ScenarioResult]) -> str:
    rows = [result.row() for result in results]
    headers = list(rows[0])
    widths = [max(len(h), *(len(str(r[h])) for r in rows)) for h in headers]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(row[h]).ljust(w)
                                        for h, w in zip(headers, widths, strict=True)) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--log-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    from tests.fixtures.tiny_model import build_tiny_model_dir

    with tempfile.TemporaryDirectory(prefix="kvfleet-chaos-") as tmp:
        model_dir = long_context_copy(build_tiny_model_dir(Path(tmp) / "tiny"), Path(tmp) / "model",
                                      FAULT_CONTEXT)
        log_dir = args.log_dir or Path(tmp) / "logs"
        load = replace(LoadConfig(), concurrency=args.concurrency, max_tokens=args.max_tokens)
        results = []
        with Fleet(fault_fleet_config(model_dir, log_dir)) as fleet:
            for scenario in SCENARIOS:
                result = scenario(fleet, load)
                print(f"{result.name}: {result.row()}", file=sys.stderr)
                for problem in result.problems:
                    print(f"  problem: {problem}", file=sys.stderr)
                results.append(result)
        print(format_table(results))
    return 0 if all(not r.problems for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
