"""LoRA adapters in routing: which engines serve an adapter, and what a model name means.

Engines publish the adapters they serve in their registry hash (`lora_adapters`, a JSON list;
kvfleet/contracts/redis_schema.py) and in GetLoad; in the registry also where each was loaded from
(`lora_paths`) and whether they take adapters at all (`max_loras` > 0), which the router
needs to load an adapter on another engine (router.routing.lora_placement). A request's OpenAI
`model` is either a base model (engines whose `model` equals it) or an adapter name: then
only engines serving that adapter are candidates — the policy then prefers, among them, the
longest cached prefix and the least load — and the engine request carries the adapter as
`lora_id` (the engine's block hash includes it, so the router hashes the prompt with it too).

Invariants: pure functions over `EngineRecord`s; a malformed `lora_adapters` or `lora_paths`
field counts as no adapters (an engine must not become unroutable through it).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from router.routing.prefix_index import EngineRecord


def adapters_of(record: EngineRecord) -> tuple[str, ...]:
    names = _json_field(record, "lora_adapters")
    return tuple(str(name) for name in names) if isinstance(names, list) else ()


def adapter_path(records: Sequence[EngineRecord], adapter: str) -> str:
    """The directory a serving engine loaded `adapter` from ("" when none published one)."""
    for record in records:
        paths = _json_field(record, "lora_paths")
        if isinstance(paths, dict) and adapter in adapters_of(record):
            path = paths.get(adapter)
            if isinstance(path, str) and path:
                return path
    return ""


def takes_adapters(record: EngineRecord) -> bool:
    """The engine has LoRA enabled (it published max_loras > 0)."""
    return record.int_field("max_loras") > 0


def _json_field(record: EngineRecord, name: str) -> object:
    raw = record.fields.get(name, "")
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None


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
