"""API keys -> tenants: who is calling, and therefore whose prefix cache a request may use.

Role: the tenant is the request's `cache_salt`, so tenants never share KV blocks (a prefix hit
across tenants would leak another tenant's prompt through timing). A request presents its
key in gRPC metadata as `authorization: Bearer KEY` or `x-api-key: KEY`. Keys come from the
tenant policy file (`router.tenancy.tenant_policy`, docs/tenants.md); its simplest form is the key
file, either or both sections:

    {"tenants": {"acme": ["sk-acme-1", "sk-acme-2"]}, "keys": {"sk-solo": "solo"}}

Invariants:
- Auth off (no key file): every request is tenant `ANONYMOUS_TENANT`; keys sent are ignored.
- Auth on: a missing or unknown key raises `AuthenticationError` (UNAUTHENTICATED); nothing
  else about the request is looked at first.
- Keys are held only as SHA-256 digests, so a memory dump or a log line never shows them, and
  a lookup's timing depends on the digest, not on how much of a real key was guessed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvfleet.contracts.errors import UnauthenticatedError

ANONYMOUS_TENANT = "anonymous"
BEARER_PREFIX = "bearer "


class AuthenticationError(UnauthenticatedError):
    """The request carries no valid API key (gRPC UNAUTHENTICATED, HTTP 401)."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


@dataclass(frozen=True)
class Authenticator:
    """Maps a request's metadata to its tenant; `enabled=False` means everyone is anonymous."""

    enabled: bool = False
    tenant_by_digest: Mapping[bytes, str] = field(default_factory=dict)
    # Keys marked `admin: true` in the policy file (digests too).
    admin_digests: frozenset[bytes] = frozenset()

    @classmethod
    def from_keys(
        cls, keys: Mapping[str, str], admin_keys: Iterable[str] = ()
    ) -> Authenticator:
        return cls(True, {_digest(key): tenant for key, tenant in keys.items()},
                   frozenset(_digest(key) for key in admin_keys))

    @property
    def num_keys(self) -> int:
        return len(self.tenant_by_digest)

    def tenant_for(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
        """The caller's tenant; AuthenticationError when auth is on and the key is bad."""
        return self.caller(metadata)[0]

    def caller(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> tuple[str, bool]:
        """(tenant, whether the key itself is an admin key); AuthenticationError as above."""
        if not self.enabled:
            return ANONYMOUS_TENANT, False
        key = api_key_from_metadata(metadata or ())
        if key is None:
            raise AuthenticationError(
                "missing API key: send metadata 'authorization: Bearer <key>' or 'x-api-key'"
            )
        digest = _digest(key)
        tenant = self.tenant_by_digest.get(digest)
        if tenant is None:
            raise AuthenticationError("invalid API key")
        return tenant, digest in self.admin_digests


def api_key_from_metadata(metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
    """The key from `authorization: Bearer K` (preferred) or `x-api-key: K`."""
    bearer: str | None = None
    header_key: str | None = None
    for name, raw in metadata:
        value = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        lowered = name.lower()
        if lowered == "authorization" and value.lower().startswith(BEARER_PREFIX):
            bearer = value[len(BEARER_PREFIX) :].strip()
        elif lowered == "x-api-key":
            header_key = value.strip()
    return bearer or header_key or None
