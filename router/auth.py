"""API keys -> tenants: who is calling, and therefore whose prefix cache a request may use.

Role: the tenant is the request's `cache_salt`, so tenants never share KV blocks (a prefix hit
across tenants would leak another tenant's prompt through timing). Keys come from a file
parsed once at start (`load_api_keys`); a request presents its key in gRPC metadata as
`authorization: Bearer KEY` or `x-api-key: KEY`.

Key file (JSON, or YAML when the name ends in .yaml/.yml), either or both sections:

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
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ANONYMOUS_TENANT = "anonymous"
BEARER_PREFIX = "bearer "


class AuthenticationError(Exception):
    """The request carries no valid API key (gRPC UNAUTHENTICATED)."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


@dataclass(frozen=True)
class Authenticator:
    """Maps a request's metadata to its tenant; `enabled=False` means everyone is anonymous."""

    enabled: bool = False
    tenant_by_digest: Mapping[bytes, str] = field(default_factory=dict)

    @classmethod
    def from_keys(cls, keys: Mapping[str, str]) -> Authenticator:
        return cls(True, {_digest(key): tenant for key, tenant in keys.items()})

    @property
    def num_keys(self) -> int:
        return len(self.tenant_by_digest)

    def tenant_for(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
        """The caller's tenant; AuthenticationError when auth is on and the key is bad."""
        if not self.enabled:
            return ANONYMOUS_TENANT
        key = api_key_from_metadata(metadata or ())
        if key is None:
            raise AuthenticationError(
                "missing API key: send metadata 'authorization: Bearer <key>' or 'x-api-key'"
            )
        tenant = self.tenant_by_digest.get(_digest(key))
        if tenant is None:
            raise AuthenticationError("invalid API key")
        return tenant


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


def load_api_keys(path: str | Path) -> Authenticator:
    """Parse a key file (module docstring); ValueError says what is wrong with it."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    data = _parse(text, path)
    if not isinstance(data, dict) or not ({"tenants", "keys"} & data.keys()):
        raise ValueError(f"{path}: expected a mapping with 'tenants' and/or 'keys'")
    keys: dict[str, str] = {}
    for tenant, tenant_keys in _mapping(data.get("tenants"), path, "tenants").items():
        if not isinstance(tenant_keys, list) or not tenant_keys:
            raise ValueError(f"{path}: tenants.{tenant} must be a non-empty list of keys")
        for key in tenant_keys:
            _add_key(keys, key, str(tenant), path)
    for key, tenant in _mapping(data.get("keys"), path, "keys").items():
        _add_key(keys, key, tenant, path)
    return Authenticator.from_keys(keys)


def _parse(text: str, path: Path) -> Any:
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml  # only key files in YAML need PyYAML

        return yaml.safe_load(text)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from e


def _mapping(value: Any, path: Path, name: str) -> dict[Any, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{path}: '{name}' must be a mapping")
    return value


def _add_key(keys: dict[str, str], key: Any, tenant: Any, path: Path) -> None:
    if not isinstance(key, str) or not key.strip():
        raise ValueError(f"{path}: API keys must be non-empty strings")
    if not isinstance(tenant, str) or not tenant:
        raise ValueError(f"{path}: the tenant of a key must be a non-empty string")
    key = key.strip()
    if keys.get(key, tenant) != tenant:
        raise ValueError(f"{path}: a key is listed for two tenants ({keys[key]}, {tenant})")
    keys[key] = tenant
