"""Which adapters the engine serves, their weights in host memory, and their cache keys.

- `add(LoRARequest)` validates the adapter (loads it) and serves it under its name; adding a
  name again with the same path is a no-op, with another path an error (unload it first).
- `remove(name)` stops serving the name. Requests already holding the adapter keep running:
  the registry remembers every key's source directory, so its weights can still be read.
- Host memory is an LRU of at most `capacity` (`max_cpu_loras`) loaded adapters; `weights`
  reloads an evicted one from its directory.
- The key is what requests carry as `lora_id`, hence what enters the block hash: the name for
  the first content ever served under that name, `name@<fingerprint>` for other content, so a
  name re-used for different weights can never hit KV computed with the old ones, while the
  router (which hashes with the plain name) still matches the common case.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from pathlib import Path

import torch

from engine.lora.peft_adapter import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    LoRAAdapter,
    load_peft_adapter,
)
from engine.lora.request import LoRARequest
from engine.models.config import ModelConfig


def adapter_fingerprint(path: str) -> str:
    digest = hashlib.blake2b(digest_size=8)
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        digest.update((Path(path) / file).read_bytes())
    return digest.hexdigest()


class LoRARegistry:
    def __init__(
        self, config: ModelConfig, max_lora_rank: int, capacity: int, dtype: torch.dtype
    ) -> None:
        self.config = config
        self.max_lora_rank = max_lora_rank
        self.capacity = capacity
        self.dtype = dtype
        self.served: dict[str, LoRARequest] = {}  # name -> request, in load order
        self._key_of_name: dict[str, str] = {}
        self._source: dict[str, LoRARequest] = {}  # key -> where its weights are
        self._first_fingerprint: dict[str, str] = {}  # name -> first content served
        self._cache: OrderedDict[str, LoRAAdapter] = OrderedDict()

    def add(self, lora: LoRARequest) -> str:
        """Serve `lora` under its name; returns its key. Raises ValueError on a bad adapter
        or a name already served from another path."""
        current = self.served.get(lora.lora_name)
        if current is not None:
            if current.lora_path != lora.lora_path:
                raise ValueError(
                    f"LoRA adapter {lora.lora_name!r} is already loaded from "
                    f"{current.lora_path!r}; unload it before loading {lora.lora_path!r}"
                )
            return self._key_of_name[lora.lora_name]
        adapter = load_peft_adapter(
            lora.lora_name, lora.lora_path, self.config, self.max_lora_rank, self.dtype
        )
        fingerprint = adapter_fingerprint(lora.lora_path)
        first = self._first_fingerprint.setdefault(lora.lora_name, fingerprint)
        key = lora.lora_name if fingerprint == first else f"{lora.lora_name}@{fingerprint}"
        self.served[lora.lora_name] = lora
        self._key_of_name[lora.lora_name] = key
        self._source[key] = lora
        self._remember(key, adapter)
        return key

    def remove(self, name: str) -> bool:
        """Stop serving `name` (False if it was not served); in-flight requests go on."""
        if self.served.pop(name, None) is None:
            return False
        self._key_of_name.pop(name)
        return True

    def key_for(self, name: str) -> str:
        key = self._key_of_name.get(name)
        if key is None:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")
        return key

    def weights(self, key: str) -> LoRAAdapter:
        adapter = self._cache.get(key)
        if adapter is not None:
            self._cache.move_to_end(key)
            return adapter
        source = self._source[key]
        adapter = load_peft_adapter(
            source.lora_name, source.lora_path, self.config, self.max_lora_rank, self.dtype
        )
        self._remember(key, adapter)
        return adapter

    @property
    def cached_keys(self) -> list[str]:
        return list(self._cache)

    def _remember(self, key: str, adapter: LoRAAdapter) -> None:
        self._cache[key] = adapter
        self._cache.move_to_end(key)
        while len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
