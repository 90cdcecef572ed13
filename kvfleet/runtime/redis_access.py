"""How a service reaches Redis: its URL, credentials from files, and TLS, parsed once at start.

Role: routers and engines both talk to Redis; `add_redis_access_arguments` puts the same
flags on both (`--redis-username`, `--redis-password-file`, `--redis-ca-file`) and
`RedisAccess.from_args` reads the files once into a frozen config whose `client_kwargs()`
every redis-py client of the service is built with (the password file is read then, once
per client at start; `check()` reads it up front so a bad file fails the start early).

Why files and not the URL alone: a password in `--redis-url` would sit in the process's
command line, which every local user can read in /proc and `ps`; `kvfleet up` and the Helm
chart therefore pass it as a file (0600 / a Secret volume). A URL with credentials
(`redis://user:pass@host:6379/0`) still works for deployments that keep it out of argv
themselves (e.g. a Secret-backed file the chart expands), but not together with a
password file: two sources for one password is a mistake, refused at start.

`rediss://` URLs connect over TLS; `--redis-ca-file` is the CA that signed Redis's
certificate (default: the system's trust store). The server name is always verified.

Invariants: nothing is read at import; a missing or empty password file fails the start
with ValueError naming the file; the password is never held in config (nothing to leak in a
logged repr) and never appears in a log line (`describe`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from redis.connection import parse_url


@dataclass(frozen=True)
class RedisAccess:
    """Credentials and TLS settings for one service's Redis clients (URL kept apart)."""

    username: str | None = None
    password_file: Path | None = None
    ca_file: Path | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RedisAccess:
        """ValueError when the URL carries a password and a password file gives another."""
        if args.redis_password_file is not None and args.redis_url and parse_url(
                args.redis_url).get("password"):
            raise ValueError("--redis-url carries a password and --redis-password-file "
                             "gives another: use one")
        return cls(username=args.redis_username, password_file=args.redis_password_file,
                   ca_file=args.redis_ca_file)

    def check(self) -> None:
        """ValueError now, naming the file, when the password or CA file cannot be read."""
        if self.password_file is not None:
            read_password(self.password_file)
        if self.ca_file is not None and not self.ca_file.is_file():
            raise ValueError(f"{self.ca_file}: no such file (--redis-ca-file)")

    def client_kwargs(self, url: str) -> dict[str, Any]:
        """Keyword arguments for redis-py's `from_url(url, ...)` (reads the password file)."""
        kwargs: dict[str, Any] = {}
        if self.password_file is not None:
            kwargs["password"] = read_password(self.password_file)
        if self.username is not None:
            kwargs["username"] = self.username
        if url.startswith("rediss://") and self.ca_file is not None:
            kwargs["ssl_ca_certs"] = str(self.ca_file)
        return kwargs


NO_ACCESS = RedisAccess()


def read_password(path: str | Path) -> str:
    """The password in `path` (one line, stripped); ValueError when unreadable or empty."""
    try:
        password = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read the Redis password: {e}") from e
    if not password:
        raise ValueError(f"{path}: the Redis password file is empty")
    return password


def describe(url: str) -> str:
    """`url` for logs: any password replaced by ***."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def add_redis_access_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("redis access")
    group.add_argument("--redis-username", default=None,
                       help="Redis ACL user (a user in --redis-url takes precedence)")
    group.add_argument("--redis-password-file", type=Path, default=None,
                       help="file holding the Redis password (kept out of the command line; "
                            "kvfleet up and the Helm chart create it)")
    group.add_argument("--redis-ca-file", type=Path, default=None,
                       help="CA certificate that signed Redis's (rediss:// URLs; default: "
                            "the system's trust store)")
