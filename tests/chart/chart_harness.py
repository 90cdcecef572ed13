"""Render the kvfleet Helm chart offline and look things up in the result.

Role: one place that knows how the chart is rendered, linted and validated, so the tests read
as statements about manifests.

- Helm: the real Helm v4 engine through the PyPI package `helm-python-sdk` (import name
  `helm_python`). Its wheel ships `libhelm_c` (Helm's Go SDK behind a C ABI) and binds it with
  ctypes: no `helm` binary, no cluster, no network. `Chart.render` is `helm template`,
  `helm_python.lint(..., strict=True)` is `helm lint --strict`.
- Schemas: `kubernetes-validate` validates every manifest against the JSON schemas it bundles
  for `KUBE_VERSION`, in strict mode (unknown fields are errors).
- CRD kinds: kubernetes-validate bundles schemas for built-in kinds only. `CRD_KINDS` is the
  allow-list of custom kinds the chart may render; they skip schema validation (a test checks
  that the package really has no schema for them) and their content is asserted directly in
  the tests instead. Any other kind without a schema fails validation.

Invariants: renders are cached per (values, release, namespace), so parametrised tests pay for
each combination once; values passed in are never mutated.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "charts" / "kvfleet"
# A current Kubernetes release whose schemas kubernetes-validate==1.37.0 bundles.
KUBE_VERSION = "1.37.0"
RELEASE = "kv"
NAMESPACE = "llm"
FULLNAME = f"{RELEASE}-kvfleet"

# Custom resource kinds (apiVersion, kind) without a bundled schema: content asserted in tests.
CRD_KINDS = frozenset({("monitoring.coreos.com/v1", "ServiceMonitor")})

COMPONENTS = ("router", "tokenizer", "engine")
GRPC_SERVICES = {
    "router": "kvfleet.v1.Router",
    "tokenizer": "kvfleet.v1.Tokenizer",
    "engine": "kvfleet.v1.Engine",
}

# Values combinations rendered, linted and validated by every generic test.
SCENARIOS: dict[str, dict[str, Any]] = {
    "default": {},
    "gpu": {"engine": {"gpu": {"enabled": True, "count": 2}}},
    "gpu-eager": {"engine": {"gpu": {"enabled": True, "memoryUtilization": 0.75,
                                     "enforceEager": True}}},
    "kv-tiers": {"engine": {"preemptionMode": "auto", "swapSpace": 0.5,
                            "swapMinComputedTokens": 128, "kvOffloadingSize": 2}},
    "external-redis-url": {
        "redis": {"bundled": False, "external": {"url": "redis://redis.shared.svc:6379/3"}}
    },
    "external-redis-secret": {
        "redis": {"bundled": False,
                  "external": {"existingSecret": {"name": "redis-creds", "key": "url"}}}
    },
    "autoscaling": {"router": {"autoscaling": {"enabled": True, "minReplicas": 3,
                                              "maxReplicas": 12,
                                              "targetMemoryUtilizationPercentage": 80}}},
    "tracing": {"tracing": {"enabled": True, "endpoint": "http://otel-collector.obs:4317",
                            "resourceAttributes": {"deployment.environment": "prod"}}},
    "servicemonitor": {"metrics": {"enabled": True, "serviceMonitor": {"enabled": True}}},
    "networkpolicy": {"networkPolicy": {"enabled": True}},
    "auth": {"auth": {"enabled": True,
                      "apiKeys": {"tenants": {"acme": ["sk-acme-1", "sk-acme-2"]},
                                  "keys": {"sk-solo": "solo"}}}},
    "security": {"lora": {"allowRuntimeUpdating": True,
                          "allowedDirs": ["/models/adapters", "/srv/more adapters"]},
                 "tokenizer": {"allowSpecialTokensInPrompts": True},
                 "auth": {"enabled": True, "apiKeys": {
                     "tenants": {"ops": {"keys": ["sk-ops"], "admin": True},
                                 "acme": {"keys": ["sk-acme", {"key": "sk-acme-admin",
                                                               "admin": True}],
                                          "weight": 2}},
                     "defaults": {"requests_per_second": 5}}}},
    "deployment-pvc": {"engine": {"kind": "Deployment"},
                       "model": {"source": "pvc", "pvc": {"claimName": "models"}}},
    "hostpath": {"model": {"source": "hostPath", "hostPath": {"path": "/srv/models"},
                           "dir": "Qwen2-0.5B"}},
    "image-model": {"model": {"source": "image"}},
    "everything": {
        "engine": {"gpu": {"enabled": True}, "maxModelLen": 4096, "numKvBlocks": 512,
                   "kvCacheMemoryBytes": 2147483648, "enablePrefixCaching": False,
                   "enableChunkedPrefill": False, "dtype": "bfloat16"},
        "router": {"autoscaling": {"enabled": True}, "service": {"type": "LoadBalancer"},
                   "extraArgs": ["--max-attempts=5"]},
        "redis": {"bundled": False,
                  "external": {"existingSecret": {"name": "redis-creds", "key": "url"}}},
        "auth": {"enabled": True, "existingSecret": "tenant-keys"},
        "metrics": {"enabled": True, "serviceMonitor": {"enabled": True}},
        "tracing": {"enabled": True, "endpoint": "http://otel:4317"},
        "networkPolicy": {"enabled": True},
        "model": {"servedModelName": "smollm2"},
        "logLevel": "DEBUG",
    },
}


@dataclass(frozen=True)
class Rendered:
    """One render: the manifests (parsed) and NOTES.txt."""

    docs: tuple[dict[str, Any], ...]
    notes: str

    def kinds(self) -> set[str]:
        return {doc["kind"] for doc in self.docs}

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [doc for doc in self.docs if doc["kind"] == kind]

    def find(self, kind: str, name: str) -> dict[str, Any] | None:
        for doc in self.docs:
            if doc["kind"] == kind and doc["metadata"]["name"] == name:
                return doc
        return None

    def get(self, kind: str, name: str) -> dict[str, Any]:
        doc = self.find(kind, name)
        if doc is None:
            present = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in self.docs)
            raise AssertionError(f"no {kind}/{name}; rendered: {present}")
        return doc

    def workload(self, component: str) -> dict[str, Any]:
        """The Deployment or StatefulSet running a component."""
        name = f"{FULLNAME}-{component}"
        for kind in ("Deployment", "StatefulSet"):
            doc = self.find(kind, name)
            if doc is not None:
                return doc
        raise AssertionError(f"no workload {name}")

    def pod_spec(self, component: str) -> dict[str, Any]:
        spec: dict[str, Any] = self.workload(component)["spec"]["template"]["spec"]
        return spec

    def container(self, component: str) -> dict[str, Any]:
        containers = self.pod_spec(component)["containers"]
        assert len(containers) == 1, containers
        container: dict[str, Any] = containers[0]
        return container

    def config(self) -> dict[str, str]:
        data: dict[str, str] = self.get("ConfigMap", f"{FULLNAME}-config")["data"]
        return data

    def pod_workloads(self) -> Iterator[dict[str, Any]]:
        for doc in self.docs:
            if doc["kind"] in ("Deployment", "StatefulSet"):
                yield doc


def _freeze(values: Mapping[str, Any]) -> str:
    return json.dumps(values, sort_keys=True)


@functools.lru_cache(maxsize=64)
def _render_cached(frozen_values: str, release: str, namespace: str) -> Rendered:
    with helm.Chart.load(CHART_DIR) as chart:
        manifests = chart.render(json.loads(frozen_values), name=release, namespace=namespace)
    docs: list[dict[str, Any]] = []
    notes = ""
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        docs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return Rendered(tuple(docs), notes)


def render(values: Mapping[str, Any] | None = None, release: str = RELEASE,
           namespace: str = NAMESPACE) -> Rendered:
    """`helm template` of the chart with these values (cached; treat the result as read-only)."""
    return _render_cached(_freeze(values or {}), release, namespace)


def lint(values: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`helm lint --strict` for KUBE_VERSION: {"messages": [...], "errors": [...]}."""
    return helm.lint(CHART_DIR, dict(values or {}), strict=True,
                     kube_version=f"v{KUBE_VERSION}")


def validate_strict(doc: dict[str, Any]) -> None:
    """Raise unless `doc` validates strictly against KUBE_VERSION's schema; CRD_KINDS skip."""
    if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
        return
    kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command, args and env values (unknown refs stay)."""
    return _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), text)


def container_env(rendered: Rendered, container: dict[str, Any],
                  fields: Mapping[str, str]) -> dict[str, str]:
    """The environment a container would see: envFrom ConfigMaps, then env in order.

    Downward-API fields come from `fields` (e.g. {"metadata.name": "pod-0"}); secret refs
    become "<secret:NAME/KEY>" so tests can see where a value came from.
    """
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(rendered.get("ConfigMap", source["configMapRef"]["name"])["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
        elif "fieldRef" in var["valueFrom"]:
            env[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in var["valueFrom"]:
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = f"<secret:{ref['name']}/{ref['key']}>"
        else:
            raise AssertionError(f"unexpected env source {var}")
    return env


POD_FIELDS = {
    "metadata.name": "kv-kvfleet-engine-0",
    "metadata.namespace": NAMESPACE,
    "status.podIP": "10.1.2.3",
}


def command_line(rendered: Rendered, component: str) -> list[str]:
    """The container's command + args after $(VAR) expansion, as the kubelet would run it."""
    container = rendered.container(component)
    env = container_env(rendered, container, POD_FIELDS)
    argv = [*container["command"], *container["args"]]
    return [expand(arg, env) for arg in argv]
