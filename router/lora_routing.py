"""LoRA adapters in routing: which engines serve an adapter, and what a model name means.

Engines publish the adapters they serve in their registry hash (`lora_adapters`, a JSON list;
kvfleet/redis_schema.py) and in GetLoad. A request's OpenAI `model` is either a base model
(engines whose `model` equals it) or an adapter name: then only engines serving that adapter
are candidates — the policy then prefers, among them, the longest cached prefix and the least
load — and the engine request carries the adapter as `lora_id` (the engine's block hash
includes it, so the router hashes the prompt with it too).

Invariants: pure functions over `EngineRecord`s; a malformed `lora_adapters` field counts as
no adapters (an engine must not become unroutable through it).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from router.prefix_index import EngineRecord


def adapters_of(record: EngineRecord) -> tuple[str, ...]:
    raw = record.fields.get("lora_adapters", "")
    if not raw:
        return ()
    try:
        names = json.loads(raw)
    except ValueError:
        return ()
    if not isinstance(names, list):
        return ()
    return tuple(str(name) for name in names)


def served_adapters(records: Sequence[EngineRecord]) -> dict[str, str]:
    """{adapter name: its base model} over the live engines, sorted by name."""
    parents: dict[str, str] = {}
    for record in records:
        for name in adapters_of(record):
            parents.setdefault(name, record.model)
    return dict(sorted(parents.items()))


def adapter_for(records: Sequence[EngineRecord], model: str) -> str:
    """`model` when it names an adapter (and no base model of that name), else ""."""
    if not model or any(r.model == model for r in records):
        return ""
    return model if any(model in adapters_of(r) for r in records) else ""


def holders(records: Sequence[EngineRecord], adapter: str) -> list[EngineRecord]:
    return [r for r in records if adapter in adapters_of(r)]
