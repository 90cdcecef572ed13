"""Triton kernels for the GPU engine; on CPU they run under Triton's interpreter (tests).

One module per kernel, each with the launch wrapper and a PyTorch reference it is tested
against: `kv_write` (new K/V rows into the paged cache through `slot_mapping`),
`unified_attention` (the whole flattened mixed batch — prefill chunks with earlier context
and decodes — in one launch), `rms_norm` (with the fused residual add), `rotary`
(rotate-half RoPE from a cos/sin table, llama3 scaling included) and `silu_and_mul`.

Invariant: importing this package imports no kernel module. `@triton.jit` decides at
decoration time whether a kernel is compiled or interpreted, so the engine first chooses the
mode from its config (`kernels.triton.runtime.load`) and only then imports the kernels.
"""
