"""The chart's prefill/decode disaggregation values: a prefill StatefulSet next to the
decode engines, each with its --role, the router's threshold, and nothing of it by default."""

from __future__ import annotations

from tests.chart.chart_harness import lint, render, validate_strict

VALUES = {"disaggregation": {"prefillReplicas": 2, "prefillThreshold": 512}}


def _args(doc: dict) -> list[str]:
    return list(doc["spec"]["template"]["spec"]["containers"][0]["args"])


def test_default_has_one_engine_group_without_roles():
    rendered = render()
    sets = [d for d in rendered.all("StatefulSet") if "engine" in d["metadata"]["name"]]
    assert len(sets) == 1
    assert not any(a.startswith("--role") for a in _args(sets[0]))
    router = rendered.workload("router")
    assert not any(a.startswith("--disagg") for a in _args(router))


def test_prefill_group_and_decode_group():
    rendered = render(VALUES)
    sets = {d["metadata"]["name"]: d for d in rendered.all("StatefulSet")
            if "engine" in d["metadata"]["name"]}
    assert len(sets) == 2
    prefill = next(d for n, d in sets.items() if n.endswith("-engine-prefill"))
    decode = next(d for n, d in sets.items() if n.endswith("-engine"))
    assert prefill["spec"]["replicas"] == 2
    assert "--role=prefill" in _args(prefill) and "--role=decode" in _args(decode)
    assert prefill["spec"]["serviceName"] == prefill["metadata"]["name"]
    labels = [d["spec"]["selector"]["matchLabels"] for d in (prefill, decode)]
    assert labels[0] != labels[1]  # no StatefulSet adopts the other's pods
    assert "--disagg-prefill-threshold=512" in _args(rendered.workload("router"))
    for doc in rendered.docs:
        validate_strict(doc)
    assert not lint(VALUES)["errors"]


def test_role_extra_args_go_to_their_role_only():
    values = {"engine": {"extraArgs": ["--max-num-batched-tokens=2048"]},
              "disaggregation": {"prefillReplicas": 1, "prefillExtraArgs":
                                 ["--max-num-batched-tokens=512"],
                                 "decodeExtraArgs": ["--max-prefill-tokens-per-decode-step=8"]}}
    rendered = render(values)
    sets = {d["metadata"]["name"]: _args(d) for d in rendered.all("StatefulSet")
            if "engine" in d["metadata"]["name"]}
    prefill = next(a for n, a in sets.items() if n.endswith("-engine-prefill"))
    decode = next(a for n, a in sets.items() if n.endswith("-engine"))
    # The role's flag comes after the fleet-wide one, so the engine's parser takes it.
    assert prefill.index("--max-num-batched-tokens=512") > prefill.index(
        "--max-num-batched-tokens=2048")
    assert "--max-prefill-tokens-per-decode-step=8" not in prefill
    assert "--max-prefill-tokens-per-decode-step=8" in decode
    assert "--max-num-batched-tokens=512" not in decode
    both = [a for d in render({"disaggregation": {"decodeExtraArgs": ["--seed=3"]}}).all(
        "StatefulSet") if "engine" in d["metadata"]["name"] for a in _args(d)]
    assert "--seed=3" not in both  # colocated engines have no role
    assert not lint(values)["errors"]
