"""Run the tokenizer service: `kvfleet serve tokenizer --model DIR --port N`
(or `python -m tokenizer_svc.server --model DIR --port N`).

Role: process entry point. Loads the tokenizer once, hosts `TokenizerServicer` on a
`kvfleet.grpc_server.GrpcServer` (health, reflection, error mapping, graceful drain) and
serves until SIGTERM/SIGINT; exits 0 after a graceful shutdown.

Invariants: configuration comes from arguments only (no environment reads); the port file,
when asked for, is written only after the server accepts RPCs, so its existence means ready.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from kvfleet.grpc_server import DEFAULT_GRACE_S, GrpcServer, ShutdownHook, write_port_file
from kvfleet.options import ServerOptions, add_server_arguments, configure_logging
from tokenizer_svc.service import TokenizerServicer

logger = logging.getLogger(__name__)

DEFAULT_PORT = 50051


async def serve(
    model_dir: str | Path,
    host: str = "0.0.0.0",
    port: int = 0,
    *,
    model_name: str | None = None,
    grace_s: float | None = None,
    port_file: str | Path | None = None,
    on_shutdown: ShutdownHook | None = None,
) -> int:
    """Serve the tokenizer of `model_dir` until SIGTERM/SIGINT; returns the exit code.

    Must run on the main thread (signal handlers). Embedders that manage the lifecycle
    themselves use `build_server` instead.
    """
    server = build_server(model_dir, host, port, model_name=model_name, grace_s=grace_s)
    bound_port = await server.start()
    if port_file is not None:
        write_port_file(port_file, bound_port)
    return await server.serve_until_signal(on_shutdown)


def build_server(
    model_dir: str | Path,
    host: str = "0.0.0.0",
    port: int = 0,
    *,
    model_name: str | None = None,
    grace_s: float | None = None,
) -> GrpcServer:
    """A not-yet-started server hosting the tokenizer of `model_dir`."""
    servicer = TokenizerServicer.from_model_dir(model_dir, model_name)
    return GrpcServer(
        [servicer.as_service()],
        host=host,
        port=port,
        grace_s=DEFAULT_GRACE_S if grace_s is None else grace_s,
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
    add_server_arguments(parser, default_port=DEFAULT_PORT)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    options = ServerOptions.from_args(args)
    configure_logging(options.log_level)
    if not (args.model / "tokenizer.json").is_file():
        logger.error("%s has no tokenizer.json", args.model)
        return 2
    return asyncio.run(
        serve(
            args.model,
            options.host,
            options.port,
            model_name=args.served_model_name,
            grace_s=options.grace_s,
            port_file=options.port_file,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
