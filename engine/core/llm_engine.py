"""The engine: one step = schedule -> run the model -> update requests.

`LLMEngine` validates and queues requests, sizes the KV cache, and after each step reports the
KV events (block hashes cached / evicted) to an optional hook, which the engine service publishes
to Redis. It is synchronous; the async service runs `step()` off the event loop.

Role: the root of the engine loop, and the only module that holds all of its parts. The loop
is a tree: the scheduler, the runner, speculation (engine.spec_decode) and urgent steps
(engine.core.urgent_step) each receive the parts they use (the scheduler, the KV manager, the
model, a callable running a scheduled step, sizes and config) and never import this module.
Start-up sizing lives in engine.core.kv_sizing; the last step's figures in
engine.core.step_report.

Invariants: a step's block copies (swap, host tier) land before its forward pass; a step's
requests are updated (tokens appended, finished ones freed) only after its forward pass
completed; the KV event hook hears of every cache change, after each step, abort, stop
and prefix-cache reset.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.core.engine_stats import engine_stats
from engine.core.fair_share import FairShare
from engine.core.kv_cache_manager import KVCacheEvents
from engine.core.kv_handoff import KVHandoff
from engine.core.kv_sizing import (
    log_kv_cache,
    make_kv_manager,
    plan_sliding_kv,
    resolve_max_model_len,
    size_host_kv,
    size_kv_cache,
)
from engine.core.request import Request, TenantShare
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import RequestUpdate, SchedulerConfig, SchedulerOutput
from engine.core.step_report import StepReport
from engine.core.urgent_step import UrgentStepParts, UrgentSteps
from engine.kv_tiers.offload import HostKVBuffer
from engine.lora.admission import LoRAAdmission
from engine.lora.config import LoRAConfig
from engine.lora.manager import LoRAManager
from engine.lora.request import LoRARequest
from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import resolve_dtype
from engine.models.registry import check_features, supports_cuda_graphs
from engine.quant.gguf_file import companion_dir, is_gguf
from engine.quant.load_weights import load_engine_model
from engine.spec_decode.build import build_speculator
from engine.spec_decode.speculator import Speculator
from engine.structured.backend import GrammarBackend
from engine.structured.manager import StructuredOutputManager
from engine.worker.cuda_graphs import capture_sizes
from engine.worker.device import resolve_attention_backend, resolve_device
from engine.worker.gpu_memory import memory_in_use, out_of_memory
from engine.worker.host_malloc import tune_for_reuse
from engine.worker.model_runner import ModelRunner, RunnerOutput
from kvfleet.contracts.sampling_params import SamplingParams
from kvfleet.contracts.structured_grammar import check_compiles
from kvfleet.text.tokenizer import Tokenizer, load_generation_eos_ids

logger = logging.getLogger("kvfleet.engine")

KVEventHook = Callable[[KVCacheEvents], None]


class LLMEngine:
    def __init__(self, config: EngineConfig, kv_event_hook: KVEventHook | None = None) -> None:
        # A GGUF file is served directly: its config and tokenizer come from a companion
        # directory made from its metadata (engine.quant.gguf_file), its weights from the file.
        self.gguf_file = Path(config.model) if is_gguf(config.model) else None
        model_dir = companion_dir(self.gguf_file) if self.gguf_file else Path(config.model)
        if not (model_dir / "config.json").is_file():
            raise ValueError(
                f"model {config.model!r} is not a Hugging Face-format directory with config.json"
            )
        self.config = config
        # Before anything heavy: a missing GPU is reported at once.
        self.device = resolve_device(config.device)
        self.attention_backend = resolve_attention_backend(config.attention_backend, self.device)
        if self.device.type == "cuda" and config.linear_backend not in ("auto", "dense"):
            raise ValueError(
                f"linear_backend={config.linear_backend!r} is a CPU path; on {self.device} "
                "use auto or dense"
            )
        self.model_config = ModelConfig.from_dir(model_dir)
        # Before loading: a feature the model family cannot run is refused, never run wrong.
        check_features(
            self.model_config.architecture, lora=config.enable_lora,
            spec_decode=config.speculative_config is not None,
            triton=self.attention_backend == "triton",
        )
        self.dtype = resolve_dtype(config.dtype, self.model_config, self.device)
        torch.manual_seed(config.seed)
        gpu_in_use: tuple[int, int] | None = None
        if self.device.type == "cuda":
            if self.device.index is not None:
                torch.cuda.set_device(self.device)
            gpu_in_use = memory_in_use(self.device)
        tune_for_reuse()  # before the model's buffers exist (engine.worker.host_malloc)
        self.model = self._load_model(model_dir)
        self.tokenizer = Tokenizer.from_dir(Path(config.tokenizer or model_dir))
        self.eos_token_ids = frozenset(load_generation_eos_ids(model_dir))
        self.max_model_len = resolve_max_model_len(self.model_config, self.config)
        self.kv_groups = plan_sliding_kv(config, self.model_config, self.max_model_len,
                                         self._decode_graphs_on())
        self.kv_layout = size_kv_cache(
            config, self.model, self.model_config, self.dtype, self.device,
            self.max_model_len, gpu_in_use, self.kv_groups,
        )
        self.host_layout = size_host_kv(config, self.kv_layout.bytes_per_block)
        self.kv = make_kv_manager(config, self.kv_layout, self.host_layout, self.kv_groups)
        self.scheduler = self._make_scheduler()
        self.runner = self._make_runner()
        # Host memory of the KV tiers; None (the default) keeps the step free of tier work.
        self.host_kv = (
            HostKVBuffer(self.runner.kv_caches, self.host_layout.num_blocks)
            if self.host_layout.num_blocks else None
        )
        # After the runner packed the projections: the wrappers reuse the packed Linear.
        self.lora = self._make_lora()
        # The LoRA delta reads per-step row maps that a captured graph would freeze: with
        # adapters on, decode steps run eagerly.
        if (self.device.type == "cuda" and not config.enforce_eager
                and not supports_cuda_graphs(self.model_config.architecture)):
            logger.warning("%s decodes eagerly: its MoE layers cannot be captured in CUDA graphs",
                           self.model_config.architecture)
        if self._decode_graphs_on():
            self.runner.enable_decode_graphs(
                capture_sizes(config.max_num_seqs, config.cuda_graph_sizes),
                -(-self.max_model_len // config.block_size),
            )
        self.speculator = self._make_speculator()
        # Prefill/decode handoffs (engine.disagg): KV export and import.
        self.handoff = KVHandoff(self.kv, self.runner.kv_caches, self.host_kv)
        self.kv_event_hook = kv_event_hook
        # Structured outputs: grammars compile on first use (engine.structured.manager).
        self.structured = StructuredOutputManager(self._make_grammar_backend)
        self.runner.structured = self.structured
        # What the last step did, for metrics and tracing (engine thread only).
        self.last_step = StepReport()
        # Steps paused between layers for a newly arrived tenant (engine.core.urgent_step).
        self.urgent = UrgentSteps.from_config(
            config,
            self.device,
            UrgentStepParts(self.scheduler, self.model, self._run_unpaused, self.last_step),
        )
        self._arrival_seq = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        log_kv_cache(config, self.dtype, self.max_model_len, self.kv_layout, self.host_layout,
                     self.kv.blocks_needed(self.max_model_len))

    # ------------------------------------------------------------------ start-up
    def _decode_graphs_on(self) -> bool:
        config = self.config
        return (self.device.type == "cuda" and not config.enforce_eager
                and not config.enable_lora
                and supports_cuda_graphs(self.model_config.architecture))

    def _make_scheduler(self) -> Scheduler:
        config = self.config
        return Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                preemption_mode=config.preemption_mode,
                swap_min_computed_tokens=config.swap_min_computed_tokens,
                max_prefill_tokens_per_decode_step=config.max_prefill_tokens_per_decode_step,
                max_long_partial_prefills=config.max_long_partial_prefills or None,
                long_prefill_token_threshold=config.long_prefill_token_threshold,
                short_prefill_steps=config.short_prefill_steps,
                spec_disable_by_batch_size=(
                    config.speculative_config.disable_by_batch_size
                    if config.speculative_config is not None else None
                ),
            ),
            self.kv,
            FairShare() if config.scheduling_policy == "fair" else None,
            LoRAAdmission(config.max_loras) if config.enable_lora else None,
        )

    def _make_lora(self) -> LoRAManager | None:
        config = self.config
        if not config.enable_lora:
            return None
        return LoRAManager(
            LoRAConfig(config.max_loras, config.max_lora_rank, config.max_cpu_loras),
            self.model, self.model_config, self.dtype,
            use_triton=self.attention_backend == "triton",
            # The PyTorch attention backend keeps LoRA on PyTorch ops too (the reference).
            cpu_kernel=self.attention_backend != "torch",
        )

    def _make_speculator(self) -> Speculator | None:
        spec = self.config.speculative_config
        if spec is None:
            return None
        return build_speculator(
            spec,
            target_config=self.model_config,
            num_blocks=self.kv_layout.num_blocks,
            block_size=self.config.block_size,
            dtype=self.dtype,
            linear_backend=self.runner.linear_backend,
        )

    def _make_grammar_backend(self) -> GrammarBackend:
        from engine.structured.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(
            self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids)
        )

    def _load_model(self, model_dir: Path) -> LlamaForCausalLM:
        try:
            return load_engine_model(model_dir, self.gguf_file, self.model_config,
                                     self.config.quantization, self.dtype, self.device,
                                     triton=self.attention_backend == "triton")
        except torch.OutOfMemoryError as exc:
            itemsize = torch.empty((), dtype=self.dtype).element_size()
            raise out_of_memory(
                "weights", self.model_config.num_parameters * itemsize, self.device
            ) from exc

    def _make_runner(self) -> ModelRunner:
        config = self.config
        try:
            return ModelRunner(
                self.model, self.model_config, self.kv_layout.num_blocks, config.block_size,
                self.dtype, config.seed, self.attention_backend, config.linear_backend,
                self.device, config.max_num_batched_tokens, self.kv_groups,
            )
        except torch.OutOfMemoryError as exc:
            asked = self.kv_layout.num_blocks * self.kv_layout.bytes_per_block
            raise out_of_memory("KV cache", asked, self.device) from exc

    # ------------------------------------------------------------------ requests
    def validate_request(
        self, prompt_token_ids: list[int], params: SamplingParams
    ) -> int:
        """Check a request before it is queued; returns its resolved max_tokens."""
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise ValueError("prompt is empty: at least one token is required")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - num_prompt
        if max_tokens < 1 or num_prompt + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})"
            )
        if not self.kv.can_fit(num_prompt + max_tokens):
            needed = self.kv.blocks_needed(num_prompt + max_tokens)
            raise ValueError(
                f"prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) needs {needed} "
                f"KV blocks but the cache has only {self.kv.num_blocks}"
            )
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:
            raise ValueError(f"stop_token_ids entry {bad_stop[0]} is outside the vocabulary")
        if params.structured_outputs is not None:
            # The tokenizer-free check (cached, thread-safe): a bad grammar is refused before
            # anything is queued; add_request compiles it for this tokenizer.
            check_compiles(params.structured_outputs)
        return max_tokens

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        share: TenantShare | None = None,
        lora_request: LoRARequest | str | None = None,
        prefill_only: bool = False,
    ) -> Request:
        """Queue a request; `lora_request` is a LoRARequest (loaded on first use) or the
        name of a loaded adapter; None runs the base model. `prefill_only`: end it after its
        first token, its KV exported (engine.disagg)."""
        max_tokens = self.validate_request(prompt_token_ids, params)
        if prefill_only and self.kv.sliding is not None:
            raise ValueError("prefill_only: a KV handoff exports one block table, and "
                             f"{self.model_config.architecture}'s sliding-window KV has several; "
                             "start the engine with disable_hybrid_kv_cache_manager")
        lora_id = self.resolve_lora(lora_request)
        # Compiled here, before the request is queued: a bad grammar fails this request alone.
        grammar = (
            None if params.structured_outputs is None
            else self.structured.matcher_for(params.structured_outputs)
        )
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            max_tokens=max_tokens,
            block_size=self.config.block_size,
            arrival_seq=self._arrival_seq,
            priority=priority,
            eos_token_ids=self.eos_token_ids,
            cache_salt=cache_salt,
            lora_id=lora_id,
            share=share,
            grammar=grammar,
            prefill_only=prefill_only,
        )
        self._arrival_seq += 1
        self.scheduler.add_request(request)
        self.runner.add_request(request_id, params.seed)
        return request

    # ------------------------------------------------------------------ KV handoff
    def add_imported_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token_id: int,
        params: SamplingParams,
        *,
        transfer_id: str = "",
        num_cached_tokens: int = 0,
        priority: int = 0,
        cache_salt: str | None = None,
        share: TenantShare | None = None,
    ) -> Request:
        """Queue a request that continues after its first token: with a complete KV import
        it holds the prompt's KV (not recomputed); without one it recomputes the prompt."""
        try:
            if request_id in self.scheduler.requests:
                raise ValueError(f"request id {request_id!r} is already in use")
            request = self._imported_request(
                request_id, prompt_token_ids, first_token_id, params, priority, cache_salt,
                share,
            )
        except BaseException:
            self.handoff.imports.abort(transfer_id)  # its blocks are nobody's now
            raise
        if transfer_id:
            self.handoff.adopt(request, transfer_id)
        request.num_cached_tokens = num_cached_tokens
        self._arrival_seq += 1
        self.scheduler.add_request(request)
        self.runner.add_request(request_id, params.seed)
        self._emit_kv_events()
        return request

    def _imported_request(
        self, request_id: str, prompt: list[int], first_token_id: int, params: SamplingParams,
        priority: int, cache_salt: str | None, share: TenantShare | None,
    ) -> Request:
        max_tokens = self.validate_request(prompt, params)
        if not 0 <= first_token_id < self.model_config.vocab_size:
            raise ValueError(f"first_token_id {first_token_id} is outside the vocabulary")
        request = Request(
            request_id=request_id, prompt_token_ids=list(prompt), sampling_params=params,
            max_tokens=max_tokens, block_size=self.config.block_size,
            arrival_seq=self._arrival_seq, priority=priority, eos_token_ids=self.eos_token_ids,
            cache_salt=cache_salt, share=share,
        )
        request.append_output_token(first_token_id)
        return request

    # ------------------------------------------------------------------ LoRA adapters
    def resolve_lora(self, lora_request: LoRARequest | str | None) -> str | None:
        """The adapter's block-hash key (None: base model); ValueError if it cannot be served."""
        if lora_request is None:
            return None
        if self.lora is None:
            raise ValueError(
                "LoRA adapters are not enabled on this engine (start it with enable_lora=True, "
                "--enable-lora)"
            )
        return self.lora.resolve(lora_request)

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and serve an adapter under its name (ValueError if bad)."""
        self.resolve_lora(lora_request)

    def remove_lora(self, lora_name: str) -> bool:
        """Stop serving an adapter; requests already using it run to completion."""
        return self.lora is not None and self.lora.unload(lora_name)

    def list_loras(self) -> list[LoRARequest]:
        return [] if self.lora is None else self.lora.list_adapters()

    def abort_request(self, request_id: str) -> Request | None:
        """Abort a waiting or running request; returns it (for its usage), or None if unknown."""
        request = self.scheduler.abort_request(request_id)
        if request is not None:
            self.runner.remove_request(request_id)
            self._emit_kv_events()
        return request

    def stop_request(self, request_id: str, stop_string: str) -> Request | None:
        """Finish a request whose text reached `stop_string` (finish_reason "stop"), freeing
        its blocks; returns it, or None if it already finished or is unknown."""
        request = self.scheduler.stop_request(request_id, stop_string)
        if request is not None:
            self.runner.remove_request(request_id)
            self._emit_kv_events()
        return request

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestUpdate]:
        out = self.scheduler.schedule()
        if self.host_kv is not None and self.kv.transfers:
            # Block copies of this schedule (swap, host tier) land before the forward pass.
            self.host_kv.apply(self.kv.transfers.take())
        self.last_step.record(out)
        if not out.scheduled:
            if self.scheduler.has_unfinished_requests() and not out.preempted:
                raise RuntimeError("scheduler made no progress with requests pending")
            return []
        with self.urgent.pausable(out), self.handoff.pacer.stepping():
            sampled = self.execute_scheduled(out)
        return self.apply_step_output(out, sampled)

    def _run_unpaused(self, out: SchedulerOutput) -> list[RequestUpdate]:
        """A whole scheduled step outside `urgent.pausable` (an urgent step's own)."""
        return self.apply_step_output(out, self.execute_scheduled(out))

    def execute_scheduled(self, out: SchedulerOutput) -> RunnerOutput:
        """The forward pass and sampling of a scheduled step."""
        block_ids = {s.request.request_id: self.kv.get_block_ids(s.request.request_id)
                     for s in out.scheduled}
        group_ids = (None if self.kv.sliding is None else {
            s.request.request_id: self.kv.get_group_block_ids(s.request.request_id)
            for s in out.scheduled})
        if self.lora is not None:
            self.lora.begin_step(out.scheduled)
        try:
            return self.runner.execute(out.scheduled, block_ids, group_ids)
        finally:
            if self.lora is not None:
                self.lora.end_step()

    def apply_step_output(self, out: SchedulerOutput, sampled: RunnerOutput) -> list[RequestUpdate]:
        """The requests' side of a computed step: tokens appended, finished ones freed."""
        updates = self.scheduler.update_from_output(
            out, sampled.token_ids, sampled.logprobs, sampled.prompt_logprobs, sampled.verified
        )
        self.handoff.export(updates)
        if self.speculator is not None:
            self.speculator.after_step(
                out.scheduled, sampled.verified, updates, self.scheduler.num_running
            )
        for update in updates:
            request = update.request
            if request.num_output_tokens == 1:
                self.prompt_tokens += request.num_prompt_tokens
            self.generation_tokens += len(update.new_token_ids)
            if update.finished:
                self.runner.remove_request(request.request_id)
        self._emit_kv_events()
        return updates

    def _emit_kv_events(self) -> None:
        events = self.kv.take_events()
        if self.kv_event_hook is not None and (events.stored or events.removed):
            self.kv_event_hook(events)

    # ------------------------------------------------------------------ introspection
    @property
    def last_step_num_tokens(self) -> int:
        return self.last_step.num_tokens

    @property
    def last_step_preempted(self) -> list[str]:
        return self.last_step.preempted

    def reset_prefix_cache(self) -> bool:
        ok = self.kv.reset_prefix_cache()
        self._emit_kv_events()
        return ok

    def get_stats(self) -> dict[str, int | float]:
        return engine_stats(self)
