"""Engine configuration: one frozen dataclass, validated once at start-up.

Field names and defaults follow vLLM's engine arguments so that a vLLM user's flags carry over.
Values that depend on the model (max_model_len, the number of KV blocks) are resolved by the
engine when it loads the model; see `engine.llm_engine`.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_KV_CACHE_MEMORY_BYTES = 1 << 30  # like vLLM's CPU default order of magnitude


@dataclass(frozen=True)
class EngineConfig:
    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # "auto": the compiled CPU decode-attention kernel when it builds, else PyTorch;
    # "torch": always the PyTorch path; "kernel": the kernel or fail.
    attention_backend: str = "auto"
    # CPU GEMM path of every projection and the LM head: "auto" times the candidates on this
    # machine at start-up (engine.models.gemm_select); "onednn", "mkl" or "dense" force one.
    linear_backend: str = "auto"
    # Order among tenants (cache salts): "fair" (weighted fair share, engine.core.fair_share)
    # or "fcfs" (priority, then arrival, whoever the tenant).
    scheduling_policy: str = "fair"

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(
                f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.attention_backend not in ("auto", "torch", "kernel"):
            raise ValueError(
                f"attention_backend must be auto, torch or kernel; got {self.attention_backend!r}"
            )
        if self.scheduling_policy not in ("fair", "fcfs"):
            raise ValueError(
                f"scheduling_policy must be fair or fcfs; got {self.scheduling_policy!r}"
            )
        if self.linear_backend not in ("auto", "onednn", "mkl", "dense"):
            raise ValueError(
                "linear_backend must be auto, onednn, mkl or dense; "
                f"got {self.linear_backend!r}"
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}"
            )
