"""Block copies between the device KV pool and the host KV buffer, planned per step.

Role: the scheduler-side record of what must be copied before the next forward pass. The KV
manager adds pairs while it schedules (swap-out, eviction to the host tier, swap-in, host-tier
reload); `LLMEngine.step` takes the plan once per step and hands it to the torch side
(`engine.kv_tiers.offload.HostKVBuffer`), which issues one batched copy per layer per direction.

Host block ids are global over one host buffer: swap space first, then the host tier
(`HostLayout`), so one plan covers both pools.

Invariants:
- All device-to-host copies of a step run before its host-to-device copies, and both before
  the forward pass: a device block freed (swapped out, evicted) and handed out again in the same
  step is read before anyone writes it.
- A host block read by this step's host-to-device copies is not written by this step's
  device-to-host copies: host blocks freed or pinned while planning are released only by
  `take()` (deferred release), after the plan is complete.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class HostLayout:
    """Sizes of the two host pools; swap ids are [0, num_swap), tier ids follow."""

    num_swap_blocks: int = 0
    num_tier_blocks: int = 0

    @property
    def num_blocks(self) -> int:
        return self.num_swap_blocks + self.num_tier_blocks

    @property
    def tier_offset(self) -> int:
        return self.num_swap_blocks


@dataclass(frozen=True)
class TransferPlan:
    """One step's copies: (device id, host id) pairs per direction, in planning order."""

    to_host_device_ids: tuple[int, ...] = ()
    to_host_host_ids: tuple[int, ...] = ()
    to_device_host_ids: tuple[int, ...] = ()
    to_device_device_ids: tuple[int, ...] = ()
    # Of the to-host copies, how many are swap-outs (the rest: host-tier writes); of the
    # to-device ones, how many are swap-ins (the rest: host-tier reloads). For metrics.
    num_swap_out: int = 0
    num_swap_in: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.to_host_device_ids) + len(self.to_device_host_ids)


@dataclass
class TransferQueue:
    """Collects a step's copies and the host releases that must wait for them."""

    _to_host: list[tuple[int, int]] = field(default_factory=list)
    _to_device: list[tuple[int, int]] = field(default_factory=list)
    _num_swap_out: int = 0
    _num_swap_in: int = 0
    _deferred: list[Callable[[], None]] = field(default_factory=list)

    def copy_to_host(self, device_id: int, host_id: int, *, swap: bool) -> None:
        self._to_host.append((device_id, host_id))
        self._num_swap_out += swap

    def copy_to_device(self, host_id: int, device_id: int, *, swap: bool) -> None:
        self._to_device.append((host_id, device_id))
        self._num_swap_in += swap

    def defer(self, release: Callable[[], None]) -> None:
        """Run `release` when the plan is taken (host blocks this step still reads)."""
        self._deferred.append(release)

    def __bool__(self) -> bool:
        return bool(self._to_host or self._to_device or self._deferred)

    def take(self) -> TransferPlan:
        plan = TransferPlan(
            to_host_device_ids=tuple(d for d, _ in self._to_host),
            to_host_host_ids=tuple(h for _, h in self._to_host),
            to_device_host_ids=tuple(h for h, _ in self._to_device),
            to_device_device_ids=tuple(d for _, d in self._to_device),
            num_swap_out=self._num_swap_out,
            num_swap_in=self._num_swap_in,
        )
        deferred = self._deferred
        self._to_host, self._to_device, self._deferred = [], [], []
        self._num_swap_out = self._num_swap_in = 0
        for release in deferred:
            release()
        return plan
