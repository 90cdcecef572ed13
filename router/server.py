"""Run the router: `kvfleet serve router --tokenizer HOST:PORT --redis-url URL` (or
`python -m router.server ...`).

Role: process entry point. Parses arguments once into `RouterConfig`, builds the
`GenerationPipeline` (tokenizer client, Redis prefix index, engine discovery, engine pool,
selector, rate limiter) and the two front doors sharing it with the tenant policy store: the
gRPC servicer on a `kvfleet.runtime.grpc_server.GrpcServer` (health, reflection, error
mapping, graceful drain) and the OpenAI HTTP app; serves until SIGTERM/SIGINT; exits 0 after
a graceful shutdown.

Invariants: configuration comes from arguments only (no environment reads); the port file is
written only once the server accepts RPCs (its existence means ready); client channels and
the Redis connection close only after in-flight streams have drained.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry

from kvfleet.runtime import event_loop
from kvfleet.runtime.arg_types import seconds
from kvfleet.runtime.grpc_server import GrpcServer, write_port_file
from kvfleet.runtime.metrics import start_metrics_endpoint
from kvfleet.runtime.options import ServerOptions, add_server_arguments, start_service_process
from kvfleet.runtime.redis_access import (
    NO_ACCESS,
    RedisAccess,
    add_redis_access_arguments,
    describe,
)
from kvfleet.runtime.service_auth import read_secret
from kvfleet.runtime.tls import (
    DEFAULT_ENGINE_NAME,
    TOKENIZER_ROLE,
    ClientTls,
    TlsFiles,
    TlsMaterial,
)
from kvfleet.runtime.tracing import init_tracing
from router.engines.disagg import DisaggConfig
from router.engines.discovery import DEFAULT_DNS_REFRESH_S, DiscoveryConfig, EngineDiscovery
from router.engines.dispatch import StreamDeadlines
from router.engines.pool import EnginePool
from router.http.app import OpenAIApi
from router.http.https import HttpsOptions, add_https_arguments
from router.http.lora_endpoints import RuntimeLoRAConfig, add_runtime_lora_arguments
from router.http.uvicorn_server import HttpServer
from router.metrics import RouterMetrics
from router.openai.chat_output import ChatOutputConfig
from router.openai.output_flags import add_chat_output_arguments, chat_output_config
from router.pipeline import DEFAULT_MAX_ATTEMPTS, GenerationPipeline
from router.request_limits import RequestLimits, add_limit_arguments
from router.routing.decision import EngineSelector, RoutingConfig
from router.routing.lora_placement import LoRAPlacementConfig, LoRAPlacer, engine_loader
from router.routing.prefix_index import PrefixIndex, PrefixIndexConfig
from router.routing.ranking import Policy, PrefixPolicyConfig
from router.servicer import RouterServicer
from router.tenancy.policy_reload import DEFAULT_RELOAD_INTERVAL_S, PolicyStore
from router.tenancy.rate_limit import RateLimitConfig, TenantRateLimiter
from router.tenancy.tenant_policy import TenantPolicy, load_policy
from router.tokenizer_client import TokenizerClient

logger = logging.getLogger(__name__)

DEFAULT_PORT = 50050
# vLLM's and TGI's OpenAI server port.
DEFAULT_HTTP_PORT = 8000


@dataclass(frozen=True)
class RouterConfig:
    tokenizer_address: str
    redis_url: str | None
    routing: RoutingConfig
    api_keys_path: Path | None = None
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    deadlines: StreamDeadlines = field(default_factory=StreamDeadlines)
    index: PrefixIndexConfig = field(default_factory=PrefixIndexConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    limits: RequestLimits = field(default_factory=RequestLimits)
    # Seconds between checks of the tenant policy file for changes (0: never reload).
    policy_reload_s: float = DEFAULT_RELOAD_INTERVAL_S
    rate_limits: RateLimitConfig = field(default_factory=RateLimitConfig)
    # The shared secret engines require of routers (kvfleet.runtime.service_auth); None: none sent.
    router_secret_file: Path | None = None
    lora: LoRAPlacementConfig = field(default_factory=LoRAPlacementConfig)
    # Redis credentials and TLS (kvfleet.runtime.redis_access), read at start.
    redis_access: RedisAccess = NO_ACCESS
    # Mutual TLS to engines and the tokenizer, and TLS on the gRPC front door
    # (kvfleet.runtime.tls); None: plaintext.
    tls: TlsFiles | None = None
    # The name an engine's certificate must carry ({engine_id}: the id it claims in Redis).
    engine_tls_name: str = DEFAULT_ENGINE_NAME
    tokenizer_tls_name: str = TOKENIZER_ROLE
    # Tool calls and reasoning in chat output (--enable-auto-tool-choice, --tool-call-parser,
    # --reasoning-parser).
    chat_output: ChatOutputConfig = field(default_factory=ChatOutputConfig)
    # /v1/load_lora_adapter and /v1/unload_lora_adapter (admins only), and the adapter roots.
    runtime_lora: RuntimeLoRAConfig = field(default_factory=RuntimeLoRAConfig)
    # Prompt text on the request's span (gen_ai.prompt); off: spans never hold prompts.
    trace_prompts: bool = False
    # Prefill/decode disaggregation (router.engines.disagg).
    disagg: DisaggConfig = field(default_factory=DisaggConfig)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RouterConfig:
        if args.load_slack_abs is not None or args.load_slack_rel is not None:
            logger.info("--load-slack-abs/--load-slack-rel are ignored: the prefix policy "
                           "ranks engines by estimated time to first token, not by a load bound")
        prefix = PrefixPolicyConfig(
            host_hit_weight=args.host_hit_weight,
            kv_pressure_start=args.kv_pressure_start,
            duplicate_weight=args.duplicate_weight,
            tie_rel=args.tie_tolerance,
        )
        redis_access = RedisAccess.from_args(args)
        return cls(
            tokenizer_address=args.tokenizer,
            redis_url=args.redis_url,
            routing=RoutingConfig(policy=Policy(args.policy), prefix=prefix),
            api_keys_path=args.api_keys,
            max_attempts=args.max_attempts,
            deadlines=StreamDeadlines(args.first_token_timeout, args.stream_stall_timeout),
            index=PrefixIndexConfig(
                max_connections=args.redis_max_connections,
                pool_timeout_s=args.redis_pool_timeout,
                stale_after_s=args.engine_stale_after,
                candidate_window=args.routing_candidate_window,
            ),
            discovery=DiscoveryConfig.from_flags(
                args.engines, args.engine_dns, args.engine_dns_refresh
            ),
            limits=RequestLimits.from_args(args),
            policy_reload_s=args.policy_reload_interval,
            rate_limits=RateLimitConfig(redis_url=args.redis_url, replicas=args.router_replicas,
                                        redis_access=redis_access),
            router_secret_file=args.router_secret_file,
            lora=LoRAPlacementConfig(enabled=args.lora_autoload),
            redis_access=redis_access,
            tls=TlsFiles.from_flags(args.tls_cert_file, args.tls_key_file, args.tls_ca_file),
            engine_tls_name=args.engine_tls_name,
            tokenizer_tls_name=args.tokenizer_tls_name,
            chat_output=args.chat_output,
            runtime_lora=RuntimeLoRAConfig.from_args(args),
            trace_prompts=args.trace_prompts,
            disagg=DisaggConfig(args.disagg_prefill_threshold, args.disagg_transfer_timeout),
        )


@dataclass(frozen=True)
class HttpOptions:
    """The OpenAI HTTP API: port (0 picks a free one, None disables it), port file, HTTPS."""

    port: int | None = DEFAULT_HTTP_PORT
    port_file: Path | None = None
    https: HttpsOptions | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> HttpOptions:
        return cls(None if args.no_http else args.http_port, args.http_port_file,
                   HttpsOptions.from_args(args))


@dataclass
class RouterApp:
    """A built (not started) router: the server plus what must be closed after it."""

    server: GrpcServer
    tokenizer: TokenizerClient
    pool: EnginePool
    index: PrefixIndex | None
    metrics: RouterMetrics
    http: OpenAIApi
    policies: PolicyStore
    rate_limiter: TenantRateLimiter

    async def close(self) -> None:
        await self.rate_limiter.close()
        await self.pool.close()
        await self.tokenizer.close()
        if self.index is not None:
            await self.index.close()


def load_tenant_policy(config: RouterConfig) -> TenantPolicy:
    """The policy file's policy, or auth off and no limits; ValueError for a bad file."""
    return load_policy(config.api_keys_path) if config.api_keys_path else TenantPolicy()


def build_router(
    config: RouterConfig,
    host: str = "0.0.0.0",
    port: int = 0,
    grace_s: float = 30.0,
    policy: TenantPolicy | None = None,
    registry: CollectorRegistry | None = None,
) -> RouterApp:
    """Everything a router needs, wired; call inside the event loop that will serve it.

    Metrics go to `registry` (a private one when None); see router.metrics.
    """
    policy = policy if policy is not None else load_tenant_policy(config)
    tls = None if config.tls is None else TlsMaterial.load(config.tls)
    credentials = None if tls is None else tls.channel_credentials()
    tokenizer = TokenizerClient(
        config.tokenizer_address,
        tls=None if credentials is None else ClientTls(credentials, config.tokenizer_tls_name),
    )
    index = (PrefixIndex(config.redis_url, config.index, config.redis_access)
             if config.redis_url else None)
    metrics = RouterMetrics(registry)
    policies = PolicyStore(
        policy, config.api_keys_path, config.policy_reload_s,
        on_reload=lambda outcome: metrics.policy_reloads.labels(outcome).inc(),
    )
    rate_limiter = TenantRateLimiter(config.rate_limits, metrics)
    secret = read_secret(config.router_secret_file) if config.router_secret_file else None
    pool = EnginePool(
        metrics=metrics, router_secret=secret,
        tls=None if credentials is None else ClientTls(credentials, config.engine_tls_name),
    )
    discovery = EngineDiscovery(config.discovery) if config.discovery.enabled else None
    loader = engine_loader(pool, config.lora.load_timeout_s, config.runtime_lora.roots)
    placer = LoRAPlacer(config.lora, loader, metrics)
    selector = EngineSelector(config.routing, index, pool, metrics, discovery, placer)
    pipeline = GenerationPipeline(
        tokenizer, selector, pool, metrics, config.max_attempts, config.deadlines,
        config.limits, rate_limiter, config.trace_prompts, config.disagg,
    )
    servicer = RouterServicer(policies, pipeline, metrics)
    # The front door: TLS without client certificates (clients authenticate by API key).
    server = GrpcServer([servicer.as_service()], host=host, port=port, grace_s=grace_s,
                        credentials=None if tls is None else
                        tls.server_credentials(require_client_auth=False))
    http = OpenAIApi(pipeline, policies, metrics, config.chat_output, config.runtime_lora)
    logger.info(
        "router: policy %s, tokenizer %s, redis %s, engines without redis %s, auth %s, "
        "transport %s",
        config.routing.policy.value,
        config.tokenizer_address,
        describe(config.redis_url) if config.redis_url else "off",
        ", ".join([*config.discovery.static_addresses,
                   *([f"dns {config.discovery.dns}"] if config.discovery.dns else [])])
        or "the last ones redis named",
        f"on ({policy.auth.num_keys} keys)" if policy.auth.enabled
        else "off (tenant 'anonymous')",
        "plaintext (engines are dialed at the address Redis names)" if tls is None
        else f"mutual TLS (engine certificates must name {config.engine_tls_name})",
    )
    if tls is None and secret is not None and not _on_loopback(config.redis_url):
        logger.warning("plaintext gRPC: engines are dialed at whatever address Redis names and "
                       "get the router credential unverified; over a network, use --tls-* "
                       "(docs/tls.md)")
    return RouterApp(server, tokenizer, pool, index, metrics, http, policies, rate_limiter)


def _on_loopback(redis_url: str | None) -> bool:
    """Whether Redis (so every engine it names, as `kvfleet up` runs them) is on this host."""
    host = urlsplit(redis_url).hostname if redis_url else None
    return host in (None, "localhost") or (host is not None and host.startswith("127.")) \
        or host == "::1"


async def serve(
    config: RouterConfig, options: ServerOptions, policy: TenantPolicy, http: HttpOptions
) -> int:
    """Serve gRPC (and HTTP) until SIGTERM/SIGINT (main thread only); returns the exit code."""
    app = build_router(config, options.host, options.port, options.grace_s, policy)
    endpoint = None
    http_server = None
    background = [asyncio.create_task(app.policies.run()),
                  asyncio.create_task(app.rate_limiter.run())]
    try:
        bound_port = await app.server.start()
        endpoint = start_metrics_endpoint(
            app.metrics.registry, options.host, options.metrics_port, options.metrics_port_file,
            fallback=options.metrics_port_fallback,
        )
        if http.port is not None:
            http_server = HttpServer(app.http.app(), options.host, http.port, options.grace_s,
                                     http.https)
            http_port = await http_server.start()
            logger.info("OpenAI API on %s://%s:%d/v1", "http" if http.https is None else "https",
                        options.host, http_port)
            if http.port_file is not None:
                write_port_file(http.port_file, http_port)
        if options.port_file is not None:  # last: its existence means everything is up
            write_port_file(options.port_file, bound_port)
        return await app.server.serve_until_signal(
            http_server.stop if http_server is not None else None
        )
    finally:
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        if endpoint is not None:
            endpoint.close()
        await app.close()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="kvfleet serve router",
        description="Route generation requests to engines by prefix-cache hits and load.",
    )
    parser.add_argument("--tokenizer", required=True, help="tokenizer service HOST:PORT")
    parser.add_argument(
        "--redis-url", default=None,
        help="Redis holding the engine registry (none: engines from --engines/--engine-dns)",
    )
    parser.add_argument(
        "--policy", choices=[p.value for p in Policy], default=Policy.PREFIX.value
    )
    parser.add_argument(
        "--tenant-policy", "--api-keys", dest="api_keys", type=Path, default=None,
        help="JSON/YAML tenant policy: API keys -> tenants and each tenant's limits; a plain "
             "key file works too (docs/tenants.md; none: auth off, tenant 'anonymous')",
    )
    parser.add_argument(
        "--policy-reload-interval", type=seconds, default=DEFAULT_RELOAD_INTERVAL_S,
        help="seconds between checks of the policy file for changes; a bad new version is "
             "logged and the previous one kept (0: no reload; default: %(default)s)",
    )
    parser.add_argument(
        "--router-secret-file", type=Path, default=None,
        help="file holding the secret engines require of routers (the engines' "
             "--router-secret-file); kvfleet up and the Helm chart create it",
    )
    parser.add_argument(
        "--router-replicas", type=int, default=1,
        help="router replicas sharing the tenants' limits: while Redis is unreachable each "
             "enforces limit / replicas on its own (default: %(default)s)",
    )
    defaults = PrefixPolicyConfig()
    # Accepted so that deployments passing them still start (the Helm chart did).
    parser.add_argument("--load-slack-abs", type=int, default=None,
                        help="ignored (the old prefix policy's load bound)")
    parser.add_argument("--load-slack-rel", type=float, default=None,
                        help="ignored (the old prefix policy's load bound)")
    parser.add_argument("--duplicate-weight", type=float, default=defaults.duplicate_weight,
                        help="prefix policy: extra share of the compute charged for prompt "
                             "tokens another engine already holds, when estimating an engine "
                             "that would compute them again (0: time to first token alone; "
                             "default: %(default)s)")
    parser.add_argument("--tie-tolerance", type=float, default=defaults.tie_rel,
                        help="prefix policy: engines whose estimated time to first token is "
                             "within this share of the best one (plus 10 ms) are equal, and the "
                             "prompt's longest holder, then a hash of the prompt, decides; a "
                             "wider tolerance keeps prefixes apart on engines whose measured "
                             "rates are noisy (default: %(default)s)")
    parser.add_argument("--kv-pressure-start", type=float, default=defaults.kv_pressure_start,
                        help="KV cache usage (0-1) from which the prefix policy charges an "
                             "engine more for computing new blocks (default: %(default)s)")
    parser.add_argument("--host-hit-weight", type=float, default=defaults.host_hit_weight,
                        help="what a prompt block in an engine's host KV tier is worth against "
                             "one on its device (1.0), in [0, 1] (default: %(default)s)")
    parser.add_argument("--max-attempts", type=int, default=DEFAULT_MAX_ATTEMPTS,
                        help="engines tried per request before the first token")
    stalls = StreamDeadlines()
    parser.add_argument("--first-token-timeout", type=seconds, default=stalls.first_token_s,
                        help="seconds an engine may send nothing (neither a token nor a "
                             "keep-alive, which it sends while it progresses) before the first "
                             "token; then the next engine is tried (0: no limit; default: "
                             "%(default)s)")
    parser.add_argument("--stream-stall-timeout", type=seconds, default=stalls.stall_s,
                        help="the same after the first token; then the stream ends with "
                             "UNAVAILABLE and the engine request is cancelled (0: no limit; "
                             "default: %(default)s)")
    disagg = DisaggConfig()
    parser.add_argument("--disagg-prefill-threshold", type=int, default=disagg.prefill_threshold,
                        help="with prefill-role and decode-role engines in the fleet: prompts "
                             "of at least this many tokens are computed on a prefill engine "
                             "and continued on a decode engine; shorter ones go straight to a "
                             "decode engine (docs/disaggregation.md; default: %(default)s)")
    parser.add_argument("--disagg-transfer-timeout", type=seconds,
                        default=disagg.transfer_timeout_s,
                        help="seconds a prefill engine's KV push may take before the decode "
                             "engine recomputes instead (default: %(default)s)")
    parser.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT,
                        help="OpenAI-compatible HTTP API port (0: a free port)")
    parser.add_argument("--http-port-file", type=Path, default=None,
                        help="write the bound HTTP port here once it serves")
    parser.add_argument("--no-http", action="store_true", help="serve gRPC only")
    parser.add_argument("--trace-prompts", action="store_true",
                        help="add each request's prompt text to its trace span (gen_ai.prompt); "
                             "off by default: spans carry no prompt, API key or secret")
    parser.add_argument("--lora-autoload", action=argparse.BooleanOptionalAction, default=True,
                        help="when every engine serving a request's LoRA adapter is saturated, "
                             "load it on another engine and send the request there "
                             "(docs/lora.md; default: on)")
    add_runtime_lora_arguments(parser)
    add_engine_source_arguments(parser)
    add_redis_access_arguments(parser)
    add_peer_tls_arguments(parser)
    add_https_arguments(parser)
    add_limit_arguments(parser)
    add_chat_output_arguments(parser)
    add_server_arguments(parser, default_port=DEFAULT_PORT)
    args = parser.parse_args(argv)
    args.chat_output = chat_output_config(parser, args)
    return args


def add_engine_source_arguments(parser: argparse.ArgumentParser) -> None:
    """Redis pool and liveness, and where engines are found without Redis."""
    group = parser.add_argument_group("engine registry")
    index = PrefixIndexConfig()
    group.add_argument("--redis-max-connections", type=int, default=index.max_connections,
                       help="Redis connections this router opens at most; routing decisions "
                            "beyond them wait for one (default: %(default)s)")
    group.add_argument("--redis-pool-timeout", type=float, default=index.pool_timeout_s,
                       help="seconds a routing decision waits for a free Redis connection "
                            "before going without the prefix index (default: %(default)s)")
    group.add_argument("--engine-stale-after", type=float, default=index.stale_after_s,
                       help="seconds since an engine's last heartbeat after which it gets no "
                            "requests (0: no bound; default: %(default)s)")
    group.add_argument("--routing-candidate-window", type=int, default=index.candidate_window,
                       help=f"a fleet of more than {index.full_scan_max_engines} engines is "
                            "looked up by candidates: the holders of the prompt's first block "
                            "plus this many of the least loaded engines (default: "
                            "%(default)s)")
    group.add_argument("--engines", default=None, metavar="HOST:PORT[,HOST:PORT...]",
                       help="engines to route to while Redis is down or not configured")
    group.add_argument("--engine-dns", default=None, metavar="NAME:PORT",
                       help="DNS name resolving to every engine (e.g. a Kubernetes headless "
                            "Service), used while Redis is down or not configured")
    group.add_argument("--engine-dns-refresh", type=float, default=DEFAULT_DNS_REFRESH_S,
                       help="seconds between resolutions of --engine-dns (default: "
                            "%(default)s)")


def add_peer_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """Which names engines' and the tokenizer's certificates must carry (with --tls-*)."""
    group = parser.add_argument_group("peer identity (with --tls-*; docs/tls.md)")
    group.add_argument("--engine-tls-name", default=DEFAULT_ENGINE_NAME,
                       help="name an engine's certificate must carry; {engine_id} is the id "
                            "the engine registered in Redis, so an address Redis names gets "
                            "requests only if its certificate proves that id (default: "
                            "%(default)s)")
    group.add_argument("--tokenizer-tls-name", default=TOKENIZER_ROLE,
                       help="name the tokenizer's certificate must carry (default: "
                            "%(default)s)")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    options = start_service_process(args)
    if options is None:
        return 2
    try:
        config = RouterConfig.from_args(args)
        policy = load_tenant_policy(config)  # a bad policy fails the start, not a request
        http_options = HttpOptions.from_args(args)
        config.redis_access.check()
        if config.tls is not None:
            TlsMaterial.load(config.tls)  # unreadable files fail the start, not a request
    except (ValueError, OSError) as e:
        logger.error("bad configuration: %s", e)
        return 2
    tracing = init_tracing("kvfleet-router")
    try:
        return event_loop.run(
            serve(config, options, policy, http_options), options.event_loop
        )
    finally:
        tracing.shutdown()


if __name__ == "__main__":
    sys.exit(main())
