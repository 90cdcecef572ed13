"""The containers' command lines are ones the services really accept.

Each rendered command is expanded the way the kubelet does it ($(VAR) from the ConfigMap and
the downward API), then parsed by the real argparse parsers: `kvfleet.cli` for `serve ROLE`,
then the service's own parser and config builder. A flag the chart invents, misspells or
feeds a bad value fails here, not in a cluster.
"""

from __future__ import annotations

import pytest

from kvfleet import cli
from tests.chart.chart_harness import GRPC_SERVICES, SCENARIOS, command_line, render


def _service_argv(scenario: str, component: str) -> list[str]:
    argv = command_line(render(SCENARIOS[scenario]), component)
    assert argv[:3] == ["python", "-m", "kvfleet.cli"]
    unexpanded = [arg for arg in argv if "$(" in arg]
    assert unexpanded == [], f"variables without a value: {unexpanded}"
    args = cli.build_parser().parse_args(argv[3:])
    assert (args.command, args.service) == ("serve", component)
    service_args: list[str] = args.service_args
    return service_args


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_router_command_line_parses(scenario: str) -> None:
    from router.server import RouterConfig, parse_args

    args = parse_args(_service_argv(scenario, "router"))
    config = RouterConfig.from_args(args)
    assert config.tokenizer_address == "kv-kvfleet-tokenizer:50051"
    assert args.port == 50050 and args.host == "0.0.0.0"
    assert args.http_port == 8000 and not args.no_http  # the Service's http port is served
    if scenario == "everything":
        assert args.max_attempts == 5  # extraArgs come last and win
        assert args.log_level == "DEBUG"


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_tokenizer_command_line_parses(scenario: str) -> None:
    from tokenizer_svc.server import parse_args

    args = parse_args(_service_argv(scenario, "tokenizer"))
    assert args.port == 50051
    assert args.served_model_name == ("smollm2" if scenario == "everything" else None)


def test_security_values_reach_the_services() -> None:
    """docs/security.md: runtime LoRA updates (routers), adapter roots (routers and engines),
    special tokens in prompts (tokenizers); none of them by default."""
    from router.server import RouterConfig
    from router.server import parse_args as router_args
    from tokenizer_svc.server import parse_args as tokenizer_args

    roots = ("/models/adapters", "/srv/more adapters")
    config = RouterConfig.from_args(router_args(_service_argv("security", "router")))
    assert config.runtime_lora.allow_updates and config.runtime_lora.roots.dirs == roots
    engine = _service_argv("security", "engine")
    at = engine.index("--lora-allowed-dirs")
    assert tuple(engine[at + 1:at + 3]) == roots
    assert tokenizer_args(_service_argv("security", "tokenizer")).allow_special_tokens_in_prompts
    default = RouterConfig.from_args(router_args(_service_argv("default", "router")))
    assert not default.runtime_lora.allow_updates and not default.runtime_lora.roots.configured
    assert "--lora-allowed-dirs" not in _service_argv("default", "engine")
    assert not tokenizer_args(_service_argv("default", "tokenizer")).allow_special_tokens_in_prompts


@pytest.mark.parametrize("scenario", ["default", "everything", "external-redis-url"])
def test_engine_command_line_parses(scenario: str) -> None:
    from engine.service.server import build_parser, options_from_args

    argv = _service_argv(scenario, "engine")
    if scenario == "everything":  # a secret's value is only known in the cluster
        argv = [a.replace("<secret:redis-creds/url>", "redis://redis:6379/0") for a in argv]
    options = options_from_args(build_parser().parse_args(argv))
    assert options.engine_id == "kv-kvfleet-engine-0"
    assert options.advertised_address(50052) == "10.1.2.3:50052"
    assert options.server.port == 50052
    engine = options.engine
    if scenario == "everything":
        assert (engine.max_model_len, engine.num_kv_blocks) == (4096, 512)
        assert engine.kv_cache_memory_bytes == 2147483648
        assert engine.dtype == "bfloat16"
        assert not engine.enable_prefix_caching and not engine.enable_chunked_prefill
        assert options.model_name == "smollm2"
    else:
        assert (engine.block_size, engine.max_num_seqs, engine.max_num_batched_tokens) == (
            16, 256, 2048)
        assert engine.enable_prefix_caching and engine.enable_chunked_prefill
        assert engine.max_model_len is None and engine.kv_cache_memory_bytes is None


def test_init_container_runs_the_default_model_preparation(
        capsys: pytest.CaptureFixture[str]) -> None:
    from engine.models import default_model
    (init,) = render().pod_spec("engine")["initContainers"]
    assert init["command"][:3] == ["python", "-m", "engine.models.default_model"]
    with pytest.raises(SystemExit) as exited:
        default_model.main([*init["command"][3:], "--help"])
    assert exited.value.code == 0
    assert "--out" in capsys.readouterr().out


def test_probe_service_names_and_ports_are_the_services_own() -> None:
    from kvfleet.v1 import engine_pb2, router_pb2, tokenizer_pb2
    from router.server import DEFAULT_PORT as ROUTER_PORT
    from tokenizer_svc.server import DEFAULT_PORT as TOKENIZER_PORT

    descriptors = {"router": (router_pb2, "Router"), "tokenizer": (tokenizer_pb2, "Tokenizer"),
                   "engine": (engine_pb2, "Engine")}
    for component, (module, service) in descriptors.items():
        expected = module.DESCRIPTOR.services_by_name[service].full_name
        assert GRPC_SERVICES[component] == expected
    ports = {c: render().container(c)["readinessProbe"]["grpc"]["port"] for c in descriptors}
    assert ports == {"router": ROUTER_PORT, "tokenizer": TOKENIZER_PORT, "engine": 50052}
