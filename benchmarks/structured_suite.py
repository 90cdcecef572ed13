"""Grammar figures over the vendored JSONSchemaBench subset, kvfleet's engine backend.

- compile: each schema compiled from scratch as the engine does on first sight (the
  router-side check's cache cleared first, so its validation is included), ms per schema;
- mask: along each valid, in-order instance (tests/data/jsonschemabench/instances.json),
  the time to fill one row's packed mask before each of its tokens, µs per fill: real
  documents' masks, not a random walk;
- accept/reject: benchmarks/structured_accept's report line.

Nothing here runs the model: it times the grammar engine alone, on the model's tokenizer.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from benchmarks import structured_accept
from engine.structured import bitmask
from kvfleet.contracts import structured_grammar
from kvfleet.contracts.errors import InvalidFieldError
from kvfleet.contracts.structured_outputs import StructuredOutputsParams

DATA = structured_accept.DATA


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def compiled_schemas() -> dict[str, Any]:
    """The vendored schemas llguidance compiles (strict), by file name."""
    out = {}
    for path in sorted(DATA.glob("*/*.json")):
        schema = json.loads(path.read_text())
        try:
            structured_grammar.check_compiles(StructuredOutputsParams(json=schema))
        except InvalidFieldError:
            continue
        out[f"{path.parent.name}/{path.name}"] = schema
    return out


def kvfleet_suite(model_dir: str | Path) -> dict[str, Any]:
    backend, _ = structured_accept.backend_for(model_dir)
    instances = json.loads((DATA / "instances.json").read_text())
    compile_s: list[float] = []
    mask_s: list[float] = []
    for name, schema in compiled_schemas().items():
        structured_grammar._compiled.cache_clear()
        start = time.perf_counter()
        grammar = backend.compile(StructuredOutputsParams(json=schema))
        compile_s.append(time.perf_counter() - start)
        for row in instances[name]:
            if not row["valid"] or row["variant"] == "reordered":
                continue
            matcher = grammar.new_matcher()
            packed = bitmask.allocate(1, backend.vocab_size)
            for token in backend.tokenize(row["text"]):
                start = time.perf_counter()
                matcher.fill_bitmask(packed, 0)
                mask_s.append(time.perf_counter() - start)
                matcher.accept_token(token)
    accept = structured_accept.summary(structured_accept.run(model_dir))
    return {"schemas": len(compile_s), "compile_ms_p50": 1e3 * percentile(compile_s, 0.5),
            "compile_ms_p99": 1e3 * percentile(compile_s, 0.99),
            "compile_ms_max": 1e3 * max(compile_s, default=0.0),
            "mask_us_p50": 1e6 * percentile(mask_s, 0.5),
            "mask_us_p99": 1e6 * percentile(mask_s, 0.99), "mask_fills": len(mask_s),
            "accept_reject": accept}
