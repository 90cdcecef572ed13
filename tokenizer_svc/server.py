"""Run the tokenizer service: `kvfleet serve tokenizer --model DIR --port N`
(or `python -m tokenizer_svc.server --model DIR --port N`).

Role: process entry point. Loads the tokenizer once, hosts `TokenizerServicer` on a
`kvfleet.runtime.grpc_server.GrpcServer` (health, reflection, error mapping, graceful drain) and
serves until SIGTERM/SIGINT; exits 0 after a graceful shutdown.

Invariants: configuration comes from arguments only (no environment reads); the port file,
when asked for, is written only after the server accepts RPCs, so its existence means ready.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry

from kvfleet.runtime import event_loop
from kvfleet.runtime.grpc_server import DEFAULT_GRACE_S, GrpcServer, ShutdownHook, write_port_file
from kvfleet.runtime.metrics import RpcMetrics, RpcMetricsInterceptor, start_metrics_endpoint
from kvfleet.runtime.options import add_server_arguments, start_service_process
from kvfleet.runtime.tls import TlsMaterial
from kvfleet.runtime.tracing import init_tracing
from kvfleet.text.chat_template import resolve_chat_template
from tokenizer_svc.service import TokenizerServicer

logger = logging.getLogger(__name__)

DEFAULT_PORT = 50051
TOKENIZER_METRICS_PREFIX = "kvfleet:tokenizer"


async def serve(
    model_dir: str | Path,
    host: str = "0.0.0.0",
    port: int = 0,
    *,
    model_name: str | None = None,
    chat_template: str | None = None,
    allow_special_tokens: bool = False,
    grace_s: float | None = None,
    port_file: str | Path | None = None,
    on_shutdown: ShutdownHook | None = None,
    metrics_port: int | None = None,
    metrics_port_file: Path | None = None,
    metrics_port_fallback: bool = False,
    credentials: grpc.ServerCredentials | None = None,
) -> int:
    """Serve the tokenizer of `model_dir` until SIGTERM/SIGINT; returns the exit code.

    Must run on the main thread (signal handlers). Embedders that manage the lifecycle
    themselves use `build_server` instead.
    """
    registry = CollectorRegistry()
    server = build_server(
        model_dir, host, port, model_name=model_name, chat_template=chat_template,
        allow_special_tokens=allow_special_tokens, grace_s=grace_s, registry=registry,
        credentials=credentials,
    )
    bound_port = await server.start()
    endpoint = start_metrics_endpoint(
        registry, host, metrics_port, metrics_port_file, fallback=metrics_port_fallback
    )
    if port_file is not None:
        write_port_file(port_file, bound_port)
    try:
        return await server.serve_until_signal(on_shutdown)
    finally:
        if endpoint is not None:
            endpoint.close()


def build_server(
    model_dir: str | Path,
    host: str = "0.0.0.0",
    port: int = 0,
    *,
    model_name: str | None = None,
    chat_template: str | None = None,
    allow_special_tokens: bool = False,
    grace_s: float | None = None,
    registry: CollectorRegistry | None = None,
    credentials: grpc.ServerCredentials | None = None,
) -> GrpcServer:
    """A not-yet-started server hosting the tokenizer of `model_dir`.

    Its RPCs are counted and timed in `registry` (kvfleet:tokenizer_requests{method,code},
    kvfleet:tokenizer_request_duration_seconds{method}); a private one when None.
    With `credentials`, it serves TLS only (kvfleet.runtime.tls).
    """
    servicer = TokenizerServicer.from_model_dir(model_dir, model_name, chat_template,
                                                allow_special_tokens)
    metrics = RpcMetrics(registry or CollectorRegistry(), TOKENIZER_METRICS_PREFIX)
    return GrpcServer(
        [servicer.as_service()],
        host=host,
        port=port,
        grace_s=DEFAULT_GRACE_S if grace_s is None else grace_s,
        interceptors=[RpcMetricsInterceptor(metrics)],
        credentials=credentials,
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="kvfleet serve tokenizer",
        description="Serve a model's tokenizer over gRPC (kvfleet.v1.Tokenizer).",
    )
    parser.add_argument(
        "--model", required=True, type=Path, help="Hugging Face model directory (tokenizer.json)"
    )
    parser.add_argument(
        "--served-model-name", default=None, help="model name to report (default: dir name)"
    )
    parser.add_argument(
        "--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
        help="Jinja chat template, a file or the template itself (default: the model's own)",
    )
    parser.add_argument(
        "--allow-special-tokens-in-prompts", action="store_true",
        help="parse special-token strings (e.g. <|im_end|>) in text prompts and chat message "
             "contents as control tokens, as vLLM does (default: plain text; the chat "
             "template's own stay special; docs/security.md)",
    )
    add_server_arguments(parser, default_port=DEFAULT_PORT)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    options = start_service_process(args)
    if options is None:
        return 2
    if not (args.model / "tokenizer.json").is_file():
        logger.error("%s has no tokenizer.json", args.model)
        return 2
    try:
        chat_template = (
            None if args.chat_template is None else resolve_chat_template(args.chat_template)
        )
        # Mutual TLS: only callers with a fleet certificate (the routers) get past the handshake.
        credentials = None if options.tls is None else (
            TlsMaterial.load(options.tls).server_credentials(require_client_auth=True))
    except (ValueError, OSError) as e:
        logger.error("%s", e)
        return 2
    tracing = init_tracing("kvfleet-tokenizer")
    try:
        return event_loop.run(
            serve(
                args.model,
                options.host,
                options.port,
                model_name=args.served_model_name,
                chat_template=chat_template,
                allow_special_tokens=args.allow_special_tokens_in_prompts,
                grace_s=options.grace_s,
                port_file=options.port_file,
                metrics_port=options.metrics_port,
                metrics_port_file=options.metrics_port_file,
                metrics_port_fallback=options.metrics_port_fallback,
                credentials=credentials,
            ),
            options.event_loop,
        )
    finally:
        tracing.shutdown()


if __name__ == "__main__":
    sys.exit(main())
