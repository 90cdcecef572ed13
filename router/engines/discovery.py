"""Engine addresses without Redis: a static list and/or a DNS name that resolves to every engine.

Role: where the router looks for engines when Redis is down or not configured
(`--engines host:port,...`, `--engine-dns NAME:PORT`, e.g. a Kubernetes headless Service,
whose name resolves to the IP of every ready engine pod). It only yields addresses; each
engine's id, model and load come from its own GetLoad RPC (`router.engines.pool`).

Invariants:
- Resolution is lazy and periodic: the DNS name is resolved again when the last answer is
  older than `dns_refresh_s`, by one lookup shared by every concurrent caller, bounded by
  `dns_timeout_s`; between refreshes callers get the cached answer at no cost.
- A failed resolution keeps the last good answer (engines do not vanish because DNS
  hiccuped) and is logged once per failure streak, not per request.
- Addresses come out as host:port with IPv6 literals bracketed, sorted, without duplicates.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvfleet.runtime.grpc_server import format_address

logger = logging.getLogger(__name__)

DEFAULT_DNS_REFRESH_S = 5.0
DEFAULT_DNS_TIMEOUT_S = 2.0


def parse_address(text: str, flag: str) -> tuple[str, int]:
    """host:port or [v6]:port -> (host, port); ValueError naming `flag` otherwise."""
    host, sep, port = text.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{flag}: expected HOST:PORT, got {text!r}")
    return host, int(port)


@dataclass(frozen=True)
class DiscoveryConfig:
    """Where engines are found without Redis (router flags --engines, --engine-dns)."""

    static_addresses: tuple[str, ...] = ()
    # NAME:PORT; None: no DNS discovery.
    dns: str | None = None
    dns_refresh_s: float = DEFAULT_DNS_REFRESH_S
    dns_timeout_s: float = DEFAULT_DNS_TIMEOUT_S

    def __post_init__(self) -> None:
        for address in self.static_addresses:
            parse_address(address, "--engines")
        if self.dns is not None:
            parse_address(self.dns, "--engine-dns")
        if self.dns_refresh_s <= 0 or self.dns_timeout_s <= 0:
            raise ValueError("--engine-dns-refresh and the DNS timeout must be positive")

    @classmethod
    def from_flags(cls, engines: str | None, dns: str | None, dns_refresh_s: float
                   ) -> DiscoveryConfig:
        """From `--engines a:1,b:2` (empty entries ignored) and `--engine-dns NAME:PORT`."""
        static = tuple(a.strip() for a in (engines or "").split(",") if a.strip())
        return cls(static, dns or None, dns_refresh_s)

    @property
    def enabled(self) -> bool:
        return bool(self.static_addresses) or self.dns is not None


class EngineDiscovery:
    """The engine addresses known without Redis; see the module docstring."""

    def __init__(
        self, config: DiscoveryConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self._clock = clock
        self._static = [format_address(*parse_address(a, "--engines"))
                        for a in config.static_addresses]
        self._resolved: list[str] = []
        self._resolve_after = 0.0
        self._resolving: asyncio.Future[None] | None = None
        self._failing = False

    async def addresses(self) -> list[str]:
        """Static addresses plus the DNS name's current records (refreshed when due)."""
        dns = self.config.dns
        if dns is not None and self._resolving is None and self._clock() >= self._resolve_after:
            self._resolving = asyncio.ensure_future(self._resolve(dns))
            self._resolving.add_done_callback(self._resolution_done)
        if self._resolving is not None:
            # Shielded: one caller giving up must not cancel the others' lookup.
            await asyncio.shield(self._resolving)
        return sorted(set(self._static) | set(self._resolved))

    def _resolution_done(self, resolving: asyncio.Future[None]) -> None:
        self._resolving = None
        if not resolving.cancelled() and resolving.exception() is not None:
            logger.error("engine DNS resolution failed", exc_info=resolving.exception())

    async def _resolve(self, dns: str) -> None:
        host, port = parse_address(dns, "--engine-dns")
        self._resolve_after = self._clock() + self.config.dns_refresh_s
        try:
            infos = await asyncio.wait_for(
                asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM),
                self.config.dns_timeout_s,
            )
        except (OSError, TimeoutError) as e:
            if not self._failing:
                logger.warning("could not resolve engine DNS name %s (%s); keeping %d "
                               "address(es) from before", dns, e or "timeout",
                               len(self._resolved))
            self._failing = True
            return
        if self._failing:
            logger.info("engine DNS name %s resolves again", dns)
        self._failing = False
        self._resolved = _addresses(infos, port)


def _addresses(
    infos: Sequence[tuple[object, object, object, object, tuple[object, ...]]], port: int
) -> list[str]:
    return sorted({format_address(str(info[4][0]), port) for info in infos})
