"""Urgent steps (engine.urgent_step) keep every request's greedy output equal to transformers'.

Tenant A's long prompts run in chunks (budget 32); at chosen steps the test's poll, called
between layers exactly as the engine service's is, adds requests of new tenants and runs an
urgent step for them inside the paused step. No timing: the steps and the layer are fixed.
"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.request import TenantShare
from tests.fixtures.greedy import random_prompts, transformers_greedy

NEW_TOKENS = 8
A_LENGTHS = [100, 150, 64]
# Step -> the requests (id, tenant) added while that step is paused after layer 0. b1's
# prompt does not fit in what b0 leaves of the urgent step's budget: it gets a chunk there
# and finishes in ordinary steps.
PLAN = {2: [("b0", "B", 7), ("b1", "B", 40)], 5: [("c0", "C", 17)]}
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tiny_model_dir) -> dict[str, list[int]]:
    ids = [f"a{i}" for i in range(len(A_LENGTHS))]
    lengths = list(A_LENGTHS)
    for added in PLAN.values():
        ids += [rid for rid, _, _ in added]
        lengths += [n for _, _, n in added]
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
        rid: engine.add_request(rid, prompts[rid], GREEDY, share=TenantShare("A"))
        for rid in prompts
        if rid.startswith("a")
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
        assert not urgent.admits("A", 0)  # A has requests in the engine
        assert not urgent.admits("D", 1)  # a worse priority than the paused step's
        assert all(urgent.admits(tenant, 0) for _, tenant, _ in added)
        for rid, tenant, _ in added:
            requests[rid] = engine.add_request(rid, prompts[rid], GREEDY, share=TenantShare(tenant))
        assert not urgent.admits(added[0][1], 0)  # present now
        for update in urgent.run([rid for rid, _, _ in added]):
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


def test_off_by_default_and_off_where_unsupported(tiny_model_dir):
    assert not LLM(tiny_model_dir, dtype="float32").engine.urgent.enabled
    fcfs = LLM(
        tiny_model_dir,
        dtype="float32",
        scheduling_policy="fcfs",
        preempt_steps_for_new_tenants=True,
    )
    assert not fcfs.engine.urgent.enabled
