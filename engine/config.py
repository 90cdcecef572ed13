"""Engine configuration: one frozen dataclass, validated once at start-up.

Field names and defaults follow vLLM's engine arguments so that a vLLM user's flags carry over.
Values that depend on the model (max_model_len, the number of KV blocks) are resolved by the
engine when it loads the model; see `engine.core.llm_engine`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from engine.lora.config import validate_lora_args
from engine.spec_decode.spec_config import SpeculativeConfig, parse_speculative_config
from engine.worker.device import validate_device_spec

# EngineConfig.quantization's values (None: the checkpoint as it is).
QUANTIZATION_METHODS = (None, "int8", "int4", "awq", "gptq")
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
    # "auto": Triton on CUDA; on CPU the compiled CPU attention kernels when they build, else
    # PyTorch. "torch": always the PyTorch path; "cpu_kernel" ("kernel" is the same): the CPU
    # kernels or fail (both CPU only); "triton": the Triton kernels (interpreted on CPU: slow,
    # for tests).
    attention_backend: str = "auto"
    # "auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N"; see engine.worker.device.
    device: str = "auto"
    # CUDA only (vLLM's names): the fraction of the GPU's memory this engine may use (weights,
    # peak activations and KV cache; engine.worker.gpu_memory), and whether decode steps run eagerly
    # instead of through captured CUDA graphs (engine.worker.cuda_graphs). Ignored on CPU.
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    # Decode batch sizes captured as CUDA graphs (None: vLLM's list up to max_num_seqs).
    cuda_graph_sizes: tuple[int, ...] | None = None
    # CPU GEMM path of every projection and the LM head: "auto" times the candidates on this
    # machine at start-up (engine.models.gemm_select); "onednn", "mkl" or "dense" force one.
    linear_backend: str = "auto"
    # Weight-only quantization of a Hugging Face checkpoint at load: None, "int8" (the
    # projections as int8 blocks of 32 with an fp16 scale, engine.quant.int8) or "int4"
    # (4-bit blocks of 32 with an fp16 scale and minimum, engine.quant.int4), dequantized
    # inside the GEMM. "awq" / "gptq" name a pre-quantized checkpoint's method (detected from
    # its quantization_config anyway, as vLLM does; naming it checks it). A GGUF model is
    # quantized already and ignores it.
    quantization: str | None = None
    # Order among tenants (cache salts): "fair" (weighted fair share, engine.core.fair_share)
    # or "fcfs" (priority, then arrival, whoever the tenant).
    scheduling_policy: str = "fair"
    # Pause a step between two layers to serve a just-arrived request that fair share ranks
    # ahead, in a complete step of its own (engine.core.urgent_step); needs fair share, CPU, and
    # no LoRA, speculative decoding, KV tiers or decode-step prompt cap (otherwise it stays
    # off, logged at start).
    # On by default: on an idle 2-core machine it took a chatting tenant's p99 TTFT under
    # another tenant's flood from 10.9x to 1.0x its TTFT alone, throughput unchanged.
    preempt_steps_for_new_tenants: bool = True
    # KV memory tiers (engine.kv_tiers.offload). vLLM's names: preemption_mode "recompute", "swap"
    # (move the victim's KV to host swap space) or "auto" (swap victims holding at least
    # swap_min_computed_tokens computed tokens); swap_space in GiB, allocated only when the
    # mode can swap; num_swap_blocks overrides it (tests).
    preemption_mode: str = "recompute"
    # vLLM's name: keep every KV block in every layer. Otherwise (the default) a model with
    # sliding-window layers beside full ones (Gemma 2/3) frees, for its sliding layers, the
    # blocks that left the window (engine.core.kv_groups); it is off by itself with swap,
    # a host tier or CUDA graphs, which handle one block table per request.
    disable_hybrid_kv_cache_manager: bool = False
    swap_space: float = 4.0
    num_swap_blocks: int | None = None
    swap_min_computed_tokens: int = 256
    # Host tier of the prefix cache: evicted cached blocks are kept in this much host memory
    # (GiB; None or 0 = off) and reloaded on a later hit. num_host_kv_blocks overrides it.
    kv_offloading_size: float | None = None
    num_host_kv_blocks: int | None = None
    # Multi-LoRA (engine.lora), vLLM's names: adapters of one base model mixed in one batch;
    # max_loras per step (compute slots), ranks up to max_lora_rank, max_cpu_loras loaded
    # adapters kept in host memory (LRU; default max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # In a step that also decodes, prompts get at most this many tokens between them, so the
    # step stays near decode size (engine.core.decode_prefill_cap). None or 0: no cap; the
    # engine server sets it for --role decode.
    max_prefill_tokens_per_decode_step: int | None = None
    # vLLM's names (engine.core.long_prefill_limit): while waiting requests follow a prefix
    # that a step computes, the step starts at most max_long_partial_prefills prompts with
    # more than long_prefill_token_threshold tokens to compute (0: 4% of max_model_len),
    # and short prompts go first. None or 0: no limit.
    max_long_partial_prefills: int | None = None
    long_prefill_token_threshold: int = 0
    # A step that admits short prompts starts no long prompt (it starts a step later), so
    # the short ones' first tokens do not wait for its compute; off by default.
    short_prefill_steps: bool = False
    # Speculative decoding (engine.spec_decode): vLLM's speculative_config; a dict or a JSON
    # string is parsed (and validated) into a SpeculativeConfig here.
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        raw: object = self.speculative_config
        if isinstance(raw, (Mapping, str)):
            object.__setattr__(self, "speculative_config", parse_speculative_config(raw))
        elif raw is not None and not isinstance(raw, SpeculativeConfig):
            raise ValueError(
                f"speculative_config must be a dict or JSON object, got {type(raw).__name__}"
            )
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
        cap = self.max_prefill_tokens_per_decode_step
        if cap is not None and cap < 0:
            raise ValueError(f"max_prefill_tokens_per_decode_step must be 0 (no cap) or "
                             f"positive, got {cap}")
        longs = self.max_long_partial_prefills
        if longs is not None and longs < 0:
            raise ValueError(f"max_long_partial_prefills must be 0 (no limit) or positive, "
                             f"got {longs}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be 0 (4% of max_model_len) "
                             f"or positive, got {self.long_prefill_token_threshold}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.attention_backend == "kernel":  # the earlier name
            object.__setattr__(self, "attention_backend", "cpu_kernel")
        if self.attention_backend not in ("auto", "torch", "cpu_kernel", "triton"):
            raise ValueError(
                "attention_backend must be auto, torch, cpu_kernel or triton; "
                f"got {self.attention_backend!r}"
            )
        if self.scheduling_policy not in ("fair", "fcfs"):
            raise ValueError(
                f"scheduling_policy must be fair or fcfs; got {self.scheduling_policy!r}"
            )
        validate_device_spec(self.device)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                "gpu_memory_utilization must be in (0, 1], got "
                f"{self.gpu_memory_utilization}"
            )
        if self.cuda_graph_sizes is not None and any(n < 1 for n in self.cuda_graph_sizes):
            raise ValueError(f"cuda_graph_sizes must be positive, got {self.cuda_graph_sizes}")
        self._validate_kv_tiers()
        validate_lora_args(self.max_loras, self.max_lora_rank, self.max_cpu_loras)
        if self.linear_backend not in ("auto", "onednn", "mkl", "dense", "panel", "amx"):
            raise ValueError(
                "linear_backend must be auto, onednn, mkl, dense, panel or amx; "
                f"got {self.linear_backend!r}"
            )
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                "quantization must be None or one of "
                f"{', '.join(m for m in QUANTIZATION_METHODS if m)}; got {self.quantization!r}"
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}"
            )

    def _validate_kv_tiers(self) -> None:
        if self.preemption_mode not in ("recompute", "swap", "auto"):
            raise ValueError(
                f"preemption_mode must be recompute, swap or auto; got {self.preemption_mode!r}"
            )
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if self.kv_offloading_size is not None and self.kv_offloading_size < 0:
            raise ValueError(
                f"kv_offloading_size must be >= 0 GiB, got {self.kv_offloading_size}"
            )
        for name in ("num_swap_blocks", "num_host_kv_blocks", "swap_min_computed_tokens"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
