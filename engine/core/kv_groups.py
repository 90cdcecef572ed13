"""How the layers of a hybrid model (sliding-window + full attention) share KV memory.

Role: the plan behind sliding-window KV freeing (vLLM's hybrid KV cache manager). Layers are
split into KV groups of equal size: group 0 holds the full-attention layers, groups 1.. hold
the sliding-window layers, `group_size` at a time (the last sliding group may be smaller).
Every group has its own block table per request, all drawn from one block pool, and the
device holds only `group_size` KV tensors: tensor `slot` is shared by the `slot`-th layer of
every group. A block id therefore names `group_size` layers' worth of memory, and a request
pays for its full-attention blocks plus, per sliding group, only the blocks inside the window.

Invariants:
- `layer_group[l]` and `layer_slot[l]` place every layer; no two layers of one group share a
  slot, so two block tables never write the same memory through the same block id unless the
  block pool handed that id to both (it never does while either holds it).
- A plan exists only for models with both kinds of layers, one window for all sliding layers,
  and no more full layers than sliding ones; anything else keeps one group (every layer keeps
  every block), which is the layout without a plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroupLayout:
    window: int  # the sliding layers' window (keys with q - k < window are visible)
    layer_group: tuple[int, ...]  # per layer: its KV group (0: full attention)
    layer_slot: tuple[int, ...]  # per layer: the shared KV tensor it reads and writes
    group_size: int  # KV tensors on the device (layers per group)

    @property
    def num_groups(self) -> int:
        return max(self.layer_group) + 1

    @property
    def num_sliding_groups(self) -> int:
        return self.num_groups - 1


def plan_kv_groups(windows: Sequence[int | None]) -> KVGroupLayout | None:
    """The hybrid layout for layers with these windows (None: full attention), or None."""
    full = [i for i, w in enumerate(windows) if w is None]
    sliding = [i for i, w in enumerate(windows) if w is not None]
    if not full or not sliding or len(full) > len(sliding):
        return None
    if len({windows[i] for i in sliding}) != 1:
        return None
    window = windows[sliding[0]]
    assert window is not None
    size = len(full)
    group = [0] * len(windows)
    slot = [0] * len(windows)
    for rank, layer in enumerate(full):
        slot[layer] = rank
    for rank, layer in enumerate(sliding):
        group[layer] = 1 + rank // size
        slot[layer] = rank % size
    return KVGroupLayout(window, tuple(group), tuple(slot), size)
