"""The chart renders, lints clean in strict mode and yields schema-valid manifests.

Every values combination in `SCENARIOS` is rendered with the real Helm engine, linted with
`helm lint --strict`, and each manifest is validated strictly by kubernetes-validate against
Kubernetes `KUBE_VERSION`. Bad values are refused by values.schema.json (or, for what a schema
cannot say, by the templates) with a message naming the value.
"""

from __future__ import annotations

from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from tests.chart.chart_harness import (
    CHART_DIR,
    CRD_KINDS,
    KUBE_VERSION,
    SCENARIOS,
    lint,
    render,
    validate_strict,
)

# Kinds the chart may render; anything else is a mistake.
EXPECTED_KINDS = {
    "ConfigMap", "Deployment", "StatefulSet", "Service", "Secret", "ServiceAccount",
    "PodDisruptionBudget", "HorizontalPodAutoscaler", "NetworkPolicy", "ServiceMonitor",
}
WARNING = 2  # helm lint severities: 1 info, 2 warning, 3 error


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_helm_lint_strict_is_clean(scenario: str) -> None:
    report = lint(SCENARIOS[scenario])
    problems = [m for m in report["messages"] if m["severity"] >= WARNING]
    assert report["errors"] == [] and problems == [], report


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_manifest_validates_strictly(scenario: str) -> None:
    rendered = render(SCENARIOS[scenario])
    assert rendered.kinds() <= EXPECTED_KINDS, rendered.kinds()
    failures = []
    for doc in rendered.docs:
        try:
            validate_strict(doc)
        except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError) as e:
            where = ".".join(str(p) for p in getattr(e, "path", []))
            message = getattr(e, "message", str(e))
            failures.append(f"{doc['kind']}/{doc['metadata']['name']}: {where}: {message}")
    assert failures == []


def test_crd_allow_list_covers_only_kinds_without_a_bundled_schema() -> None:
    """Skipping a kind is only legitimate when kubernetes-validate really lacks its schema."""
    rendered = render(SCENARIOS["everything"])
    for api_version, kind in CRD_KINDS:
        doc = next(d for d in rendered.docs if (d["apiVersion"], d["kind"]) == (api_version, kind))
        with pytest.raises(kubernetes_validate.SchemaNotFoundError):
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def test_strict_validation_rejects_unknown_fields() -> None:
    """Guard against a silently lenient validator: a typo in a probe must fail."""
    doc = yaml.safe_load(yaml.safe_dump(render().workload("router")))
    doc["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["servise"] = "x"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_strict(doc)


def test_default_values_match_the_schema() -> None:
    with helm.Chart.load(CHART_DIR) as chart:
        assert chart.schema is not None
        chart.validate_schema({})
        defaults = chart.values
    assert defaults["model"]["source"] == "init"
    assert defaults["redis"]["bundled"] is True


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"engine": {"replicas": 0}}, "/engine/replicas"),
        ({"engine": {"dtype": "int8"}}, "/engine/dtype"),
        ({"engine": {"kind": "DaemonSet"}}, "/engine/kind"),
        ({"engine": {"preemptionMode": "spill"}}, "/engine/preemptionMode"),
        ({"engine": {"swapSpace": -1}}, "/engine/swapSpace"),
        ({"engine": {"gpu": {"enabled": True, "memoryUtilization": 1.5}}},
         "/engine/gpu/memoryUtilization"),
        ({"engine": {"gpu": {"enabled": True, "memoryUtilization": 0}}},
         "/engine/gpu/memoryUtilization"),
        ({"model": {"source": "s3"}}, "/model/source"),
        ({"model": {"source": "pvc"}}, "/model/pvc/claimName"),
        ({"model": {"source": "hostPath"}}, "/model/hostPath"),
        ({"redis": {"bundled": False}}, "/redis/external"),
        ({"redis": {"external": {"url": "http://x"}}}, "/redis/external/url"),
        ({"auth": {"enabled": True}}, "/auth/apiKeys"),
        ({"auth": {"enabled": True, "apiKeys": {"tenants": {"acme": []}}}}, "/auth/apiKeys"),
        ({"tracing": {"enabled": True}}, "/tracing/endpoint"),
        ({"lora": {"allowRuntimeUpdating": True}}, "/lora/allowedDirs"),
        ({"lora": {"allowedDirs": ["adapters"]}}, "/lora/allowedDirs/0"),
        ({"metrics": {"enabled": False, "serviceMonitor": {"enabled": True}}},
         "/metrics/enabled"),
        ({"router": {"policy": "random"}}, "/router/policy"),
        ({"router": {"grpcPort": 70000}}, "/router/grpcPort"),
        ({"router": {"routingCandidateWindow": 0}}, "/router/routingCandidateWindow"),
        ({"logLevel": "TRACE"}, "/logLevel"),
        ({"engnie": {"replicas": 2}}, "engnie"),
    ],
)
def test_schema_refuses_bad_values(values: dict[str, Any], message: str) -> None:
    with helm.Chart.load(CHART_DIR) as chart, pytest.raises(helm.HelmValuesError) as caught:
        chart.render(values, name="kv", namespace="llm")
    assert message in str(caught.value)
