"""Greedy output under LoRA equals transformers + peft (`PeftModel`), token for token.

Three adapters (tests/fixtures/lora_adapters.py: all projections r8, q/v r4 rsLoRA, MLP r2)
and the base model run in ONE engine batch: every prompt under every adapter and the base.
The same batch runs with chunked prefill, under preemption, with prefix hits (a second run),
and with `max_loras=1` (adapters take turns; at most one per step), on the C++ kernel's
packed stacks and (the torch backend) on the PyTorch reference. Block accounting is
checked after every step; the running set never holds more than `max_loras` adapters.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import transformers

from engine import LLM, LoRARequest, SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.lora.ops import cpu_kernel_available
from tests.fixtures.lora_adapters import ADAPTERS, peft_model

NEW_TOKENS = 16
PROMPT_LENGTHS = [3, 17, 40, 70]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
MODELS = [spec.name for spec in ADAPTERS] + [None]  # None: the base model


@pytest.fixture(scope="module")
def prompts(tiny_model_dir) -> list[list[int]]:
    vocab = transformers.AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    rng = random.Random(4321)
    return [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


def _generate(model: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    outputs = []
    for ids in prompts:
        input_ids = torch.tensor([ids])
        generated = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
        outputs.append(generated[0, len(ids) :].tolist())
    return outputs


@pytest.fixture(scope="module")
def reference(tiny_model_dir, prompts) -> dict[str | None, list[list[int]]]:
    refs: dict[str | None, list[list[int]]] = {}
    for spec in ADAPTERS:
        refs[spec.name] = _generate(peft_model(tiny_model_dir, spec), prompts)
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    refs[None] = _generate(base, prompts)
    # The adapters matter: each changes the greedy tokens of every prompt.
    for spec in ADAPTERS:
        assert all(a != b for a, b in zip(refs[spec.name], refs[None], strict=True))
    return refs


def lora_requests(dirs: dict[str, Path]) -> dict[str | None, LoRARequest | None]:
    requests: dict[str | None, LoRARequest | None] = {None: None}
    for index, spec in enumerate(ADAPTERS, start=1):
        requests[spec.name] = LoRARequest(spec.name, index, str(dirs[spec.name]))
    return requests


def run_mixed(engine: LLMEngine, prompts, loras, max_loras: int) -> dict:
    """Every prompt under every model in one queue; returns outputs by (model, prompt)."""
    requests = {}
    for model in MODELS:
        for i, ids in enumerate(prompts):
            rid = f"{model}-{i}"
            requests[(model, i)] = engine.add_request(rid, ids, GREEDY, lora_request=loras[model])
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        engine.scheduler.check_integrity()
        active = {r.lora_id for r in engine.scheduler.running if r.lora_id is not None}
        assert len(active) <= max_loras
        steps += 1
        assert steps < 5_000, "engine made no progress"
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return {key: r.output_token_ids for key, r in requests.items()}


def expected(reference, prompts) -> dict:
    return {(m, i): reference[m][i] for m in MODELS for i in range(len(prompts))}


@pytest.mark.parametrize(
    "engine_args",
    [
        pytest.param({}, id="one-batch"),
        pytest.param({"max_num_batched_tokens": 32}, id="chunked-32"),
        pytest.param({"num_kv_blocks": 14, "max_num_batched_tokens": 64}, id="preemption"),
        pytest.param({"attention_backend": "torch", "linear_backend": "dense"}, id="torch"),
    ],
)
def test_three_adapters_and_base_in_one_batch(
    tiny_model_dir, tiny_lora_dirs, prompts, reference, engine_args
):
    llm = LLM(tiny_model_dir, dtype="float32", enable_lora=True, max_loras=3, **engine_args)
    loras = lora_requests(tiny_lora_dirs)
    engine = llm.engine
    # The C++ kernel on its packed stacks, or (torch backend) the PyTorch reference.
    assert engine.lora is not None
    assert engine.lora.context.cpu_packed == (
        engine_args.get("attention_backend") != "torch" and cpu_kernel_available()
    )
    got = run_mixed(engine, prompts, loras, max_loras=3)
    assert got == expected(reference, prompts)
    if "num_kv_blocks" in engine_args:
        assert engine.scheduler.num_preemptions > 0


def test_first_step_holds_three_adapters_and_the_base(tiny_model_dir, tiny_lora_dirs, prompts):
    llm = LLM(tiny_model_dir, dtype="float32", enable_lora=True, max_loras=3)
    loras = lora_requests(tiny_lora_dirs)
    for model in MODELS:
        llm.engine.add_request(f"{model}", prompts[0], GREEDY, lora_request=loras[model])
    llm.engine.step()
    running = {r.lora_id for r in llm.engine.scheduler.running}
    assert running == set(MODELS)


def test_max_loras_one_takes_turns(tiny_model_dir, tiny_lora_dirs, prompts, reference):
    llm = LLM(tiny_model_dir, dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=2)
    got = run_mixed(llm.engine, prompts, lora_requests(tiny_lora_dirs), max_loras=1)
    assert got == expected(reference, prompts)


def test_prefix_hits_stay_within_an_adapter(tiny_model_dir, tiny_lora_dirs, prompts, reference):
    llm = LLM(tiny_model_dir, dtype="float32", enable_lora=True, max_loras=3)
    loras = lora_requests(tiny_lora_dirs)
    batch = [{"prompt_token_ids": p} for m in MODELS for p in prompts]
    per_prompt = [loras[m] for m in MODELS for _ in prompts]
    want = [reference[m][i] for m in MODELS for i in range(len(prompts))]
    first = llm.generate(batch, GREEDY, use_tqdm=False, lora_request=per_prompt)
    second = llm.generate(batch, GREEDY, use_tqdm=False, lora_request=per_prompt)
    assert [o.outputs[0].token_ids for o in first] == want
    assert [o.outputs[0].token_ids for o in second] == want
    hits = [((len(p) - 1) // 16) * 16 for _ in MODELS for p in prompts]
    assert [o.num_cached_tokens for o in second] == hits
    assert sum(hits) > 0


def test_same_prompt_under_two_adapters_gets_no_cross_hit(tiny_model_dir, tiny_lora_dirs, prompts):
    llm = LLM(tiny_model_dir, dtype="float32", enable_lora=True, max_loras=2)
    loras = lora_requests(tiny_lora_dirs)
    prompt = {"prompt_token_ids": prompts[3]}  # 70 tokens: 64 cacheable

    def cached(model: str | None) -> int:
        out = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=loras[model])
        return out[0].num_cached_tokens

    a, b = ADAPTERS[0].name, ADAPTERS[1].name
    assert [cached(a), cached(b), cached(None), cached(a), cached(b), cached(None)] == [
        0, 0, 0, 64, 64, 64
    ]  # fmt: skip
