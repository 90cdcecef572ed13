"""The secrets a local fleet creates and hands to its services as files, never on command lines.

Role: `FleetCredentials.create` writes, under the run directory:
- `router-secret` (0600): what engines require of routers (kvfleet.runtime.service_auth);
- `redis-password` (0600): the fleet's own Redis requires it of every client (NOAUTH
  otherwise); services get `--redis-password-file`, since argv is readable by every local user;
- with TLS, `tls/`: a throwaway CA and each service's certificate (kvfleet.fleet_tls).
`remove()` deletes the secrets and keys when the fleet stops (logs are kept).

The flags each service gets are methods here, so the command lines in
kvfleet.fleet_config stay free of secrets.
"""

from __future__ import annotations

import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvfleet.fleet_tls import FleetCertificates, issue_fleet_certificates
from kvfleet.runtime.tls import ENGINE_ROLE, ROUTER_ROLE, TOKENIZER_ROLE, TlsFiles, TlsMaterial

TOKENIZER = "tokenizer"
ROUTER = "router"
# The launcher's own client certificate: its health checks reach engines and tokenizers,
# which require one.
LAUNCHER = "launcher"


@dataclass(frozen=True)
class FleetCredentials:
    directory: Path
    certificates: FleetCertificates | None

    @classmethod
    def create(cls, directory: Path, engine_ids: list[str], tls: bool,
               host: str) -> FleetCredentials:
        _write_private(directory / "router-secret", secrets.token_urlsafe(32))
        _write_private(directory / "redis-password", secrets.token_hex(24))
        certificates = None
        if tls:
            names = {TOKENIZER: [TOKENIZER_ROLE], ROUTER: [ROUTER_ROLE], LAUNCHER: []}
            names.update({engine: [ENGINE_ROLE] for engine in engine_ids})
            certificates = issue_fleet_certificates(directory / "tls", names, host)
        return cls(directory, certificates)

    @property
    def router_secret_file(self) -> Path:
        return self.directory / "router-secret"

    @property
    def redis_password_file(self) -> Path:
        return self.directory / "redis-password"

    @property
    def redis_password(self) -> str:
        return self.redis_password_file.read_text(encoding="utf-8").strip()

    def tls_flags(self, name: str) -> list[str]:
        """Service `name`'s --tls-* flags (none without TLS)."""
        return [] if self.certificates is None else self.certificates.flags(name)

    def router_http_flags(self) -> list[str]:
        """HTTPS on the router's OpenAI API, with the router's certificate."""
        if self.certificates is None:
            return []
        cert = self.certificates.services[ROUTER]
        return ["--ssl-certfile", str(cert.cert_file), "--ssl-keyfile", str(cert.key_file)]

    @property
    def ca_file(self) -> Path | None:
        return None if self.certificates is None else self.certificates.ca_file

    def launcher_credentials(self) -> grpc.ChannelCredentials | None:
        """What the launcher's health checks dial with (None: plaintext)."""
        if self.certificates is None:
            return None
        cert = self.certificates.services[LAUNCHER]
        files = TlsFiles(cert.cert_file, cert.key_file, self.certificates.ca_file)
        return TlsMaterial.load(files).channel_credentials()

    def remove(self) -> None:
        """Delete the secrets and keys (the fleet stopped)."""
        self.router_secret_file.unlink(missing_ok=True)
        self.redis_password_file.unlink(missing_ok=True)
        shutil.rmtree(self.directory / "tls", ignore_errors=True)


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text)
