"""The scheduler's LoRA rule (engine.lora.admission): at most `max_loras` distinct adapters
per step, refused adapter requests keep their place, later adapter requests do not overtake
them (no starvation), base-model requests still pass."""

from __future__ import annotations

from engine.lora.admission import LoRAAdmission


def toks(start, n):
    return list(range(start, start + n))


def lora_harness(make_harness, max_loras, **kwargs):
    h = make_harness(**kwargs)
    h.scheduler.lora_admission = LoRAAdmission(max_loras)
    return h


def adapters_of(out) -> set[str]:
    return {s.request.lora_id for s in out.scheduled if s.request.lora_id is not None}


def test_a_step_holds_at_most_max_loras_adapters(make_harness):
    h = lora_harness(make_harness, 2, max_num_batched_tokens=64, num_blocks=32)
    h.add("a1", toks(10, 4), lora_id="A")
    h.add("b1", toks(20, 4), lora_id="B")
    h.add("c1", toks(30, 4), lora_id="C")
    h.add("a2", toks(40, 4), lora_id="A")
    h.add("base", toks(50, 4))
    out, _ = h.step()
    # c1 is refused (two adapters run); a2 may not overtake it; the base request passes.
    assert h.scheduled(out) == [("a1", 4), ("b1", 4), ("base", 4)]
    assert h.waiting == ["c1", "a2"]
    assert adapters_of(out) == {"A", "B"}


def test_refused_adapter_gets_the_first_slot_that_frees(make_harness):
    h = lora_harness(make_harness, 1, max_num_batched_tokens=64, num_blocks=32)
    h.add("a1", toks(10, 4), lora_id="A", max_tokens=2)
    h.add("b1", toks(20, 4), lora_id="B", max_tokens=2)
    h.add("a2", toks(30, 4), lora_id="A", max_tokens=2)
    seen: list[set[str]] = []
    order: list[str] = []
    while h.scheduler.has_unfinished_requests():
        out = h.schedule()
        seen.append(adapters_of(out))
        order.extend(
            s.request.request_id for s in out.scheduled if s.request.num_computed_tokens == 0
        )
        h.update(out)
    assert all(len(step) <= 1 for step in seen)
    # a2 (adapter A, already running) does not overtake b1: b1 runs before a2 starts.
    assert order == ["a1", "b1", "a2"]
    h.assert_all_blocks_free()


def test_without_lora_admission_nothing_changes(make_harness):
    h = make_harness(max_num_batched_tokens=64, num_blocks=32)
    for i, name in enumerate("ABC"):
        h.add(f"r{i}", toks(10 * i + 10, 4), lora_id=name)
    out, _ = h.step()
    assert adapters_of(out) == {"A", "B", "C"}
