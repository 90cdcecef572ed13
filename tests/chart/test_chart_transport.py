"""The chart's transport security (docs/tls.md): Redis credentials from Secrets, TLS on every hop.

Renders the chart and checks what a cluster would run: the bundled Redis requires a
generated password that reaches Redis, routers and engines only as mounted files; with
`tls.enabled` every component mounts its own certificate, issued by one CA and naming the
role peers verify; routers verify engines by role and serve HTTPS; cert-manager and external
Redis variants render, lint, and their command lines parse.
"""

from __future__ import annotations

import base64
from typing import Any

import pytest
from cryptography import x509

from kvfleet import cli
from tests.chart.chart_harness import FULLNAME, command_line, lint, render

TLS: dict[str, Any] = {"tls": {"enabled": True}, "redis": {"tls": {"enabled": True}}}
CERT_MANAGER: dict[str, Any] = {"tls": {"enabled": True, "source": "certManager",
                                        "certManager": {"issuerRef": {"name": "fleet-ca"}}}}
EXTERNAL: dict[str, Any] = {"redis": {"bundled": False, "external": {
    "url": "rediss://redis.shared:6379/0", "passwordSecret": {"name": "redis-pw"},
    "caSecret": {"name": "redis-ca"}}}}
COMPONENTS = ("router", "tokenizer", "engine")


def _service_args(values: dict[str, Any], component: str) -> list[str]:
    argv = command_line(render(values), component)
    args: list[str] = cli.build_parser().parse_args(argv[3:]).service_args
    return args


def test_the_bundled_redis_requires_a_generated_password_kept_off_command_lines() -> None:
    rendered = render()
    secret = rendered.get("Secret", f"{FULLNAME}-redis-auth")["data"]
    password = base64.b64decode(secret["password"]).decode()
    assert len(password) >= 32
    assert base64.b64decode(secret["redis.conf"]).decode() == f'requirepass "{password}"\n'
    redis_args = rendered.container("redis")["args"]
    assert "/etc/kvfleet/redis-auth/redis.conf" in redis_args
    for component in ("router", "engine"):
        argv = command_line(rendered, component)
        assert "--redis-password-file=/etc/kvfleet/redis-auth/password" in argv
        assert not [a for a in argv if password in a]
        mounts = {m["name"] for m in rendered.container(component)["volumeMounts"]}
        assert "redis-auth" in mounts
    # The tokenizer never talks to Redis: it gets no password.
    assert "redis-auth" not in {m["name"] for m in rendered.container("tokenizer")[
        "volumeMounts"]}


def test_tls_gives_each_component_a_certificate_from_one_ca_naming_its_role() -> None:
    rendered = render(TLS)
    cas = set()
    for component in (*COMPONENTS, "redis"):
        secret = rendered.get("Secret", f"{FULLNAME}-{component}-tls")
        assert secret["type"] == "kubernetes.io/tls"
        data = {k: base64.b64decode(v) for k, v in secret["data"].items()}
        cas.add(data["ca.crt"])
        cert = x509.load_pem_x509_certificate(data["tls.crt"])
        ca = x509.load_pem_x509_certificate(data["ca.crt"])
        cert.verify_directly_issued_by(ca)
        names = cert.extensions.get_extension_for_class(
            x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
        assert f"kvfleet-{component}" in names and f"{FULLNAME}-{component}" in names
        volumes = {v["name"]: v for v in rendered.pod_spec(component)["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == f"{FULLNAME}-{component}-tls"
    assert len(cas) == 1


def test_tls_flags_reach_every_service_and_routers_verify_engines_by_role() -> None:
    rendered = render(TLS)
    for component in COMPONENTS:
        argv = command_line(rendered, component)
        assert "--tls-ca-file=/etc/kvfleet/tls/ca.crt" in argv
        probe = rendered.container(component)["readinessProbe"]
        assert "tcpSocket" in probe  # the kubelet's gRPC probe has no TLS
        name = f"{FULLNAME}-{component}"
        ports = {p["name"]: p for p in rendered.get("Service", name)["spec"]["ports"]}
        assert ports["grpc"]["appProtocol"] == "https"  # not cleartext h2c to a gateway
    router = command_line(rendered, "router")
    assert "--engine-tls-name=kvfleet-engine" in router
    assert "--ssl-certfile=/etc/kvfleet/tls/tls.crt" in router
    assert rendered.config()["KVFLEET_REDIS_URL"].startswith("rediss://")
    assert "--redis-ca-file=/etc/kvfleet/tls/ca.crt" in router
    redis_args = rendered.container("redis")["args"]
    assert redis_args[redis_args.index("--port") + 1] == "0"  # no plaintext port
    assert "--tls-port" in redis_args


@pytest.mark.parametrize("values", [{}, TLS, CERT_MANAGER, EXTERNAL],
                         ids=["default", "tls", "cert-manager", "external-redis"])
def test_the_transport_variants_lint_and_their_command_lines_parse(
        values: dict[str, Any]) -> None:
    from engine.service.server import build_parser, options_from_args
    from router.server import RouterConfig, parse_args

    assert lint(values)["errors"] == []
    router = RouterConfig.from_args(parse_args(_service_args(values, "router")))
    engine = options_from_args(build_parser().parse_args(_service_args(values, "engine")))
    tls = values.get("tls", {}).get("enabled", False)
    assert (router.tls is not None, engine.server.tls is not None) == (tls, tls)
    assert router.redis_access.password_file is not None
    assert engine.redis_access.password_file == router.redis_access.password_file


def test_cert_manager_issues_each_components_certificate() -> None:
    rendered = render(CERT_MANAGER)
    for component in COMPONENTS:
        spec = rendered.get("Certificate", f"{FULLNAME}-{component}")["spec"]
        assert spec["secretName"] == f"{FULLNAME}-{component}-tls"
        assert spec["issuerRef"]["name"] == "fleet-ca"
        assert f"kvfleet-{component}" in spec["dnsNames"]
        assert {"server auth", "client auth"} <= set(spec["usages"])
    assert rendered.find("Secret", f"{FULLNAME}-router-tls") is None


def test_an_external_redis_gets_its_password_and_ca_from_secrets() -> None:
    rendered = render(EXTERNAL)
    assert rendered.find("Secret", f"{FULLNAME}-redis-auth") is None
    for component in ("router", "engine"):
        argv = command_line(rendered, component)
        assert "--redis-password-file=/etc/kvfleet/redis-auth/password" in argv
        assert "--redis-ca-file=/etc/kvfleet/redis-ca/ca.crt" in argv
        volumes = {v["name"]: v for v in rendered.pod_spec(component)["volumes"]}
        assert volumes["redis-auth"]["secret"]["secretName"] == "redis-pw"
        assert volumes["redis-ca"]["secret"]["secretName"] == "redis-ca"
