"""Offline API with vLLM's names: `LLM(...).generate(prompts, sampling_params)` and `.chat()`.

All prompts of a call are validated before any is queued, so a bad prompt raises ValueError and
leaves the engine untouched and serving. Outputs come back in input order.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from tqdm import tqdm

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import Request
from engine.sampling_params import SamplingParams

PromptInput = str | dict[str, Any]
ChatMessages = list[dict[str, str]]


@dataclass(frozen=True)
class _Prepared:
    prompt: str | None
    token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    max_tokens: int


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        if model is None:
            from engine.default_model import prepare_default_model

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
    ) -> list[RequestOutput]:
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params_list = self._params_per_prompt(sampling_params, len(prompt_list))
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(priorities) != len(prompt_list):
            raise ValueError("priority must have one entry per prompt")
        prepared = [self._prepare(p, sp) for p, sp in zip(prompt_list, params_list, strict=True)]
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

    def _prepare(self, prompt: PromptInput, params: SamplingParams) -> _Prepared:
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
        return _Prepared(text, token_ids, params, salt, max_tokens)

    def _run(
        self, prepared: list[_Prepared], priorities: list[int], use_tqdm: bool
    ) -> list[RequestOutput]:
        requests: list[Request] = []
        for item, prio in zip(prepared, priorities, strict=True):
            request_id = str(next(self._ids))
            requests.append(
                self.engine.add_request(
                    request_id, item.token_ids, item.params, priority=prio,
                    cache_salt=item.cache_salt,
                )
            )
        bar = tqdm(total=len(requests), desc="Processed prompts", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for update in self.engine.step():
                    if update.finished:
                        bar.update(1)
        except BaseException:
            for request in requests:
                self.engine.abort_request(request.request_id)
            raise
        finally:
            bar.close()
        return [self._to_output(r, p) for r, p in zip(requests, prepared, strict=True)]

    def _to_output(self, request: Request, prepared: _Prepared) -> RequestOutput:
        params = request.sampling_params
        text = self.engine.tokenizer.decode(
            request.output_token_ids, skip_special_tokens=params.skip_special_tokens
        )
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(request.output_token_ids),
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=prepared.prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            outputs=[completion],
            finished=request.status.finished,
            num_cached_tokens=request.num_cached_tokens or 0,
        )
