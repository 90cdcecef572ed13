"""KV memory tiers below the device's block pool: host memory and swap.

- `host_tier`: an LRU of evicted prefix blocks in host memory, looked up before recompute.
- `swap_space`: preempted requests' blocks swapped out and back (vLLM's swap preemption).
- `transfer`: the copies between device blocks and host slots.
- `offload`: the engine-side glue that runs those copies around a step.
- `flags`: the service flags that turn them on and size them.

Invariant: a tier never changes what a request computes, only whether a block is copied back
or recomputed (tests/engine/test_kv_tiers_exactness.py).
"""
