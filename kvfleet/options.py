"""Command-line options every kvfleet server shares, parsed once into a frozen dataclass.

Role: `add_server_arguments` puts --host/--port/--grace-period/--port-file/--log-level on a
service's argparse parser; `ServerOptions.from_args` turns them into config. Nothing here
reads the environment: services are configured by their arguments alone.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

from kvfleet.grpc_server import DEFAULT_GRACE_S

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@dataclass(frozen=True)
class ServerOptions:
    host: str = "0.0.0.0"
    # 0: pick a free port (see port_file to learn which).
    port: int = 0
    grace_s: float = DEFAULT_GRACE_S
    # Written atomically with the bound port once the server accepts RPCs.
    port_file: Path | None = None
    log_level: str = "INFO"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerOptions:
        return cls(
            host=args.host,
            port=args.port,
            grace_s=args.grace_period,
            port_file=args.port_file,
            log_level=args.log_level,
        )


def _port(value: str) -> int:
    port = int(value)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {port}")
    return port


def _non_negative(value: str) -> float:
    seconds = float(value)
    if seconds < 0:
        raise argparse.ArgumentTypeError(f"must be non-negative, got {seconds}")
    return seconds


def add_server_arguments(parser: argparse.ArgumentParser, default_port: int = 0) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="0.0.0.0", help="address to bind (default: %(default)s)")
    group.add_argument(
        "--port", type=_port, default=default_port, help="port to bind; 0 picks a free one"
    )
    group.add_argument(
        "--grace-period",
        type=_non_negative,
        default=DEFAULT_GRACE_S,
        help="seconds in-flight RPCs get to finish on SIGTERM (default: %(default)s)",
    )
    group.add_argument(
        "--port-file", type=Path, default=None, help="write the bound port to this file"
    )
    group.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="default: %(default)s",
    )


def configure_logging(level: str) -> None:
    """Process-wide logging for a service's main (never called on import)."""
    logging.basicConfig(level=getattr(logging, level), format=LOG_FORMAT)
