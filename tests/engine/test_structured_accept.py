"""Matcher-level accept/reject on the JSONSchemaBench subset's instances (tests/data).

tests/data/jsonschemabench/instances.json holds, per schema, valid and invalid JSON texts
labelled by `jsonschema` (benchmarks/schema_instances.py regenerates it exactly; the first
test holds it to that). Each text goes through the engine's llguidance matcher tokenized by
SmolLM2's tokenizer (benchmarks/structured_accept.py). Expected, per compiled schema: every
invalid instance rejected, every valid one accepted except those whose keys are out of the
schema's declaration order ("reordered"): the grammar fixes property order, as llguidance's
and xgrammar's do, so those are the only valid texts a constrained model could not write.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import schema_instances, structured_accept

DATA = structured_accept.DATA


def test_vendored_instances_are_what_the_generator_labels():
    vendored = json.loads((DATA / "instances.json").read_text())
    assert len(vendored) == 70
    for name, rows in vendored.items():
        assert rows == schema_instances.instances(json.loads((DATA / name).read_text())), name


@pytest.fixture(scope="module")
def results(smollm2_dir):
    return structured_accept.run(smollm2_dir)


def test_totals(results):
    done = [r for r in results.values() if r.compiled]
    assert len(done) == 58
    assert sum(r.valid for r in done) == 230
    assert sum(r.valid_accepted for r in done) == 175
    assert sum(r.invalid for r in done) == 372
    assert sum(r.invalid_rejected for r in done) == 372


def test_per_schema_only_reordered_valid_instances_are_refused(results):
    vendored = json.loads((DATA / "instances.json").read_text())
    for name, result in results.items():
        if not result.compiled:
            continue
        reordered = [r for r in vendored[name] if r["valid"] and r["variant"] == "reordered"]
        assert result.invalid_rejected == result.invalid, name
        assert result.valid_accepted == result.valid - len(reordered), name
        assert result.disagreements == ("reordered",) * len(reordered), name
