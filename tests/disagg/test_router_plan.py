"""plan_disagg and without_prefill_engines: which engines a request goes through."""

from __future__ import annotations

from router.engines.disagg import (
    DisaggConfig,
    first_engine,
    plan_disagg,
    without_prefill_engines,
)
from router.routing.engine_view import EngineView


def _view(engine_id: str, role: str, running: int = 0, usage: float = 0.0) -> EngineView:
    return EngineView(engine_id, f"{engine_id}:1", num_running=running, kv_cache_usage=usage,
                      role=role)


RANKING = [_view("p1", "prefill"), _view("d1", "decode", 3), _view("p0", "prefill"),
           _view("d0", "decode", 1, 0.5), _view("d2", "decode", 1, 0.2), _view("b0", "both")]
CONFIG = DisaggConfig(prefill_threshold=100)


def test_long_prompt_takes_ranked_prefill_and_least_loaded_decode():
    plan = plan_disagg(RANKING, 100, CONFIG)
    assert plan is not None
    assert [v.engine_id for v in plan.prefill] == ["p1", "p0"]  # the decision's order
    assert plan.decode.engine_id == "d2"  # load 1, then the lower KV usage


def test_what_skips_the_prefill_stage():
    assert plan_disagg(RANKING, 99, CONFIG) is None  # short prompt
    assert plan_disagg(RANKING, 500, CONFIG, num_samples=2) is None
    assert plan_disagg(RANKING, 500, CONFIG, lora_id="a") is None
    colocated = [_view("b0", "both"), _view("b1", "both")]
    assert plan_disagg(colocated, 500, CONFIG) is None
    assert plan_disagg([_view("p0", "prefill")], 500, CONFIG) is None


def test_whole_requests_avoid_prefill_engines():
    assert [v.engine_id for v in without_prefill_engines(RANKING)] == [
        "d1", "d0", "d2", "b0", "p1", "p0"]


def test_the_first_engine_is_the_one_sent_to_first():
    def first(*args, **kwargs):
        engine = first_engine(*args, **kwargs)
        return engine.engine_id if engine is not None else None

    assert first(RANKING, 100, CONFIG) == "p1"  # the plan's first prefill engine
    assert first(RANKING, 99, CONFIG) == "d1"  # whole: prefill engines skipped
    assert first(RANKING, 500, CONFIG, num_samples=2) == "d1"
    assert first([_view("p0", "prefill")], 500, CONFIG) == "p0"  # the last resort
    assert first([], 500, CONFIG) is None
