"""Pure-Python engine core: requests, the block pool, the KV cache manager and the scheduler.

Nothing here imports torch, so every invariant is unit-testable on tiny configs.
"""
