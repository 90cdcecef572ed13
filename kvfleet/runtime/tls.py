"""TLS between kvfleet's services: the shared flags, the certificates read once, gRPC credentials.

Role: every service takes `--tls-cert-file --tls-key-file --tls-ca-file` (see
kvfleet.runtime.options); `TlsFiles` names them, `TlsMaterial.load` reads them once at start.
A server then listens with `server_credentials` (engines and tokenizers require a client
certificate from the fleet's CA: mutual TLS; the router's front door does not, its clients
authenticate with API keys), and a client dials with `channel_credentials` (its own
certificate, and the CA it trusts for the peer's).

Identity: a certificate from the fleet's CA proves "a service of this fleet"; the name it
is checked against says which one. The router dials an engine under the name the engine
claims in Redis (`--engine-tls-name`, default `{engine_id}`), through
`grpc.ssl_target_name_override`, so gRPC's own handshake refuses a peer whose certificate
was not issued by the CA *or* does not carry that name in its SANs. gRPC sends no request
(no header, so no router secret) before the handshake succeeded: an address planted in
Redis gets a failed handshake and nothing else (`is_handshake_failure` tells the router's
logs so).

Role names, in every service certificate `kvfleet up` issues and the chart's certificates:
`kvfleet-engine`, `kvfleet-tokenizer`, `kvfleet-router`. A router polling engines it found
by address (no id yet: --engines, --engine-dns) verifies `kvfleet-engine`.

Rotation: certificates are read at start; a rolling restart picks new ones up (the chart
rolls pods when its Secret changes).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

ENGINE_ROLE = "kvfleet-engine"
TOKENIZER_ROLE = "kvfleet-tokenizer"
ROUTER_ROLE = "kvfleet-router"
DEFAULT_ENGINE_NAME = "{engine_id}"
# Phrases of gRPC's status details for a TLS handshake that failed on our side's checks.
_HANDSHAKE_MARKERS = ("ssl", "handshake", "certificate", "verification", "tls")


@dataclass(frozen=True)
class TlsFiles:
    cert_file: Path
    key_file: Path
    ca_file: Path

    @classmethod
    def from_flags(cls, cert: Path | None, key: Path | None, ca: Path | None) -> TlsFiles | None:
        """None when no flag is given; ValueError when only some are."""
        given = [f for f in (cert, key, ca) if f is not None]
        if not given:
            return None
        if cert is None or key is None or ca is None:
            raise ValueError("TLS needs --tls-cert-file, --tls-key-file and --tls-ca-file "
                             "together (this service's certificate and key, the fleet's CA)")
        return cls(cert, key, ca)


@dataclass(frozen=True)
class TlsMaterial:
    """PEM bytes of a service's certificate chain, key and the fleet CA."""

    cert: bytes
    key: bytes = field(repr=False)
    ca: bytes

    @classmethod
    def load(cls, files: TlsFiles) -> TlsMaterial:
        """Read the three files; ValueError naming one that cannot be read or is not PEM."""
        return cls(_pem(files.cert_file, "certificate"), _pem(files.key_file, "key"),
                   _pem(files.ca_file, "certificate"))

    def server_credentials(self, require_client_auth: bool) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca,
            require_client_auth=require_client_auth,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


def name_options(name: str) -> tuple[tuple[str, str], ...]:
    """Channel options making gRPC verify the peer's certificate against `name`."""
    return (("grpc.ssl_target_name_override", name),)


def engine_name(template: str, engine_id: str | None) -> str:
    """The name an engine's certificate must carry: `template` with its id, or the engine
    role when the id is not known yet (a poll by address)."""
    if "{engine_id}" not in template:
        return template
    return ENGINE_ROLE if engine_id is None else template.replace("{engine_id}", engine_id)


def is_handshake_failure(details: str | None) -> bool:
    """Whether a failed call's details say the TLS handshake (peer verification) failed."""
    text = (details or "").lower()
    return any(marker in text for marker in _HANDSHAKE_MARKERS)


def _pem(path: Path, kind: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{path}: cannot read the TLS {kind}: {e}") from e
    if b"-----BEGIN" not in data:
        raise ValueError(f"{path}: not a PEM file (TLS {kind})")
    return data


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("TLS (docs/tls.md)")
    group.add_argument("--tls-cert-file", type=Path, default=None,
                       help="this service's certificate (PEM), issued by the fleet's CA; with "
                            "--tls-key-file and --tls-ca-file, gRPC is served and dialed over "
                            "mutual TLS (default: plaintext)")
    group.add_argument("--tls-key-file", type=Path, default=None,
                       help="the private key of --tls-cert-file (PEM)")
    group.add_argument("--tls-ca-file", type=Path, default=None,
                       help="the fleet's CA certificate (PEM): peers must present one it issued")


@dataclass(frozen=True)
class ClientTls:
    """How a client dials peers over TLS: its credentials (certificate, key, the CA) and
    the name peers' certificates must carry (for engines, a template with `{engine_id}`)."""

    credentials: grpc.ChannelCredentials
    name: str


def aio_channel(
    address: str, tls: ClientTls | None, name: str | None = None,
    options: tuple[tuple[str, Any], ...] = (),
) -> grpc.aio.Channel:
    """A channel to `address`: plaintext without `tls`, else TLS verifying `name` (default:
    `tls.name`)."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(
        address, tls.credentials, options=(*options, *name_options(name or tls.name))
    )
