"""Urgent steps (engine.core.urgent_step) keep every request's greedy output equal to transformers'.

Tenant A's long prompts run in chunks (budget 32); at chosen steps the test's poll, called
between layers exactly as the engine service's is, adds requests of new tenants and runs an
urgent step for them inside the paused step. No timing: the steps and the layer are fixed.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine import LLM, SamplingParams
from engine.core.request import TenantShare
from engine.service.async_engine import AsyncEngine
from tests.fixtures.greedy import random_prompts, transformers_greedy

NEW_TOKENS = 8
A_LENGTHS = [100, 150, 64]
# Step -> the requests (id, tenant, prompt length, priority) added while that step is paused
# after layer 0. b0 and b1 are served in an urgent step; b1's prompt does not fit in what b0
# leaves of its budget: it gets a chunk there and finishes in ordinary steps. a9 (A's own,
# behind A's running prompts) and d0 (a worse priority) do not qualify and wait for the next
# ordinary step. c0 arrives while B still runs.
PLAN = {
    2: [("b0", "B", 7, 0), ("a9", "A", 20, 0), ("b1", "B", 40, 0), ("d0", "D", 5, 1)],
    5: [("c0", "C", 17, 0)],
}
SERVED = {2: ["b0", "b1"], 5: ["c0"]}
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tiny_model_dir) -> dict[str, list[int]]:
    ids = [f"a{i}" for i in range(len(A_LENGTHS))]
    lengths = list(A_LENGTHS)
    for added in PLAN.values():
        ids += [rid for rid, _, _, _ in added]
        lengths += [n for _, _, n, _ in added]
    return dict(zip(ids, random_prompts(tiny_model_dir, lengths, seed=77), strict=True))


@pytest.fixture(scope="module")
def reference(tiny_model_dir, prompts) -> dict[str, list[int]]:
    outputs = transformers_greedy(tiny_model_dir, list(prompts.values()), NEW_TOKENS)
    return dict(zip(prompts, outputs, strict=True))


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_urgent_steps_keep_greedy_outputs_exact(tiny_model_dir, prompts, reference, backend):
    llm = LLM(
        tiny_model_dir,
        dtype="float32",
        max_num_batched_tokens=32,
        attention_backend=backend,
        preempt_steps_for_new_tenants=True,
    )
    engine = llm.engine
    urgent = engine.urgent
    assert urgent.enabled
    requests = {
        f"a{i}": engine.add_request(f"a{i}", prompts[f"a{i}"], GREEDY, share=TenantShare("A"))
        for i in range(len(A_LENGTHS))
    }
    step = 0
    in_urgent: dict[str, list[list[int]]] = {}
    polls: list[tuple[int, int]] = []

    def poll(layer: int) -> None:
        polls.append((step, layer))
        added = PLAN.get(step, [])
        if not added:
            return
        paused = urgent.paused
        assert paused is not None and any(s.num_new_tokens > 1 for s in paused.scheduled)
        for rid, tenant, _, priority in added:
            requests[rid] = engine.add_request(
                rid, prompts[rid], GREEDY, priority=priority, share=TenantShare(tenant)
            )
        served = urgent.qualifying([rid for rid, _, _, _ in added])
        assert served == SERVED[step]
        for update in urgent.run(served):
            in_urgent.setdefault(update.request.request_id, []).append(update.new_token_ids)
        engine.scheduler.check_integrity()

    urgent.poll = poll
    while engine.has_unfinished_requests():
        engine.step()
        engine.scheduler.check_integrity()
        step += 1
        assert step < 1000, "engine made no progress"
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert {rid: r.output_token_ids for rid, r in requests.items()} == reference
    # The short prompts got their first token in the urgent step, inside the paused one.
    assert in_urgent == {"b0": [reference["b0"][:1]], "c0": [reference["c0"][:1]]}
    assert urgent.num_urgent_steps == 2
    assert (2, 0) in polls and all(layer == 0 for _, layer in polls)  # 2 layers: one boundary


def test_on_by_default_and_off_where_unsupported_or_asked(tiny_model_dir):
    assert LLM(tiny_model_dir, dtype="float32").engine.urgent.enabled
    off = LLM(tiny_model_dir, dtype="float32", preempt_steps_for_new_tenants=False)
    assert not off.engine.urgent.enabled
    fcfs = LLM(
        tiny_model_dir,
        dtype="float32",
        scheduling_policy="fcfs",
        preempt_steps_for_new_tenants=True,
    )
    assert not fcfs.engine.urgent.enabled


def test_urgent_step_between_two_steps(tiny_model_dir, prompts, reference):
    """A request added between steps, ranked ahead of A's prompt chunks, gets a step of its
    own before the next ordinary step (which would fill its budget with those chunks). Once A
    only decodes, a new tenant's request is due only while A has a prompt waiting too (the
    next step would compute a chunk of it). Greedy tokens stay exact."""
    llm = LLM(tiny_model_dir, dtype="float32", max_num_batched_tokens=32)
    engine, urgent = llm.engine, llm.engine.urgent
    requests = {
        rid: engine.add_request(rid, prompts[rid], GREEDY, share=TenantShare("A"))
        for rid in ("a0", "a1")
    }
    engine.step()  # A's prompts are mid-prefill (32-token budget)
    requests["b0"] = engine.add_request("b0", prompts["b0"], GREEDY, share=TenantShare("B"))
    assert urgent.paused is None and urgent.due() == ["b0"]
    assert urgent.qualifying(["b0"]) == []  # no step is paused
    updates = urgent.run(["b0"])
    assert [(u.request.request_id, u.new_token_ids) for u in updates] == [
        ("b0", reference["b0"][:1])
    ]
    engine.scheduler.check_integrity()
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()
    requests["c0"] = engine.add_request("c0", prompts["c0"], GREEDY, share=TenantShare("C"))
    assert urgent.due() == []  # only decodes beside it: the next step is short
    requests["a9"] = engine.add_request("a9", prompts["a9"], GREEDY, share=TenantShare("A"))
    requests["b1"] = engine.add_request("b1", prompts["b1"], GREEDY, share=TenantShare("B"))
    # Fair-share order: c0 (C was lifted to A's counter and is the newest active tenant),
    # then b1 (B's counter is below A's), then a9: A's prompt is the work kept out.
    assert urgent.due() == ["c0", "b1"]
    updates = urgent.run(urgent.due())
    assert sorted((u.request.request_id, u.new_token_ids) for u in updates) == [
        ("c0", reference["c0"][:1])
    ]  # b1's 40 tokens do not fit in what c0 leaves of the 32-token budget: it gets a chunk
    engine.scheduler.check_integrity()
    assert urgent.due() == []  # b1 now runs (a prompt of its own); a9 waits behind it
    while engine.has_unfinished_requests():
        engine.step()
        engine.scheduler.check_integrity()
    assert {rid: r.output_token_ids for rid, r in requests.items()} == {
        rid: reference[rid] for rid in requests
    }
    assert urgent.num_urgent_steps == 2
    assert engine.kv.num_free_blocks == engine.kv.num_blocks



def test_one_tenant_is_never_due(tiny_model_dir, prompts):
    """With one tenant's prompt work only, nothing is due between steps, even a request of it
    that ranks first (a better priority, or one preempted and re-queued): its order is the
    ordinary steps' own."""
    llm = LLM(tiny_model_dir, dtype="float32", max_num_batched_tokens=32)
    engine, urgent = llm.engine, llm.engine.urgent
    for rid in ("a0", "a1"):
        engine.add_request(rid, prompts[rid], GREEDY, share=TenantShare("A"))
    engine.step()  # A's prompts are mid-prefill
    engine.add_request("a9", prompts["a9"], GREEDY, priority=-1, share=TenantShare("A"))
    assert urgent.due() == []
    engine.add_request("b0", prompts["b0"], GREEDY, share=TenantShare("B"))
    # Two tenants now: a9's better priority ranks it first, then b0 (B's counter is lifted
    # to A's and the newest active tenant wins the tie), both ahead of A's running prompts.
    assert urgent.due() == ["a9", "b0"]


def test_engine_service_serves_a_new_tenant_inside_the_paused_step(
    tiny_model_dir, prompts, reference
):
    """The service path (AsyncEngine): B's request, queued while A's first step is paused
    between layers, is taken from the command queue there and its first token published
    before that step resumes; every stream's tokens equal transformers'."""
    llm = LLM(
        tiny_model_dir,
        dtype="float32",
        max_num_batched_tokens=32,
        preempt_steps_for_new_tenants=True,
    )
    engine = llm.engine
    async_engine = AsyncEngine(engine)
    service_poll = engine.urgent.poll
    assert service_poll is not None
    paused, b_queued = threading.Event(), threading.Event()
    published: list[tuple[str, bool]] = []

    def gated_poll(layer: int) -> None:
        if not paused.is_set():  # the first pause: A's first step; wait until B is queued
            paused.set()
            assert b_queued.wait(60)
        service_poll(layer)

    def on_updates(updates, stepped) -> None:
        published.extend(
            (u.request.request_id, engine.urgent.paused is not None)
            for u in updates
            if u.new_token_ids
        )

    engine.urgent.poll = gated_poll
    async_engine.add_update_listener(on_updates)

    async def collect(request_id: str, tenant: str) -> list[int]:
        tokens: list[int] = []
        async for out in async_engine.generate(
            request_id, prompts[request_id], GREEDY, share=TenantShare(tenant)
        ):
            tokens.extend(out.token_ids)
        return tokens

    async def scenario() -> dict[str, list[int]]:
        async_engine.start()
        try:
            a = asyncio.create_task(collect("a1", "A"))
            await asyncio.to_thread(paused.wait, 60)
            b = asyncio.create_task(collect("b0", "B"))
            while not async_engine._commands:  # B's add is queued (not a timing assert)
                await asyncio.sleep(0.005)
            b_queued.set()
            return {"a1": await a, "b0": await b}
        finally:
            b_queued.set()
            await async_engine.shutdown()

    assert asyncio.run(scenario()) == {"a1": reference["a1"], "b0": reference["b0"]}
    assert published[0] == ("b0", True)  # B's first token, from inside A's paused step
    assert engine.urgent.num_urgent_steps == 1
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
