"""Matcher-level accept/reject over the JSONSchemaBench subset's instances.

For each vendored schema (tests/data/jsonschemabench), each instance of
tests/data/jsonschemabench/instances.json (valid and invalid, labelled by `jsonschema`; see
benchmarks/schema_instances.py) is tokenized with the model's tokenizer and fed token by
token through the engine's own grammar matcher (engine.structured's llguidance backend, the
schema compiled as a request's `StructuredOutputsParams(json=schema)` would be). An instance
is accepted when every token is accepted and then the generation's EOS is too (the document
is complete). A valid instance should be accepted and an invalid one rejected; the counts
per schema say where the grammar and jsonschema disagree.

Schemas that do not compile (llguidance refuses a keyword it cannot enforce) are counted
apart; their instances are not fed.

Usage: python -m benchmarks.structured_accept [--model-dir DIR] [--verbose].
"""

from __future__ import annotations

import argparse
import collections
import json
from dataclasses import dataclass
from pathlib import Path

from engine.structured.backend import CompiledGrammar, GrammarBackend
from engine.structured.llguidance_backend import LLGuidanceBackend
from kvfleet.contracts.errors import InvalidFieldError
from kvfleet.contracts.structured_outputs import StructuredOutputsParams
from kvfleet.text.tokenizer import Tokenizer, load_generation_eos_ids

DATA = Path(__file__).parent.parent / "tests" / "data" / "jsonschemabench"


@dataclass(frozen=True)
class SchemaResult:
    compiled: bool
    valid: int = 0
    valid_accepted: int = 0
    invalid: int = 0
    invalid_rejected: int = 0
    # Variant (schema_instances' name) of each instance the matcher and jsonschema disagree on.
    disagreements: tuple[str, ...] = ()


def backend_for(model_dir: str | Path) -> tuple[LLGuidanceBackend, int]:
    """The engine's llguidance backend over `model_dir`'s tokenizer, and its EOS id."""
    tokenizer = Tokenizer.from_dir(model_dir)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    eos = sorted(load_generation_eos_ids(model_dir))
    if not eos and tokenizer.eos_token_id is not None:
        eos = [tokenizer.eos_token_id]
    backend = LLGuidanceBackend(tokenizer, int(config["vocab_size"]), eos)
    return backend, int(eos[0])


def accepts(grammar: CompiledGrammar, token_ids: list[int], eos_id: int) -> bool:
    """True when a fresh matcher takes every token and then EOS."""
    matcher = grammar.new_matcher()
    return all(matcher.accept_token(t) for t in token_ids) and matcher.accept_token(eos_id)


def check_schema(backend: GrammarBackend, eos_id: int, schema: object,
                 instances: list[dict]) -> SchemaResult:
    try:
        grammar = backend.compile(StructuredOutputsParams(json=schema))  # type: ignore[arg-type]
    except InvalidFieldError:
        return SchemaResult(compiled=False)
    counts = {True: [0, 0], False: [0, 0]}  # label -> [instances, matcher agreed]
    disagreements = []
    for instance in instances:
        label = bool(instance["valid"])
        taken = accepts(grammar, backend.tokenize(instance["text"]), eos_id)
        counts[label][0] += 1
        counts[label][1] += taken == label
        if taken != label:
            disagreements.append(instance["variant"])
    return SchemaResult(True, counts[True][0], counts[True][1],
                        counts[False][0], counts[False][1], tuple(disagreements))


def run(model_dir: str | Path) -> dict[str, SchemaResult]:
    backend, eos_id = backend_for(model_dir)
    instances = json.loads((DATA / "instances.json").read_text())
    return {name: check_schema(backend, eos_id, json.loads((DATA / name).read_text()), rows)
            for name, rows in instances.items()}


def summary(results: dict[str, SchemaResult]) -> str:
    done = [r for r in results.values() if r.compiled]
    valid, accepted = sum(r.valid for r in done), sum(r.valid_accepted for r in done)
    invalid, rejected = sum(r.invalid for r in done), sum(r.invalid_rejected for r in done)
    exact = sum(r.valid == r.valid_accepted and r.invalid == r.invalid_rejected for r in done)
    by_variant = collections.Counter(v for r in done for v in r.disagreements)
    return (f"{len(done)}/{len(results)} schemas compile; valid instances accepted "
            f"{accepted}/{valid}, invalid rejected {rejected}/{invalid}; "
            f"{exact}/{len(done)} schemas agree with jsonschema on every instance; "
            f"disagreements by variant: {dict(sorted(by_variant.items())) or 'none'}")


def main(argv: list[str] | None = None) -> None:
    from engine.models.default_model import prepare_default_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    results = run(args.model_dir or prepare_default_model())
    if args.verbose:
        for name, r in results.items():
            line = (f"valid {r.valid_accepted}/{r.valid}  invalid rejected "
                    f"{r.invalid_rejected}/{r.invalid}  {' '.join(r.disagreements)}")
            print(f"{name:<52}" + (line if r.compiled else "does not compile"))
    print(summary(results))


if __name__ == "__main__":
    main()
