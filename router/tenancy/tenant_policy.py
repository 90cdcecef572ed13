"""The tenant policy file: API keys -> tenants, and what each tenant may do.

Role: `load_policy(path)` parses one JSON or YAML file into a frozen `TenantPolicy`: the
`Authenticator` (keys -> tenant) and every tenant's `TenantLimits`, with `defaults` for
tenants (and keys) that do not say. `router.tenancy.policy_reload` re-reads it while the router
runs. The format is documented in docs/tenants.md; in short:

    defaults: {requests_per_second: 5, tokens_per_minute: 60000, max_concurrent_requests: 8}
    tenants:
      acme:
        keys: [sk-acme-1]
        tokens_per_minute: 200000
        priority: {min: 0, max: 10, default: 5}
        weight: 2
      legacy: [sk-legacy-1]          # the old key-file form: keys only, defaults apply
      ops: {keys: [sk-ops-1], admin: true}   # may change the fleet (runtime LoRA updates)
      mixed: {keys: [sk-m-1, {key: sk-m-admin, admin: true}]}   # one admin key
    keys: {sk-solo: solo}            # the old key-file form, too

Invariants:
- Every key file that loaded before (`{"tenants": {t: [keys]}, "keys": {k: t}}`) still
  loads, with the same tenants, and its tenants get `defaults` (built-in: no rate limits,
  priorities >= 0).
- A bad file is refused whole, with a message naming the file, the line and the field
  (`policy.yaml:7: tenants.acme.weight: must be a number > 0, got -1`); unknown fields are
  refused too, so a misspelt limit never silently means "unlimited".
- Limits are None for "no limit"; numbers are validated once here, so enforcement code
  never re-checks them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from router.tenancy.api_keys import ANONYMOUS_TENANT, Authenticator
from router.tenancy.config_file import FieldPath, Locator, read_document

INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)


@dataclass(frozen=True)
class PriorityRange:
    """Priorities a tenant may ask for (lower runs first) and the one it gets by default."""

    # Built-in: any priority that does not jump ahead of the default 0.
    min: int = 0
    max: int = INT32_MAX
    default: int = 0

    def clamp(self, requested: int | None) -> int:
        if requested is None:
            return self.default
        return max(self.min, min(self.max, requested))


@dataclass(frozen=True)
class TenantLimits:
    """One tenant's limits; None means no limit."""

    requests_per_second: float | None = None
    # Requests allowed at once after an idle spell; default max(1, ceil(requests_per_second)).
    request_burst: int | None = None
    # Prompt + generated tokens per minute (OpenAI's TPM); a full minute may come at once.
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    # Prompts x n in one request (each is an engine request); None: the router's --max-choices.
    max_choices: int | None = None
    # Largest max_tokens a request may ask for, and what an unset max_tokens becomes.
    max_tokens: int | None = None
    default_max_tokens: int | None = None
    priority: PriorityRange = field(default_factory=PriorityRange)
    # Fair-share weight inside each engine: twice the weight, twice the tokens when busy.
    weight: float = 1.0
    # Served model names this tenant may use; None: all.
    models: frozenset[str] | None = None

    @property
    def burst(self) -> int | None:
        if self.requests_per_second is None:
            return None
        if self.request_burst is not None:
            return self.request_burst
        return max(1, math.ceil(self.requests_per_second))

    @property
    def rate_limited(self) -> bool:
        return (self.requests_per_second is not None or self.tokens_per_minute is not None
                or self.max_concurrent_requests is not None)


@dataclass(frozen=True)
class Tenant:
    name: str
    limits: TenantLimits
    # May change the fleet (docs/security.md): its tenant or its key is `admin: true`, or
    # auth is off (no policy file: nobody is told apart, as in vLLM).
    admin: bool = False


@dataclass(frozen=True)
class TenantPolicy:
    auth: Authenticator = field(default_factory=Authenticator)
    defaults: TenantLimits = field(default_factory=TenantLimits)
    tenants: Mapping[str, TenantLimits] = field(default_factory=dict)
    admin_tenants: frozenset[str] = frozenset()

    def identify(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Tenant:
        """The caller's tenant and limits; AuthenticationError for a bad or missing key."""
        name, admin_key = self.auth.caller(metadata)
        admin = admin_key or name in self.admin_tenants or not self.auth.enabled
        return Tenant(name, self.limits_of(name), admin)

    def limits_of(self, name: str) -> TenantLimits:
        return self.tenants.get(name, self.defaults)

    @property
    def tenant_names(self) -> list[str]:
        return sorted(self.tenants) if self.auth.enabled else [ANONYMOUS_TENANT]


_TOP_LEVEL = ("defaults", "tenants", "keys")
_LIMIT_FIELDS = {f.name for f in fields(TenantLimits)}
_PRIORITY_FIELDS = ("min", "max", "default")


def load_policy(path: str | Path) -> TenantPolicy:
    """Parse a policy (or plain key) file; ConfigFileError (a ValueError) says what and where."""
    data, where = read_document(Path(path))
    if not isinstance(data, dict) or not data or not set(data) <= set(_TOP_LEVEL):
        unknown = sorted(set(data) - set(_TOP_LEVEL)) if isinstance(data, dict) else []
        raise where.error(
            (str(unknown[0]),) if unknown else (),
            "expected a mapping with 'tenants', 'keys' and/or 'defaults'"
            + (" (unknown field)" if unknown else ""),
        )
    defaults = _limits(data.get("defaults") or {}, TenantLimits(), ("defaults",), where)
    keys: dict[str, str] = {}
    admin_keys: set[str] = set()
    admin_tenants: set[str] = set()
    tenants: dict[str, TenantLimits] = {}
    for name, entry in _mapping(data.get("tenants"), ("tenants",), where).items():
        at: FieldPath = ("tenants", str(name))
        if not isinstance(name, str) or not name:
            raise where.error(at, "a tenant name must be a non-empty string")
        if isinstance(entry, list):  # the key-file form
            entry = {"keys": entry}
        if not isinstance(entry, dict):
            raise where.error(at, "must be a list of keys or a mapping with 'keys' and limits")
        entry = dict(entry)
        tenant_keys = entry.pop("keys", None)
        if not isinstance(tenant_keys, list) or not tenant_keys:
            raise where.error((*at, "keys"), "must be a non-empty list of keys")
        if _admin_flag(entry.pop("admin", False), (*at, "admin"), where):
            admin_tenants.add(name)
        for index, key in enumerate(tenant_keys):
            key_at = (*at, "keys", str(index))
            key, admin = _key_entry(key, key_at, where)
            _add_key(keys, key, name, key_at, where)
            if admin:
                admin_keys.add(key.strip())
        tenants[name] = _limits(entry, defaults, at, where)
    for key, name in _mapping(data.get("keys"), ("keys",), where).items():
        _add_key(keys, key, name, ("keys", str(key)), where)
        tenants.setdefault(name, defaults)
    auth = Authenticator.from_keys(keys, admin_keys) if keys else Authenticator()
    return TenantPolicy(auth, defaults, tenants, frozenset(admin_tenants))


def _admin_flag(value: Any, at: FieldPath, where: Locator) -> bool:
    if not isinstance(value, bool):
        raise where.error(at, f"must be true or false, got {value!r}")
    return value


def _key_entry(entry: Any, at: FieldPath, where: Locator) -> tuple[Any, bool]:
    """A key list entry: the key, or {key: K, admin: true} for one admin key."""
    if not isinstance(entry, dict):
        return entry, False
    unknown = sorted(set(entry) - {"key", "admin"})
    if unknown:
        raise where.error((*at, str(unknown[0])), "unknown field; known: key, admin")
    return entry.get("key"), _admin_flag(entry.get("admin", False), (*at, "admin"), where)


def _mapping(value: Any, at: FieldPath, where: Locator) -> dict[Any, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise where.error(at, "must be a mapping")
    return value


def _add_key(keys: dict[str, str], key: Any, tenant: Any, at: FieldPath, where: Locator) -> None:
    if not isinstance(key, str) or not key.strip():
        raise where.error(at, "API keys must be non-empty strings")
    if not isinstance(tenant, str) or not tenant:
        raise where.error(at, "the tenant of a key must be a non-empty string")
    key = key.strip()
    if keys.get(key, tenant) != tenant:
        raise where.error(at, f"a key is listed for two tenants ({keys[key]}, {tenant})")
    keys[key] = tenant


def _limits(entry: Any, base: TenantLimits, at: FieldPath, where: Locator) -> TenantLimits:
    if not isinstance(entry, dict):
        raise where.error(at, "must be a mapping of limits")
    values: dict[str, Any] = {}
    for name, value in entry.items():
        here = (*at, str(name))
        if name not in _LIMIT_FIELDS:
            raise where.error(here, f"unknown field; known: {', '.join(sorted(_LIMIT_FIELDS))}")
        values[name] = _field_value(str(name), value, base, here, where)
    limits = replace(base, **values)
    if "requests_per_second" in values and "request_burst" not in values:
        limits = replace(limits, request_burst=None)  # re-derived from the new rate
    cap, default = limits.max_tokens, limits.default_max_tokens
    if cap is not None and default is not None and default > cap:
        raise where.error((*at, "default_max_tokens"),
                          f"must be at most max_tokens ({cap}), got {default}")
    return limits


def _field_value(name: str, value: Any, base: TenantLimits, at: FieldPath,
                 where: Locator) -> Any:
    if name == "priority":
        return _priority(value, base.priority, at, where)
    if name == "models":
        if value is None:
            return None
        if (not isinstance(value, list) or not value
                or not all(isinstance(m, str) and m for m in value)):
            raise where.error(at, "must be a non-empty list of model names (or null: all)")
        return frozenset(value)
    if name in ("requests_per_second", "weight"):
        if value is None and name != "weight":
            return None
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or not math.isfinite(value) or value <= 0):
            raise where.error(at, f"must be a number > 0{'' if name == 'weight' else ' or null'}"
                              f", got {value!r}")
        return float(value)
    return _count(value, at, where)


def _count(value: Any, at: FieldPath, where: Locator) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= INT32_MAX:
        raise where.error(at, f"must be an integer in [1, {INT32_MAX}] or null, got {value!r}")
    return value


def _priority(value: Any, base: PriorityRange, at: FieldPath, where: Locator) -> PriorityRange:
    if not isinstance(value, dict):
        raise where.error(at, "must be a mapping with min, max and/or default")
    numbers: dict[str, int] = {}
    for name, number in value.items():
        if name not in _PRIORITY_FIELDS:
            raise where.error((*at, str(name)), "unknown field; known: min, max, default")
        if (isinstance(number, bool) or not isinstance(number, int)
                or not INT32_MIN <= number <= INT32_MAX):
            raise where.error((*at, str(name)), f"must be a 32-bit integer, got {number!r}")
        numbers[name] = number
    low, high = numbers.get("min", base.min), numbers.get("max", base.max)
    if low > high:
        raise where.error(at, f"min ({low}) is above max ({high})")
    default = numbers.get("default", min(high, max(low, base.default)))
    if not low <= default <= high:
        raise where.error((*at, "default"), f"must be within [{low}, {high}], got {default}")
    return PriorityRange(low, high, default)


def load_api_keys(path: str | Path) -> Authenticator:
    """The keys of a key or policy file; ValueError says what is wrong."""
    return load_policy(path).auth
