"""The copier's pacing (engine.disagg.copy_pacer): at most one paced batch beside each step,
none held up while the engine is idle, and never held up past its bound."""

from __future__ import annotations

import threading

from engine.disagg.copy_pacer import CopyPacer

JOIN_S = 30.0


def _turn_in_thread(pacer: CopyPacer, done: list[str], name: str) -> threading.Thread:
    thread = threading.Thread(target=lambda: (pacer.turn(), done.append(name)))
    thread.start()
    return thread


def test_idle_engine_never_holds_a_batch():
    pacer = CopyPacer(max_wait_s=JOIN_S * 10)
    done: list[str] = []

    def three_batches() -> None:
        for _ in range(3):
            pacer.turn()
            done.append("b")
    thread = threading.Thread(target=three_batches)
    thread.start()
    thread.join(JOIN_S)
    assert done == ["b", "b", "b"]


def test_one_batch_per_step():
    pacer = CopyPacer(max_wait_s=JOIN_S * 10)
    done: list[str] = []
    with pacer.stepping():
        pacer.turn()  # the first batch beside this step: at once
        second = _turn_in_thread(pacer, done, "second")
        second.join(0.3)
        assert done == []  # this step already has its batch
        done.append("step 1 ends")
    second.join(JOIN_S)  # between steps: it runs (beside the next step)
    with pacer.stepping():
        third = _turn_in_thread(pacer, done, "third")
        third.join(0.3)
        assert done == ["step 1 ends", "second"]  # step 2 is the second batch's
        done.append("step 2 ends")
    third.join(JOIN_S)
    assert done == ["step 1 ends", "second", "step 2 ends", "third"]


def test_a_batch_that_missed_the_gap_runs_beside_the_next_step():
    """The copier was still copying while one step ended and the next began: its next batch
    runs at once, beside the new step."""
    pacer = CopyPacer(max_wait_s=JOIN_S * 10)
    done: list[str] = []
    with pacer.stepping():
        pacer.turn()
    with pacer.stepping():
        batch = _turn_in_thread(pacer, done, "next")
        batch.join(JOIN_S)
        assert done == ["next"]


def test_a_long_step_holds_a_batch_only_up_to_the_bound():
    pacer = CopyPacer(max_wait_s=0.05)
    done: list[str] = []
    with pacer.stepping():
        pacer.turn()
        late = _turn_in_thread(pacer, done, "late")
        late.join(JOIN_S)
        assert done == ["late"]  # ran although the step never ended
