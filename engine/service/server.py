"""Run an engine: `python -m engine.service.server --model DIR --engine-id ID --redis-url URL`.

Role: process entry point. `EngineServer` wires the parts: `LLMEngine` (model + KV cache) →
`AsyncEngine` (step thread) → `EngineServicer` on a `kvfleet.runtime.grpc_server.GrpcServer`
(health, reflection, error mapping, drain) and a `RedisPublisher` (registry, load, block
index). Engine flags carry vLLM's names.

Start-up order: model loaded, engine thread running, gRPC bound, then Redis registration
with the advertised host and the *bound* port (so port 0 works), then the port file: its
existence means ready. Redis being down does not stop the engine from serving.

Health: SERVING while the step loop advances; `step_watchdog` reports NOT_SERVING while it
is stalled with work in flight (`--watchdog-timeout`), and for good once the engine thread
died (the engine then also deregisters from Redis). A stalled engine refuses new requests
with UNAVAILABLE, so routers try another engine.

Shutdown (SIGTERM/SIGINT): health NOT_SERVING and new work refused, deregistration from
Redis runs while in-flight streams finish within the grace period, the server stops, the
engine thread stops, exit 0.

Invariants: configuration comes from arguments only (no environment reads).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import socket
import sys
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc.aio
from redis.connection import parse_url

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.disagg.grpc_connector import GrpcKVConnector
from engine.disagg.metrics import TransferMetrics
from engine.disagg.role_flags import add_role_scheduling_argument, role_scheduling_config
from engine.disagg.shm_connector import KV_TRANSFER_MODES, SameHostKVConnector
from engine.kv_tiers.flags import add_kv_tier_arguments, kv_tier_config
from engine.lora.request import LoRARequest
from engine.service.async_engine import AsyncEngine
from engine.service.engine_thread import EngineThread
from engine.service.lora_flags import (
    add_lora_arguments,
    lora_config,
    lora_modules,
    lora_roots,
)
from engine.service.metrics import EngineMetrics
from engine.service.redis_publisher import EngineRegistration, RedisPublisher, validate_engine_id
from engine.service.scheduling_flags import add_scheduling_arguments, scheduling_config
from engine.service.servicer import EngineIdentity, EngineServicer
from engine.service.step_watchdog import DEFAULT_TIMEOUT_S as DEFAULT_WATCHDOG_TIMEOUT_S
from engine.service.step_watchdog import StepWatchdog
from engine.spec_decode.spec_config import speculative_config_arg
from kvfleet.contracts.adapter_paths import AdapterRoots
from kvfleet.contracts.redis_schema import ROLE_BOTH, ROLES
from kvfleet.runtime import event_loop
from kvfleet.runtime.arg_types import positive_int, seconds
from kvfleet.runtime.grpc_server import GrpcServer, format_address, write_port_file
from kvfleet.runtime.metrics import MetricsEndpoint, start_metrics_endpoint
from kvfleet.runtime.options import ServerOptions, add_server_arguments, start_service_process
from kvfleet.runtime.redis_access import NO_ACCESS, RedisAccess, add_redis_access_arguments
from kvfleet.runtime.service_auth import (
    RouterCredentialInterceptor,
    credential_metadata,
    read_secret,
)
from kvfleet.runtime.tls import ENGINE_ROLE, ClientTls, TlsMaterial
from kvfleet.runtime.tracing import init_tracing

logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_PORT = 50052
DEFAULT_MAX_CONCURRENT_REQUESTS = 512
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


@dataclass(frozen=True)
class EngineServerOptions:
    engine: EngineConfig
    engine_id: str
    redis_url: str
    server: ServerOptions
    # Name routers match requests against; default: the model directory's name.
    model_name: str | None = None
    # Host written to Redis for routers to dial; default: --host, or this machine's
    # hostname when --host is a wildcard address.
    advertise_host: str | None = None
    # Requests in flight beyond which new ones get RESOURCE_EXHAUSTED (TGI's flag).
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS
    # Seconds the step loop may go without a new iteration, with work in flight, before
    # health turns NOT_SERVING (0: never; a dead engine thread always does).
    watchdog_timeout_s: float = DEFAULT_WATCHDOG_TIMEOUT_S
    # File of the secret routers must present (kvfleet.runtime.service_auth), read at start; None:
    # anyone may call.
    router_secret_file: Path | None = None
    # Adapters served from the start (--lora-modules), loaded before registering.
    lora_modules: tuple[LoRARequest, ...] = ()
    # Redis credentials and TLS (read from their files at start).
    redis_access: RedisAccess = NO_ACCESS
    # --lora-allowed-dirs: where LoadLoRAAdapter may read adapters from (none: anywhere).
    lora_roots: AdapterRoots = field(default_factory=AdapterRoots)
    # Prefill/decode disaggregation (docs/disaggregation.md): what routers send here.
    role: str = ROLE_BOTH
    # How KV is pushed to decode engines: auto (shared memory on one host, else gRPC), shm,
    # grpc (engine.disagg.shm_connector).
    kv_transfer: str = "auto"

    def advertised_address(self, port: int) -> str:
        host = self.advertise_host or self.server.host
        if host in WILDCARD_HOSTS:
            host = socket.gethostname()
        return format_address(host, port)


class EngineServer:
    """One engine process's parts, started and stopped in the right order."""

    def __init__(self, options: EngineServerOptions, engine: LLMEngine | None = None) -> None:
        validate_engine_id(options.engine_id)
        self.options = options
        self.epoch = uuid.uuid4().hex
        self._llm_engine = engine
        self._async_engine: AsyncEngine | None = None
        self._grpc: GrpcServer | None = None
        self._connector: SameHostKVConnector | None = None
        self._publisher: RedisPublisher | None = None
        self._metrics: EngineMetrics | None = None
        self._metrics_endpoint: MetricsEndpoint | None = None
        self._watchdog: StepWatchdog | None = None

    @property
    def metrics(self) -> EngineMetrics:
        if self._metrics is None:
            raise RuntimeError("engine server not started")
        return self._metrics

    @property
    def async_engine(self) -> AsyncEngine:
        if self._async_engine is None:
            raise RuntimeError("engine server not started")
        return self._async_engine

    @property
    def grpc_server(self) -> GrpcServer:
        if self._grpc is None:
            raise RuntimeError("engine server not started")
        return self._grpc

    @property
    def publisher(self) -> RedisPublisher:
        if self._publisher is None:
            raise RuntimeError("engine server not started")
        return self._publisher

    async def start(self) -> int:
        """Load the model (off the event loop), serve, register; returns the bound port."""
        options = self.options
        # Model load, adapters and steps all on this one thread (engine.service.engine_thread).
        thread = EngineThread()
        try:
            llm_engine = self._llm_engine
            if llm_engine is None:
                llm_engine = await _on(thread, functools.partial(LLMEngine, options.engine))
                self._llm_engine = llm_engine
            for lora in options.lora_modules:  # ValueError (bad adapter) stops the start
                await _on(thread, functools.partial(llm_engine.add_lora, lora))
            self._async_engine = AsyncEngine(llm_engine, options.max_concurrent_requests)
        except BaseException:
            thread.close()  # nothing will run there: let the thread end
            raise
        model_name = options.model_name or Path(options.engine.model).name
        self._metrics = EngineMetrics(model_name, llm_engine.max_model_len)
        self._metrics.attach(self._async_engine)
        self._async_engine.start(thread)
        identity = EngineIdentity(
            engine_id=options.engine_id,
            model_name=model_name,
            block_size=llm_engine.config.block_size,
            max_model_len=llm_engine.max_model_len,
            epoch=self.epoch,
        )
        async_engine = self._async_engine
        self._watchdog = StepWatchdog(
            lambda: async_engine.progress, options.watchdog_timeout_s,
            self._set_serving, self._on_engine_death,
        )
        secret = (None if options.router_secret_file is None
                  else read_secret(options.router_secret_file))
        # KV pushes to decode engines carry the fleet's engine credential too.
        self._connector = SameHostKVConnector(
            GrpcKVConnector(credential_metadata(secret), _peer_tls(options)),
            options.kv_transfer,
        )
        # Exports gathered straight into the connector's shared-memory segments.
        await asyncio.wrap_future(async_engine.call_in_engine_thread(functools.partial(
            llm_engine.handoff.use_export_memory, self._connector.export_memory())))
        servicer = EngineServicer(
            self._async_engine, identity, self._watchdog.problem, options.lora_roots,
            self._connector,
            TransferMetrics(self._metrics.registry, model_name),
        )
        self._grpc = GrpcServer(
            [servicer.as_service()],
            host=options.server.host,
            port=options.server.port,
            grace_s=options.server.grace_s,
            interceptors=_credential_check(options.router_secret_file),
            # Mutual TLS: only holders of a fleet certificate get past the handshake.
            credentials=None if options.server.tls is None else
            TlsMaterial.load(options.server.tls).server_credentials(require_client_auth=True),
        )
        port = await self._grpc.start()
        registration = EngineRegistration(
            engine_id=options.engine_id,
            address=options.advertised_address(port),
            model=model_name,
            block_size=identity.block_size,
            max_model_len=identity.max_model_len,
            max_num_seqs=llm_engine.config.max_num_seqs,
            max_loras=llm_engine.config.max_loras if llm_engine.config.enable_lora else 0,
            role=options.role,
        )
        self._publisher = RedisPublisher(
            options.redis_url, registration, self._async_engine, epoch=self.epoch,
            access=options.redis_access,
        )
        self._async_engine.add_step_listener(self._publisher.on_step)
        self._publisher.start()
        self._watchdog.start()
        self._metrics_endpoint = start_metrics_endpoint(
            self._metrics.registry,
            options.server.host,
            options.server.metrics_port,
            options.server.metrics_port_file,
            fallback=options.server.metrics_port_fallback,
        )
        if options.server.port_file is not None:
            write_port_file(options.server.port_file, port)
        return port

    async def serve_until_signal(self) -> int:
        """Serve until SIGTERM/SIGINT, then drain and stop (main thread only); exit code."""
        code = await self.grpc_server.serve_until_signal(self._deregister)
        await self._stop_watchdog()
        await self.async_engine.shutdown()
        await self._close_connector()
        self._close_metrics()
        return code

    async def shutdown(self, *, deregister: bool = True) -> None:
        """Graceful stop. deregister=False leaves the Redis keys to expire, like a crash."""
        if deregister:
            await self.grpc_server.shutdown(self._deregister)
        else:
            self.publisher.close()
            await self.grpc_server.shutdown()
        await self._stop_watchdog()
        await self.async_engine.shutdown()
        await self._close_connector()
        self._close_metrics()

    async def _stop_watchdog(self) -> None:
        if self._watchdog is not None:
            await self._watchdog.stop()

    async def _set_serving(self, serving: bool) -> None:
        await self.grpc_server.set_serving(serving)

    async def _on_engine_death(self) -> None:
        # It will never step again: routers must stop picking it (health alone is not
        # what they read).
        await asyncio.to_thread(self.publisher.deregister)

    async def _close_connector(self) -> None:
        if self._connector is not None:  # its kept shared-memory segments go too
            await self._connector.close()
            self._connector = None

    def _close_metrics(self) -> None:
        if self._metrics_endpoint is not None:
            self._metrics_endpoint.close()
            self._metrics_endpoint = None

    async def _deregister(self) -> None:
        logger.info("deregistering from Redis while %d RPC(s) finish",
                    self.grpc_server.in_flight)
        await asyncio.to_thread(self.publisher.deregister)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvfleet serve engine",
        description="Serve a model over gRPC (kvfleet.v1.Engine) and publish to Redis.",
    )
    parser.add_argument("--model", required=True,
                        help="Hugging Face model directory or a GGUF file (docs/quantization.md)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
    parser.add_argument("--served-model-name", default=None, help="default: the model dir name")
    parser.add_argument(
        "--engine-id", required=True, help="stable id of this engine ([A-Za-z0-9._-])"
    )
    parser.add_argument("--redis-url", required=True, help="e.g. redis://127.0.0.1:6379/0")
    parser.add_argument(
        "--advertise-host", default=None, help="host routers dial (default: --host or hostname)"
    )
    add_redis_access_arguments(parser)
    add_server_arguments(parser, default_port=DEFAULT_PORT)
    engine = parser.add_argument_group("engine (vLLM names)")
    engine.add_argument("--dtype", default="auto",
                        choices=["auto", "float32", "bfloat16", "float16"])
    engine.add_argument("--max-model-len", type=positive_int, default=None,
                        help="default: the model's context length")
    engine.add_argument("--block-size", type=positive_int, default=16,
                        help="tokens per KV block; routers must agree (default: %(default)s)")
    engine.add_argument("--num-kv-blocks", type=positive_int, default=None,
                        help="KV cache size in blocks (overrides --kv-cache-memory-bytes)")
    engine.add_argument("--kv-cache-memory-bytes", type=positive_int, default=None,
                        help="KV cache budget in bytes (default: 1 GiB)")
    engine.add_argument("--max-num-seqs", type=positive_int, default=256,
                        help="default: %(default)s")
    engine.add_argument("--max-num-batched-tokens", type=positive_int, default=2048,
                        help="token budget per step (default: %(default)s)")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=True)
    engine.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                        default=True)
    engine.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    engine.add_argument("--device", default="auto",
                        help="auto (CUDA when available), cpu, cuda or cuda:N "
                             "(default: %(default)s)")
    engine.add_argument("--attention-backend", default="auto",
                        choices=["auto", "torch", "cpu_kernel", "kernel", "triton"],
                        help="auto: Triton on CUDA, the C++ kernels (else PyTorch) on CPU; "
                             "triton on CPU runs interpreted (default: %(default)s)")
    engine.add_argument("--speculative-config", type=speculative_config_arg, default=None,
                        help="speculative decoding as a JSON object with vLLM's keys, e.g. "
                             '\'{"method": "ngram", "num_speculative_tokens": 3}\' '
                             "(default: off)")
    engine.add_argument("--quantization", default=None, choices=["int8", "int4", "awq", "gptq"],
                        help="weight-only int8 / int4 of the checkpoint's projections at "
                             "load, or the method of a pre-quantized AWQ / GPTQ checkpoint "
                             "(detected anyway; docs/quantization.md; default: none)")
    engine.add_argument("--linear-backend", default="auto",
                        choices=["auto", "onednn", "mkl", "dense", "panel", "amx"],
                        help="CPU GEMM path; auto measures the candidates at start-up "
                             "(default: %(default)s)")
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="CUDA: fraction of the GPU's memory for weights, activations and "
                             "KV cache (default: %(default)s)")
    engine.add_argument("--enforce-eager", action="store_true",
                        help="CUDA: run decode steps eagerly instead of through CUDA graphs")
    add_kv_tier_arguments(engine)
    add_lora_arguments(parser.add_argument_group("LoRA adapters (vLLM names)"))
    parser.add_argument("--max-concurrent-requests", type=positive_int,
                        default=DEFAULT_MAX_CONCURRENT_REQUESTS,
                        help="requests in flight beyond which new ones are refused with "
                             "RESOURCE_EXHAUSTED (default: %(default)s)")
    parser.add_argument("--watchdog-timeout", type=seconds, default=DEFAULT_WATCHDOG_TIMEOUT_S,
                        help="seconds the step loop may go without a new iteration while it "
                             "has requests before health turns NOT_SERVING and new requests "
                             "are refused; must exceed the longest step (0: off; "
                             "default: %(default)s)")
    parser.add_argument("--router-secret-file", type=Path, default=None,
                        help="file holding the secret routers must present; every Engine RPC "
                             "without it is UNAUTHENTICATED (none: anyone may call)")
    add_scheduling_arguments(parser)
    parser.add_argument("--role", choices=ROLES, default=ROLE_BOTH,
                        help="prefill: routers send it prompts to compute and hand off; "
                             "decode: routers send it handed-off requests and short prompts; "
                             "both: whole requests (docs/disaggregation.md; "
                             "default: %(default)s)")
    add_role_scheduling_argument(parser)
    parser.add_argument("--kv-transfer", choices=KV_TRANSFER_MODES, default="auto",
                        help="how a prefill engine pushes KV: shm through shared memory "
                             "(decode engines on this host), grpc as bytes, auto shm where "
                             "the decode engine can open it, else grpc (default: %(default)s)")
    return parser


def options_from_args(args: argparse.Namespace) -> EngineServerOptions:
    """Config from parsed arguments; ValueError (with a message) when inconsistent."""
    engine = EngineConfig(
        model=args.model,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        seed=args.seed,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        linear_backend=args.linear_backend,
        quantization=args.quantization,
        attention_backend=args.attention_backend,
        device=args.device,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        speculative_config=args.speculative_config,
        **{**kv_tier_config(args),
           # A KV handoff moves one block table per request (engine.disagg).
           **({"disable_hybrid_kv_cache_manager": True} if args.role != ROLE_BOTH else {})},
        **lora_config(args),
        **scheduling_config(args),
        **role_scheduling_config(args),
    )
    parse_url(args.redis_url)  # ValueError now rather than after the model loaded
    return EngineServerOptions(
        engine=engine,
        engine_id=validate_engine_id(args.engine_id),
        redis_url=args.redis_url,
        server=ServerOptions.from_args(args),
        model_name=args.served_model_name,
        advertise_host=args.advertise_host,
        max_concurrent_requests=args.max_concurrent_requests,
        watchdog_timeout_s=args.watchdog_timeout,
        router_secret_file=args.router_secret_file,
        lora_modules=lora_modules(args),
        redis_access=RedisAccess.from_args(args),
        lora_roots=lora_roots(args),
        role=args.role,
        kv_transfer=args.kv_transfer,
    )


def _peer_tls(options: EngineServerOptions) -> ClientTls | None:
    """How this engine dials other engines (the KV push of engine.disagg): its own fleet
    certificate, verifying theirs by the engines' role name."""
    if options.server.tls is None:
        return None
    material = TlsMaterial.load(options.server.tls)
    return ClientTls(material.channel_credentials(), ENGINE_ROLE)


def _credential_check(secret_file: Path | None) -> list[grpc.aio.ServerInterceptor]:
    if secret_file is None:
        logger.warning("no --router-secret-file: this engine accepts calls from anyone, "
                       "including a tenant and cache salt of their choosing")
        return []
    return [RouterCredentialInterceptor(read_secret(secret_file))]


async def _on(thread: EngineThread, fn: Callable[[], T]) -> T:
    return await asyncio.wrap_future(thread.submit(fn))


async def serve(options: EngineServerOptions) -> int:
    server = EngineServer(options)
    await server.start()
    return await server.serve_until_signal()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    server_options = start_service_process(args)
    if server_options is None:
        return 2
    try:
        options = options_from_args(args)
        options.redis_access.check()  # now, not once the model has loaded
        if options.server.tls is not None:
            TlsMaterial.load(options.server.tls)
        tracing = init_tracing("kvfleet-engine")
        try:
            return event_loop.run(serve(options), server_options.event_loop)
        finally:
            tracing.shutdown()
    except ValueError as exc:  # bad flags or model directory: a usage error, not a crash
        logger.error("%s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
