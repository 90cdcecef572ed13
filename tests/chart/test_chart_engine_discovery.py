"""Routers find engines without Redis through the engines' headless Service; registry flags.

Renders the chart with the real Helm engine and parses the routers' expanded command lines
with the router's own parser, so the flag, the Service name and its port must agree.
"""

from __future__ import annotations

from typing import Any

import pytest

from router.server import RouterConfig, parse_args
from tests.chart.chart_harness import FULLNAME, SCENARIOS, command_line, render


def _router_config(values: dict[str, Any]) -> RouterConfig:
    argv = command_line(render(values), "router")
    return RouterConfig.from_args(parse_args(argv[argv.index("router") + 1:]))


@pytest.mark.parametrize("scenario", ["default", "deployment-pvc"])
def test_routers_get_the_engines_headless_service_as_engine_dns(scenario: str) -> None:
    rendered = render(SCENARIOS[scenario])
    service = rendered.get("Service", f"{FULLNAME}-engine")
    assert service["spec"]["clusterIP"] == "None"
    assert not service["spec"].get("publishNotReadyAddresses", False)  # ready engines only
    engine_labels = rendered.workload("engine")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= engine_labels.items()
    engine_port = rendered.container("engine")["ports"][0]["containerPort"]
    config = _router_config(SCENARIOS[scenario])
    assert config.discovery.dns == f"{FULLNAME}-engine:{engine_port}"
    assert config.discovery.static_addresses == ()


def test_engine_dns_can_be_turned_off() -> None:
    values = {"router": {"engineDns": False}}
    assert _router_config(values).discovery.dns is None
    assert "KVFLEET_ROUTER_ENGINE_DNS" not in render(values).config()


def test_registry_settings_reach_the_router() -> None:
    defaults = _router_config({}).index
    assert (defaults.stale_after_s, defaults.max_connections, defaults.pool_timeout_s,
            defaults.candidate_window) == (3.0, 64, 2.0, 8)
    values = {"router": {"engineStaleAfterSeconds": 1.5, "redisMaxConnections": 16,
                         "redisPoolTimeoutSeconds": 0.5, "routingCandidateWindow": 4}}
    index = _router_config(values).index
    assert (index.stale_after_s, index.max_connections, index.pool_timeout_s,
            index.candidate_window) == (1.5, 16, 0.5, 4)
