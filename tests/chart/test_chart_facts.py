"""Key facts about the rendered manifests: probes, Redis wiring, identity, sizing, secrets.

Each test renders the chart with the real Helm engine (cached per values combination) and
asserts on the parsed manifests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from router.tenancy.tenant_policy import load_api_keys
from tests.chart.chart_harness import (
    COMPONENTS,
    FULLNAME,
    GRPC_SERVICES,
    NAMESPACE,
    POD_FIELDS,
    SCENARIOS,
    Rendered,
    command_line,
    container_env,
    render,
)

BUNDLED_REDIS_URL = f"redis://{FULLNAME}-redis:6379/0"


def _flag(argv: list[str], name: str) -> str | None:
    """The value of --name=VALUE in argv (the chart always uses the = form)."""
    values = [arg.split("=", 1)[1] for arg in argv if arg.startswith(f"--{name}=")]
    assert len(values) <= 1, (name, argv)
    return values[0] if values else None


def _port(container: dict[str, Any], name: str) -> int:
    port: int = next(p["containerPort"] for p in container["ports"] if p["name"] == name)
    return port


# --- probes --------------------------------------------------------------------------------


@pytest.mark.parametrize("component", COMPONENTS)
def test_probes_are_native_grpc_health_checks_on_the_serving_port(component: str) -> None:
    container = render().container(component)
    grpc_port = _port(container, "grpc")
    assert _flag(command_line(render(), component), "port") == str(grpc_port)
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container[kind]
        assert probe["grpc"] == {"port": grpc_port, "service": GRPC_SERVICES[component]}
        assert not {"httpGet", "tcpSocket", "exec"} & probe.keys()


def test_engine_startup_probe_allows_for_model_loading() -> None:
    startup = render().container("engine")["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300


# --- Redis ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scenario", "expected_url"),
    [
        ("default", BUNDLED_REDIS_URL),
        ("external-redis-url", "redis://redis.shared.svc:6379/3"),
        ("external-redis-secret", "<secret:redis-creds/url>"),
    ],
)
def test_engines_and_routers_get_the_redis_url(scenario: str, expected_url: str) -> None:
    rendered = render(SCENARIOS[scenario])
    for component in ("router", "engine"):
        assert _flag(command_line(rendered, component), "redis-url") == expected_url
    if scenario == "external-redis-secret":
        assert "KVFLEET_REDIS_URL" not in rendered.config()  # never in a ConfigMap
    assert "--redis-url" not in " ".join(command_line(rendered, "tokenizer"))


def test_bundled_redis_is_a_single_instance_without_persistence() -> None:
    rendered = render()
    redis = rendered.get("Deployment", f"{FULLNAME}-redis")
    assert redis["spec"]["replicas"] == 1
    container = redis["spec"]["template"]["spec"]["containers"][0]
    assert container["image"].startswith("redis:")
    args = container["args"]
    assert args[0] == "redis-server"
    assert args[args.index("--save") + 1] == ""
    assert args[args.index("--appendonly") + 1] == "no"
    volumes = redis["spec"]["template"]["spec"]["volumes"]
    assert all("persistentVolumeClaim" not in volume for volume in volumes)
    service = rendered.get("Service", f"{FULLNAME}-redis")
    assert service["spec"]["ports"][0]["port"] == 6379


@pytest.mark.parametrize("scenario", ["external-redis-url", "external-redis-secret"])
def test_external_redis_renders_no_redis(scenario: str) -> None:
    rendered = render(SCENARIOS[scenario])
    assert rendered.find("Deployment", f"{FULLNAME}-redis") is None
    assert rendered.find("Service", f"{FULLNAME}-redis") is None


# --- engine identity and addresses -------------------------------------------------------


@pytest.mark.parametrize("scenario", ["default", "deployment-pvc"])
def test_each_engine_registers_its_pod_name_and_pod_ip(scenario: str) -> None:
    rendered = render(SCENARIOS[scenario])
    container = rendered.container("engine")
    fields = {v["name"]: v["valueFrom"]["fieldRef"]["fieldPath"]
              for v in container["env"] if "fieldRef" in v.get("valueFrom", {})}
    assert fields["POD_NAME"] == "metadata.name"
    assert fields["POD_IP"] == "status.podIP"
    argv = command_line(rendered, "engine")
    assert _flag(argv, "engine-id") == POD_FIELDS["metadata.name"]
    assert _flag(argv, "advertise-host") == POD_FIELDS["status.podIP"]


def test_statefulset_engines_have_stable_names_under_a_headless_service() -> None:
    rendered = render()
    engines = rendered.get("StatefulSet", f"{FULLNAME}-engine")
    assert engines["spec"]["podManagementPolicy"] == "Parallel"
    service = rendered.get("Service", engines["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"


def test_routers_reach_the_tokenizer_service() -> None:
    rendered = render()
    tokenizer_service = rendered.get("Service", f"{FULLNAME}-tokenizer")
    port = tokenizer_service["spec"]["ports"][0]["port"]
    expected = f"{FULLNAME}-tokenizer:{port}"
    assert _flag(command_line(rendered, "router"), "tokenizer") == expected


# --- replicas, resources, GPUs, autoscaling --------------------------------------------------


SIZED: dict[str, dict[str, Any]] = {
    "router": {"replicas": 3, "resources": {"requests": {"cpu": "1", "memory": "1Gi"},
                                            "limits": {"memory": "2Gi"}}},
    "tokenizer": {"replicas": 3},
    "engine": {"replicas": 5, "threads": 8,
               "resources": {"requests": {"cpu": "8", "memory": "16Gi"},
                             "limits": {"cpu": "8", "memory": "24Gi"}}},
}


def test_replicas_and_resources_follow_values() -> None:
    rendered = render(SIZED)
    for component in COMPONENTS:
        assert rendered.workload(component)["spec"]["replicas"] == SIZED[component]["replicas"]
    for component in ("router", "engine"):
        resources = rendered.container(component)["resources"]
        assert resources == SIZED[component]["resources"]
    env = container_env(rendered, rendered.container("engine"), POD_FIELDS)
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "8"


def test_the_tokenizer_runs_two_replicas_by_default() -> None:
    # One replica can restart or drain while the other serves the routers.
    assert render().workload("tokenizer")["spec"]["replicas"] == 2


def test_gpu_toggle_adds_the_gpu_resource_and_toleration() -> None:
    assert "nvidia.com/gpu" not in render().container("engine")["resources"].get("limits", {})
    rendered = render(SCENARIOS["gpu"])
    resources = rendered.container("engine")["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 2
    assert resources["limits"]["memory"] == "8Gi"  # the rest of the limits are kept
    tolerations = rendered.pod_spec("engine")["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
    for component in ("router", "tokenizer"):
        assert "nvidia.com/gpu" not in json.dumps(rendered.pod_spec(component))


def test_autoscaling_hands_router_replicas_to_the_hpa() -> None:
    assert render().find("HorizontalPodAutoscaler", f"{FULLNAME}-router") is None
    rendered = render(SCENARIOS["autoscaling"])
    assert "replicas" not in rendered.workload("router")["spec"]
    hpa = rendered.get("HorizontalPodAutoscaler", f"{FULLNAME}-router")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1", "kind": "Deployment", "name": f"{FULLNAME}-router"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 12)
    targets = {m["resource"]["name"]: m["resource"]["target"]["averageUtilization"]
               for m in hpa["spec"]["metrics"]}
    assert targets == {"cpu": 70, "memory": 80}
    # Utilization targets need CPU requests on the router.
    assert rendered.container("router")["resources"]["requests"]["cpu"]


# --- API keys --------------------------------------------------------------------------------


def _secret_volume_names(pod_spec: dict[str, Any], secret_name: str) -> set[str]:
    return {v["name"] for v in pod_spec.get("volumes", [])
            if v.get("secret", {}).get("secretName") == secret_name}


@pytest.mark.parametrize("scenario", ["auth", "everything"])
def test_api_key_secret_is_mounted_only_in_the_router(scenario: str) -> None:
    rendered = render(SCENARIOS[scenario])
    secret_name = "tenant-keys" if scenario == "everything" else f"{FULLNAME}-api-keys"
    router_volumes = _secret_volume_names(rendered.pod_spec("router"), secret_name)
    assert len(router_volumes) == 1
    mount = next(m for m in rendered.container("router")["volumeMounts"]
                 if m["name"] in router_volumes)
    assert mount["readOnly"] is True
    key_file = _flag(command_line(rendered, "router"), "api-keys")
    assert key_file is not None and key_file.startswith(mount["mountPath"] + "/")
    for workload in rendered.pod_workloads():
        if workload["metadata"]["name"] != f"{FULLNAME}-router":
            assert secret_name not in json.dumps(workload), workload["metadata"]["name"]


def test_api_key_secret_holds_a_key_file_the_router_accepts(tmp_path: Path) -> None:
    rendered = render(SCENARIOS["auth"])
    secret = rendered.get("Secret", f"{FULLNAME}-api-keys")
    (name, content), = secret["stringData"].items()
    key_file = tmp_path / name
    key_file.write_text(content)
    auth = load_api_keys(key_file)
    assert auth.num_keys == 3
    assert auth.tenant_for([("authorization", "Bearer sk-acme-2")]) == "acme"
    assert auth.tenant_for([("x-api-key", "sk-solo")]) == "solo"
    assert _flag(command_line(rendered, "router"), "api-keys") == f"/etc/kvfleet/auth/{name}"


def test_auth_off_mounts_no_secret_and_passes_no_key_file() -> None:
    rendered = render()
    # Only the router credential engines require (generated, kvfleet/runtime/service_auth.py)
    # and the bundled Redis's password (docs/tls.md).
    assert sorted(s["metadata"]["name"] for s in rendered.all("Secret")) == [
        "kv-kvfleet-redis-auth", "kv-kvfleet-router-secret"]
    assert _flag(command_line(rendered, "router"), "api-keys") is None
    for component in ("router", "engine"):
        assert _flag(command_line(rendered, component), "router-secret-file") == (
            "/etc/kvfleet/router-secret/secret")


# --- model sources ---------------------------------------------------------------------------


def _model_volume(rendered: Rendered, component: str) -> dict[str, Any] | None:
    volumes = rendered.pod_spec(component).get("volumes", [])
    return next((v for v in volumes if v["name"] == "model"), None)


def test_init_source_prepares_the_default_model_in_each_pod() -> None:
    rendered = render()
    for component in ("engine", "tokenizer"):
        (init,) = rendered.pod_spec(component)["initContainers"]
        model_path = "/models/SmolLM2-135M-Instruct"
        assert init["command"] == [
            "python", "-m", "engine.models.default_model", "--out", model_path
        ]
        assert _model_volume(rendered, component) == {"name": "model", "emptyDir": {}}
        assert _flag(command_line(rendered, component), "model") == model_path
        mount = next(m for m in rendered.container(component)["volumeMounts"]
                     if m["name"] == "model")
        assert mount["readOnly"] is True
    assert "initContainers" not in rendered.pod_spec("router")


@pytest.mark.parametrize(
    ("scenario", "volume", "model_path"),
    [
        ("deployment-pvc", {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
         "/models/SmolLM2-135M-Instruct"),
        ("hostpath", {"hostPath": {"path": "/srv/models", "type": "Directory"}},
         "/models/Qwen2-0.5B"),
        ("image-model", None, "/opt/kvfleet/models/SmolLM2-135M-Instruct"),
    ],
)
def test_other_model_sources(scenario: str, volume: dict[str, Any] | None,
                             model_path: str) -> None:
    rendered = render(SCENARIOS[scenario])
    for component in ("engine", "tokenizer"):
        assert "initContainers" not in rendered.pod_spec(component)
        expected = None if volume is None else {"name": "model", **volume}
        assert _model_volume(rendered, component) == expected
        assert _flag(command_line(rendered, component), "model") == model_path


# --- drain -----------------------------------------------------------------------------------


@pytest.mark.parametrize("component", COMPONENTS)
def test_termination_grace_covers_prestop_and_drain(component: str) -> None:
    rendered = render()
    container = rendered.container(component)
    sleep = container["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep"
    drain = int(_flag(command_line(rendered, component), "grace-period") or 0)
    assert drain > 0
    grace = rendered.pod_spec(component)["terminationGracePeriodSeconds"]
    assert grace == int(sleep[1]) + drain + 15


def test_explicit_termination_grace_and_no_prestop() -> None:
    rendered = render({"engine": {"terminationGracePeriodSeconds": 300,
                                  "preStopSleepSeconds": 0, "gracePeriodSeconds": 240}})
    assert rendered.pod_spec("engine")["terminationGracePeriodSeconds"] == 300
    assert "lifecycle" not in rendered.container("engine")
    assert _flag(command_line(rendered, "engine"), "grace-period") == "240"


@pytest.mark.parametrize("component", COMPONENTS)
def test_each_component_has_a_disruption_budget(component: str) -> None:
    rendered = render()
    pdb = rendered.get("PodDisruptionBudget", f"{FULLNAME}-{component}")
    assert pdb["spec"]["maxUnavailable"] == 1
    pod_labels = rendered.workload(component)["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    off = render({component: {"pdb": {"enabled": False}}})
    assert off.find("PodDisruptionBudget", f"{FULLNAME}-{component}") is None


# --- services, network policy, monitoring, tracing -----------------------------------------


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_services_select_pods_that_have_their_target_ports(scenario: str) -> None:
    rendered = render(SCENARIOS[scenario])
    for service in rendered.all("Service"):
        selector = service["spec"]["selector"]
        matches = [w for w in rendered.pod_workloads()
                   if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matches) == 1, service["metadata"]["name"]
        container = matches[0]["spec"]["template"]["spec"]["containers"][0]
        port_names = {p["name"] for p in container["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names, (service["metadata"]["name"], port)


def test_router_service_has_grpc_and_http_ports() -> None:
    service = render().get("Service", f"{FULLNAME}-router")
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert set(ports) == {"grpc", "http"}
    assert ports["grpc"]["port"] == 50050
    assert ports["grpc"]["appProtocol"] == "kubernetes.io/h2c"
    assert ports["http"]["port"] == 8000
    lb = render({"router": {"service": {"type": "LoadBalancer"}}})
    assert lb.get("Service", f"{FULLNAME}-router")["spec"]["type"] == "LoadBalancer"


def test_network_policy_lets_only_the_router_in_from_outside() -> None:
    assert render({"networkPolicy": {"enabled": False}}).all("NetworkPolicy") == []
    assert len(render().all("NetworkPolicy")) == 2  # on by default
    rendered = render(SCENARIOS["networkpolicy"])
    router_policy = rendered.get("NetworkPolicy", f"{FULLNAME}-router")
    assert router_policy["spec"]["podSelector"]["matchLabels"][
        "app.kubernetes.io/component"] == "router"
    rule, scrapers = router_policy["spec"]["ingress"]
    assert {p["port"] for p in rule["ports"]} == {"grpc", "http"}
    assert "from" not in rule  # open to any client (networkPolicy.routerFrom narrows it)
    # Metrics are on by default: their port is open to networkPolicy.metricsFrom only.
    assert [p["port"] for p in scrapers["ports"]] == ["metrics"]
    assert scrapers["from"] == [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}}]

    internal = rendered.get("NetworkPolicy", f"{FULLNAME}-internal")
    selector = internal["spec"]["podSelector"]
    assert selector["matchLabels"] == {"app.kubernetes.io/name": "kvfleet",
                                       "app.kubernetes.io/instance": "kv"}
    assert selector["matchExpressions"] == [
        {"key": "app.kubernetes.io/component", "operator": "NotIn", "values": ["router"]}]
    assert internal["spec"]["policyTypes"] == ["Ingress"]
    only_rule, internal_scrapers = internal["spec"]["ingress"]
    assert only_rule == {"from": [{"podSelector": {"matchLabels": selector["matchLabels"]}}]}
    assert internal_scrapers == scrapers
    # Every non-router pod of the release is covered by the internal policy.
    for workload in rendered.pod_workloads():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        if labels["app.kubernetes.io/component"] != "router":
            assert selector["matchLabels"].items() <= labels.items()


def test_service_monitor_scrapes_the_metrics_services() -> None:
    assert render().all("ServiceMonitor") == []
    rendered = render(SCENARIOS["servicemonitor"])
    (monitor,) = rendered.all("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["name"] == FULLNAME
    spec = monitor["spec"]
    assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert spec["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "30s", "scrapeTimeout": "10s"}]
    selected = [s for s in rendered.all("Service")
                if spec["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
    assert sorted(s["metadata"]["name"] for s in selected) == sorted(
        f"{FULLNAME}-{c}-metrics" for c in COMPONENTS)
    for service in selected:
        assert [p["name"] for p in service["spec"]["ports"]] == ["metrics"]
    # The client-facing router Service never carries the metrics port.
    router_ports = rendered.get("Service", f"{FULLNAME}-router")["spec"]["ports"]
    assert "metrics" not in {p["name"] for p in router_ports}


@pytest.mark.parametrize("component", COMPONENTS)
def test_tracing_sets_the_standard_otel_variables(component: str) -> None:
    assert "OTEL_" not in json.dumps(render().container(component))
    rendered = render(SCENARIOS["tracing"])
    env = container_env(rendered, rendered.container(component), POD_FIELDS)
    assert env["OTEL_SERVICE_NAME"] == f"kvfleet-{component}"
    assert env["OTEL_TRACES_EXPORTER"] == "otlp"
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.obs:4317"
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
    assert env["OTEL_PROPAGATORS"] == "tracecontext,baggage"
    attributes = dict(pair.split("=", 1) for pair in env["OTEL_RESOURCE_ATTRIBUTES"].split(","))
    assert attributes["k8s.pod.name"] == POD_FIELDS["metadata.name"]
    assert attributes["k8s.namespace.name"] == NAMESPACE
    assert attributes["deployment.environment"] == "prod"


# --- configuration rollout and names ---------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "rolled"),
    [
        ({"engine": {"maxNumSeqs": 64}}, {"engine"}),
        ({"router": {"policy": "least_load"}}, {"router"}),
        ({"logLevel": "DEBUG"}, set(COMPONENTS)),
        ({"redis": {"bundled": False, "external": {"url": "redis://other:6379/0"}}},
         set(COMPONENTS)),
    ],
)
def test_a_settings_change_rolls_the_pods_it_concerns(values: dict[str, Any],
                                                      rolled: set[str]) -> None:
    def checksum(rendered: Rendered, component: str) -> str:
        metadata = rendered.workload(component)["spec"]["template"]["metadata"]
        return str(metadata["annotations"]["checksum/config"])

    before, after = render(), render(values)
    changed = {c for c in COMPONENTS if checksum(before, c) != checksum(after, c)}
    assert changed == rolled


def test_long_release_names_stay_within_kubernetes_limits() -> None:
    release = "a-very-long-release-name-for-a-production-llm-fleet"
    rendered = render(SCENARIOS["everything"], release=release)
    for doc in rendered.docs:
        name = doc["metadata"]["name"]
        limit = 52 if doc["kind"] == "StatefulSet" else 63
        assert len(name) <= limit and not name.endswith("-"), name
