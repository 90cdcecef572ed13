"""Multi-LoRA: PEFT adapters on the base model, many of them mixed in one batch.

- `request`: `LoRARequest(lora_name, lora_int_id, lora_path)`, vLLM's offline handle.
- `peft_adapter`: reads and validates a PEFT directory into per-layer, per-projection weights
  laid out for our fused qkv / gate_up projections.
- `registry`: which adapters the engine knows (by name), a CPU LRU of loaded weights
  (`max_cpu_loras`) and the block-hash key of each adapter.
- `slots`: the `max_loras` compute slots (stacked A/B buffers per layer) and the step's
  per-token slot map.
- `ops` (+ kernels/triton/lora.py): the segmented shrink/expand delta for the flat batch.
- `layers`: the wrapper that adds the delta to a projection; installed only with LoRA on,
  so the base path is untouched otherwise.
- `admission`: the scheduler's rule that a step holds at most `max_loras` adapters.
"""
