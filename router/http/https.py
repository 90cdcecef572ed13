"""HTTPS for the router's OpenAI API: vLLM's flags, parsed once into the settings uvicorn takes.

Role: `--ssl-keyfile/--ssl-certfile` (both or neither) turn the HTTP API into HTTPS;
`--ssl-ca-certs` with `--ssl-cert-reqs` (0 none, 1 optional, 2 required, Python's
ssl.CERT_* values, as vLLM and uvicorn) asks clients for certificates from that CA. The
files are checked at start, so a typo fails the start rather than the first connection.
"""

from __future__ import annotations

import argparse
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class HttpsOptions:
    certfile: Path
    keyfile: Path
    ca_certs: Path | None = None
    cert_reqs: int = ssl.CERT_NONE

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> HttpsOptions | None:
        """None without --ssl-certfile/--ssl-keyfile; ValueError for half a pair or a
        missing file."""
        if args.ssl_certfile is None and args.ssl_keyfile is None:
            if args.ssl_ca_certs is not None:
                raise ValueError("--ssl-ca-certs needs --ssl-certfile and --ssl-keyfile")
            return None
        if args.ssl_certfile is None or args.ssl_keyfile is None:
            raise ValueError("HTTPS needs both --ssl-certfile and --ssl-keyfile")
        for path in (args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs):
            if path is not None and not path.is_file():
                raise ValueError(f"{path}: no such file (HTTPS)")
        if args.ssl_cert_reqs != ssl.CERT_NONE and args.ssl_ca_certs is None:
            raise ValueError("--ssl-cert-reqs needs --ssl-ca-certs (the CA of client "
                             "certificates)")
        return cls(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs, args.ssl_cert_reqs)

    def uvicorn_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"ssl_certfile": str(self.certfile),
                                  "ssl_keyfile": str(self.keyfile),
                                  "ssl_cert_reqs": self.cert_reqs}
        if self.ca_certs is not None:
            kwargs["ssl_ca_certs"] = str(self.ca_certs)
        return kwargs


def _cert_reqs(value: str) -> int:
    number = int(value)
    if number not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
        raise argparse.ArgumentTypeError(f"must be 0, 1 or 2, got {value}")
    return number


def add_https_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("HTTPS (OpenAI API; vLLM's flags, docs/tls.md)")
    group.add_argument("--ssl-certfile", type=Path, default=None,
                       help="certificate (PEM) of the HTTP API; with --ssl-keyfile it serves "
                            "HTTPS (default: plain HTTP)")
    group.add_argument("--ssl-keyfile", type=Path, default=None,
                       help="private key (PEM) of --ssl-certfile")
    group.add_argument("--ssl-ca-certs", type=Path, default=None,
                       help="CA certificates (PEM) that client certificates must chain to")
    group.add_argument("--ssl-cert-reqs", type=_cert_reqs, default=ssl.CERT_NONE,
                       help="whether clients must present a certificate: 0 no, 1 optional, "
                            "2 required (default: %(default)s)")
