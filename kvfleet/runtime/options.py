"""Command-line options every kvfleet server shares, parsed once into a frozen dataclass.

Role: `add_server_arguments` puts --host/--port/--grace-period/--port-file/--log-level and
--metrics-port/--metrics-port-file/--no-metrics (Prometheus /metrics, on by default on
port 9090, like vLLM's always-on /metrics) on a service's argparse parser, with
--log-format (text | json lines, see kvfleet.runtime.logs) and --event-loop
(kvfleet.runtime.event_loop), and --tls-cert-file/--tls-key-file/--tls-ca-file
(kvfleet.runtime.tls: gRPC over mutual TLS);
`ServerOptions.from_args` turns them into config. The only environment read (when a
service starts, never on import) is the logging fallback: KVFLEET_LOG_LEVEL /
KVFLEET_LOG_FORMAT when --log-level / --log-format are not given.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from kvfleet.runtime import logs
from kvfleet.runtime.arg_types import non_negative_float, port
from kvfleet.runtime.event_loop import EVENT_LOOPS, loop_factory
from kvfleet.runtime.grpc_server import DEFAULT_GRACE_S
from kvfleet.runtime.tls import TlsFiles, add_tls_arguments

LOG_FORMAT = logs.TEXT_FORMAT
# Prometheus' conventional exporter port; the Helm chart's metrics.port.
DEFAULT_METRICS_PORT = 9090


@dataclass(frozen=True)
class ServerOptions:
    host: str = "0.0.0.0"
    # 0: pick a free port (see port_file to learn which).
    port: int = 0
    grace_s: float = DEFAULT_GRACE_S
    # Written atomically with the bound port once the server accepts RPCs.
    port_file: Path | None = None
    log_level: str = "INFO"
    log_format: str = "text"
    # Prometheus /metrics port; None: no endpoint, 0: a free port (see metrics_port_file).
    # None here (embedders opt in); the command line's default is DEFAULT_METRICS_PORT.
    metrics_port: int | None = None
    metrics_port_file: Path | None = None
    # The port was not asked for: if it is taken (several services on one host), a free
    # one is used and logged rather than failing the service.
    metrics_port_fallback: bool = False
    # kvfleet.runtime.event_loop: uvloop when installed ("auto"), or the one named.
    event_loop: str = "auto"
    # This service's certificate, key and the fleet CA; None: plaintext gRPC.
    tls: TlsFiles | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerOptions:
        return cls(
            host=args.host,
            port=args.port,
            grace_s=args.grace_period,
            port_file=args.port_file,
            log_level=resolve_log_level(args.log_level),
            log_format=resolve_log_format(args.log_format),
            metrics_port=None if args.no_metrics else (
                DEFAULT_METRICS_PORT if args.metrics_port is None else args.metrics_port
            ),
            metrics_port_file=args.metrics_port_file,
            metrics_port_fallback=args.metrics_port is None,
            event_loop=_event_loop(args.event_loop),
            tls=TlsFiles.from_flags(args.tls_cert_file, args.tls_key_file, args.tls_ca_file),
        )


def _event_loop(kind: str) -> str:
    """`kind`, once it is known to be runnable here (ValueError: uvloop asked for, missing)."""
    loop_factory(kind)
    return kind


def add_server_arguments(parser: argparse.ArgumentParser, default_port: int = 0) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="0.0.0.0", help="address to bind (default: %(default)s)")
    group.add_argument(
        "--port", type=port, default=default_port, help="port to bind; 0 picks a free one"
    )
    group.add_argument(
        "--grace-period",
        type=non_negative_float,
        default=DEFAULT_GRACE_S,
        help="seconds in-flight RPCs get to finish on SIGTERM (default: %(default)s)",
    )
    group.add_argument(
        "--port-file", type=Path, default=None, help="write the bound port to this file"
    )
    group.add_argument(
        "--log-level",
        default=None,
        choices=list(logs.LOG_LEVELS),
        help="default: $KVFLEET_LOG_LEVEL, else INFO",
    )
    group.add_argument(
        "--log-format",
        default=None,
        choices=list(logs.LOG_FORMATS),
        help="text, or JSON lines with request_id/tenant/trace_id "
        "(default: $KVFLEET_LOG_FORMAT, else text)",
    )
    group.add_argument(
        "--metrics-port",
        type=port,
        default=None,
        help=f"serve Prometheus /metrics on this port (0 picks a free one; default: "
        f"{DEFAULT_METRICS_PORT}, or a free one if that is taken)",
    )
    group.add_argument(
        "--no-metrics", action="store_true", help="do not serve /metrics",
    )
    group.add_argument(
        "--metrics-port-file",
        type=Path,
        default=None,
        help="write the bound metrics port to this file",
    )
    group.add_argument(
        "--event-loop",
        default="auto",
        choices=list(EVENT_LOOPS),
        help="the event loop to serve on, as uvicorn's --loop: auto is uvloop when "
        "installed, else asyncio (default: %(default)s)",
    )
    add_tls_arguments(parser)


def resolve_log_level(flag: str | None) -> str:
    """--log-level, else $KVFLEET_LOG_LEVEL, else INFO; ValueError for a bad value."""
    level = (flag or os.environ.get("KVFLEET_LOG_LEVEL") or "INFO").strip().upper()
    if level not in logs.LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(logs.LOG_LEVELS)}, got {level!r}")
    return level


def resolve_log_format(flag: str | None) -> str:
    """--log-format, else $KVFLEET_LOG_FORMAT, else text; ValueError for a bad value."""
    fmt = (flag or os.environ.get("KVFLEET_LOG_FORMAT") or "text").strip().lower()
    if fmt not in logs.LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(logs.LOG_FORMATS)}, got {fmt!r}")
    return fmt


def configure_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Process-wide logging for a service's main (never called on import)."""
    logs.configure_logging(level, fmt)


def start_service_process(args: argparse.Namespace) -> ServerOptions | None:
    """A service main's first step: parse the shared flags and set up logging.

    Returns None (after printing why) on a bad value, e.g. in $KVFLEET_LOG_*; the main then
    exits with status 2.
    """
    try:
        options = ServerOptions.from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    configure_logging(options.log_level, options.log_format)
    return options
