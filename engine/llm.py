"""Offline API with vLLM's names: `LLM(...).generate(prompts, sampling_params)` and `.chat()`.

All prompts of a call are validated before any is queued, so a bad prompt raises ValueError and
leaves the engine untouched and serving. Outputs come back in input order, one RequestOutput per
prompt. A prompt with n > 1 becomes n engine requests
(kvfleet.contracts.parallel_sampling.fan_out) that share the prompt's KV blocks through the
prefix cache; its RequestOutput lists the n samples in index order. Stop strings and logprobs
are tracked per sample (engine.completion_tracker); a sample whose text reaches a stop string is
stopped in the engine at once, so its blocks are freed. Prompt logprobs are the first sample's
(only it computes them; see kvfleet.contracts.parallel_sampling).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from tqdm import tqdm

from engine.completion_tracker import CompletionTracker
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.lora.request import LoRARequest
from engine.outputs import RequestOutput
from kvfleet.contracts.parallel_sampling import fan_out
from kvfleet.contracts.sampling_params import SamplingParams

PromptInput = str | dict[str, Any]
ChatMessages = list[dict[str, str]]


@dataclass(frozen=True)
class _Prepared:
    prompt: str | None
    token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    max_tokens: int
    lora_request: LoRARequest | None = None


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        if model is None:
            from engine.models.default_model import prepare_default_model

            model = str(prepare_default_model())
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`lora_request`: one adapter for every prompt or one (or None) per prompt."""
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params_list = self._params_per_prompt(sampling_params, len(prompt_list))
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(priorities) != len(prompt_list):
            raise ValueError("priority must have one entry per prompt")
        loras = self._loras_per_prompt(lora_request, len(prompt_list))
        prepared = [
            self._prepare(p, sp, lora)
            for p, sp, lora in zip(prompt_list, params_list, loras, strict=True)
        ]
        return self._run(prepared, priorities, use_tqdm)

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        single = bool(messages) and isinstance(messages[0], dict)
        conversations = [cast(ChatMessages, messages)] if single else list(
            cast(Sequence[ChatMessages], messages)
        )
        prompts: list[PromptInput] = []
        for conversation in conversations:
            text = self.engine.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt
            )
            # The template already carries BOS/special tokens; don't add them twice.
            ids = self.engine.tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def get_stats(self) -> dict[str, int | float]:
        return self.engine.get_stats()

    def reset_prefix_cache(self) -> bool:
        """Drop all cached prefix blocks; False (nothing done) while blocks are in use."""
        return self.engine.reset_prefix_cache()

    # ------------------------------------------------------------------ internals
    def _params_per_prompt(
        self, params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        params = list(params)
        if len(params) != count:
            raise ValueError(
                f"got {len(params)} sampling_params for {count} prompts; pass one or one each"
            )
        return params

    @staticmethod
    def _loras_per_prompt(
        lora: LoRARequest | Sequence[LoRARequest | None] | None, count: int
    ) -> list[LoRARequest | None]:
        if lora is None or isinstance(lora, LoRARequest):
            return [lora] * count
        loras = list(lora)
        if len(loras) != count:
            raise ValueError(
                f"got {len(loras)} lora_requests for {count} prompts; pass one or one each"
            )
        return loras

    def _prepare(
        self, prompt: PromptInput, params: SamplingParams, lora: LoRARequest | None = None
    ) -> _Prepared:
        text: str | None
        if isinstance(prompt, str):
            text, token_ids, salt = prompt, None, None
        elif isinstance(prompt, dict):
            text = prompt.get("prompt")
            token_ids = prompt.get("prompt_token_ids")
            salt = prompt.get("cache_salt")
            if text is None and token_ids is None:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        else:
            raise ValueError(f"a prompt must be a str or a dict, got {type(prompt).__name__}")
        if token_ids is None:
            if not text:
                raise ValueError("prompt is empty: at least one token is required")
            token_ids = self.engine.tokenizer.encode(text)
        token_ids = [int(t) for t in token_ids]
        max_tokens = self.engine.validate_request(token_ids, params)
        self.engine.resolve_lora(lora)  # loads a new adapter now: a bad one queues nothing
        return _Prepared(text, token_ids, params, salt, max_tokens, lora)

    def _run(
        self, prepared: list[_Prepared], priorities: list[int], use_tqdm: bool
    ) -> list[RequestOutput]:
        groups: list[tuple[str, list[CompletionTracker]]] = []
        try:
            for item, prio in zip(prepared, priorities, strict=True):
                parent_id = str(next(self._ids))
                groups.append((parent_id, self._add_samples(parent_id, item, prio)))
            self._drive([samples for _, samples in groups], use_tqdm)
        except BaseException:
            for _, samples in groups:
                for sample in samples:
                    self.engine.abort_request(sample.request.request_id)
            raise
        return [
            self._to_output(parent_id, samples, item)
            for (parent_id, samples), item in zip(groups, prepared, strict=True)
        ]

    def _add_samples(
        self, parent_id: str, item: _Prepared, priority: int
    ) -> list[CompletionTracker]:
        # Children are queued back to back; the first computes the prompt and the others wait
        # a step for its blocks, then hit them (the scheduler's computing-block rule).
        samples = []
        for request_id, params in fan_out(parent_id, item.params):
            request = self.engine.add_request(
                request_id, item.token_ids, params, priority=priority,
                cache_salt=item.cache_salt, lora_request=item.lora_request,
            )
            samples.append(CompletionTracker(request, self.engine.tokenizer))
        return samples

    def _drive(self, groups: list[list[CompletionTracker]], use_tqdm: bool) -> None:
        """Step the engine until every sample is finished; the bar counts whole prompts."""
        samples = {s.request.request_id: (i, s) for i, group in enumerate(groups) for s in group}
        remaining = [len(group) for group in groups]
        with tqdm(total=len(groups), desc="Processed prompts", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for update in self.engine.step():
                    group, sample = samples[update.request.request_id]
                    if sample.finished:
                        continue
                    stop_string = sample.on_update(update)
                    if stop_string is not None:
                        self.engine.stop_request(update.request.request_id, stop_string)
                    if sample.finished:
                        remaining[group] -= 1
                        if remaining[group] == 0:
                            bar.update(1)

    def _to_output(
        self, parent_id: str, samples: list[CompletionTracker], prepared: _Prepared
    ) -> RequestOutput:
        first = samples[0].request
        return RequestOutput(
            request_id=parent_id,
            prompt=prepared.prompt,
            prompt_token_ids=list(first.prompt_token_ids),
            outputs=[sample.to_output(index) for index, sample in enumerate(samples)],
            finished=all(sample.finished for sample in samples),
            # The first sample's hit: its siblings' extra hits are on its own blocks.
            num_cached_tokens=first.num_cached_tokens or 0,
            prompt_logprobs=samples[0].prompt_logprob_dicts(),
        )
