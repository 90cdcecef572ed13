"""A step that raises must not poison the prefix cache.

The fault is injected in the last decoder layer, so the earlier layers have already written
their KV for the step's tokens when it raises: exactly the half-written state that, registered
as a prefix hit, would give later requests wrong tokens silently.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
import transformers

from engine.config import EngineConfig
from engine.core.kv_cache_manager import KVCacheEvents
from engine.core.llm_engine import LLMEngine
from engine.service.async_engine import AsyncEngine
from kvfleet.contracts.sampling_params import SamplingParams

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


class InjectedFault(RuntimeError):
    pass


def fail_next_forward(engine: LLMEngine) -> None:
    """Make the last decoder layer raise once, after the others wrote their KV. The layer is
    entered through `forward`, or `forward_rows` when the step only wants the sampled rows."""
    layer = engine.model.layers[-1]
    originals = {"forward": layer.forward, "forward_rows": layer.forward_rows}

    def failing(*args, **kwargs):
        for name, original in originals.items():  # one failure only
            setattr(layer, name, original)
        raise InjectedFault("injected fault in the last layer")

    for name in originals:
        setattr(layer, name, failing)


@pytest.fixture(scope="module")
def prompt(tiny_model_dir) -> list[int]:
    vocab = transformers.AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    return [(7 * i + 3) % vocab for i in range(40)]  # two full blocks + 8 tokens


@pytest.fixture(scope="module")
def reference(tiny_model_dir, prompt) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    input_ids = torch.tensor([prompt])
    generated = model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
    )
    return generated[0, len(prompt):].tolist()


def make_engine(tiny_model_dir, events: list[KVCacheEvents]) -> LLMEngine:
    config = EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=16)
    return LLMEngine(config, kv_event_hook=events.append)


def run(engine: LLMEngine, request_id: str, prompt: list[int]):
    request = engine.add_request(request_id, prompt, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    return request


def test_failed_prefill_registers_no_hash_and_resend_recomputes(tiny_model_dir, prompt, reference):
    events: list[KVCacheEvents] = []
    engine = make_engine(tiny_model_dir, events)
    engine.add_request("poisoned", prompt, GREEDY)
    fail_next_forward(engine)
    with pytest.raises(InjectedFault):
        engine.step()
    engine.abort_request("poisoned")  # what the service does with the requests in flight
    engine.scheduler.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert engine.kv.pool.cached == {}
    assert [e for e in events if e.stored or e.removed] == []  # nothing published or unpublished

    again = run(engine, "again", prompt)
    assert again.num_cached_tokens == 0
    assert again.output_token_ids == reference
    # Now the blocks were computed by a step that completed: a third send hits them.
    third = run(engine, "third", prompt)
    assert third.num_cached_tokens == 32
    assert third.output_token_ids == reference


def test_failed_decode_step_keeps_only_blocks_of_completed_steps(tiny_model_dir, reference):
    """Prompt of 31 tokens: block 1 fills with the first sampled token, whose KV the failing
    decode step was writing. Block 0 (computed by the completed prefill) may hit; block 1 not."""
    events: list[KVCacheEvents] = []
    engine = make_engine(tiny_model_dir, events)
    vocab = engine.model_config.vocab_size
    prompt = [(11 * i + 5) % vocab for i in range(31)]
    request = engine.add_request("a", prompt, GREEDY)
    engine.step()  # prefill completes: block 0 is cached
    assert len(engine.kv.pool.cached) == 1
    fail_next_forward(engine)
    with pytest.raises(InjectedFault):
        engine.step()  # decode of token 31 (fills block 1) fails
    engine.abort_request("a")
    assert list(engine.kv.pool.cached) == request.block_hashes[:1]
    stored = [h for e in events for h in e.stored]
    assert stored == request.block_hashes[:1]

    # The same 32 tokens again: only block 0 may come from the cache.
    resend = engine.add_request("b", prompt + request.output_token_ids[:1], GREEDY)
    engine.step()
    assert resend.num_cached_tokens == 16


def test_async_engine_step_failure_then_resend_equals_transformers(
    tiny_model_dir, prompt, reference
):
    """The service path: the step fails, every request in flight gets the error, the resend
    makes no hit on the failed blocks and its tokens equal transformers'."""
    events: list[KVCacheEvents] = []
    engine = make_engine(tiny_model_dir, events)
    async_engine = AsyncEngine(engine)
    published: list[bytes] = []
    async_engine.add_step_listener(lambda e: published.extend(e.stored))

    async def collect(request_id: str) -> tuple[list[int], int]:
        tokens: list[int] = []
        cached = 0
        async for out in async_engine.generate(request_id, prompt, GREEDY):
            tokens.extend(out.token_ids)
            cached = out.num_cached_tokens
        return tokens, cached

    async def scenario() -> None:
        async_engine.start()
        try:
            fail_next_forward(engine)
            with pytest.raises(RuntimeError, match="engine step failed"):
                await collect("first")
            assert published == []
            tokens, cached = await collect("second")
            assert (tokens, cached) == (reference, 0)
            tokens, cached = await collect("third")
            assert (tokens, cached) == (reference, 32)
        finally:
            await async_engine.shutdown()

    asyncio.run(scenario())
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
