"""Hot reload of the tenant policy file: the router's current `TenantPolicy`, always valid.

Role: `PolicyStore.current` is what every request reads (one attribute read, no lock: a
`TenantPolicy` is frozen and replaced whole). `run()` polls the file every
`interval_s` and swaps in a new policy when its bytes changed and it parses; `check()`
does one poll (tests call it directly). Kubernetes updates a mounted ConfigMap or Secret
by swapping a symlink, which a stat of the path follows, so polling catches it.

Invariants:
- A file that fails to load (bad YAML, a bad field, missing) never replaces the current
  policy: the router keeps enforcing the last good one, logs the error naming the line and
  field, and counts `kvfleet:router_policy_reloads{outcome="error"}`. The start is
  different: `router.server` refuses to start on a bad file.
- Requests already admitted keep the limits they were admitted under; the next request
  sees the new policy.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from pathlib import Path

from router.tenancy.tenant_policy import TenantPolicy, load_policy

logger = logging.getLogger(__name__)

DEFAULT_RELOAD_INTERVAL_S = 2.0


class PolicyStore:
    def __init__(
        self,
        policy: TenantPolicy,
        path: Path | None = None,
        interval_s: float = DEFAULT_RELOAD_INTERVAL_S,
        on_reload: Callable[[str], None] | None = None,
    ) -> None:
        self.current = policy
        self.path = path
        self.interval_s = interval_s
        self._on_reload = on_reload
        self._digest = _digest(path) if path is not None else None

    @classmethod
    def open(cls) -> PolicyStore:
        """No file: auth off, no limits (tenant 'anonymous')."""
        return cls(TenantPolicy())

    def check(self) -> bool:
        """Reload if the file changed and parses; True when a new policy was taken."""
        if self.path is None:
            return False
        digest = _digest(self.path)
        if digest == self._digest:
            return False
        self._digest = digest  # a bad version is reported once, not every poll
        try:
            policy = load_policy(self.path)
        except (ValueError, OSError) as e:
            logger.error("tenant policy not reloaded, keeping the previous one: %s", e)
            self._count("error")
            return False
        self.current = policy
        logger.info("tenant policy reloaded from %s: %d tenants, %d keys", self.path,
                    len(policy.tenants), policy.auth.num_keys)
        self._count("ok")
        return True

    async def run(self) -> None:
        """Poll until cancelled."""
        if self.path is None or self.interval_s <= 0:
            return
        while True:
            await asyncio.sleep(self.interval_s)
            # Parsing is quick for any sane file; a thread keeps a huge one off the loop.
            await asyncio.to_thread(self.check)

    def _count(self, outcome: str) -> None:
        if self._on_reload is not None:
            self._on_reload(outcome)


def _digest(path: Path) -> bytes | None:
    try:
        return hashlib.sha256(path.read_bytes()).digest()
    except OSError:
        return None
