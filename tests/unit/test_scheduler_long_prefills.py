"""The long-prompt limit (engine.core.long_prefill_limit) on tiny configs: 4-token blocks, a
long prompt is one with more than 4 tokens to compute.

Exact admitted ids, chunk sizes and block ids per step, with and without the limit.
"""

import pytest

from engine.config import EngineConfig
from engine.core.long_prefill_limit import MAX_WAITS, default_threshold

P = list(range(100, 108))  # two full blocks, shared by the a* requests
Q = list(range(200, 208))  # two full blocks, shared by the b* requests


def limited(make_harness, **kwargs):
    kwargs.setdefault("max_num_batched_tokens", 32)
    kwargs.setdefault("num_blocks", 20)
    return make_harness(max_long_partial_prefills=1, long_prefill_token_threshold=4, **kwargs)


def add_two_prefixes(h):
    h.add("a1", P + [1, 2])
    h.add("b1", Q + [3, 4])
    h.add("a2", P + [5, 6])
    h.add("b2", Q + [7, 8])


def test_without_limit_both_prefixes_share_a_step_and_followers_wait_for_the_next(make_harness):
    h = make_harness(max_num_batched_tokens=32, num_blocks=20)
    add_two_prefixes(h)
    out, _ = h.step()
    assert h.scheduled(out) == [("a1", 10), ("b1", 10)]
    out, _ = h.step()
    assert h.scheduled(out) == [("a1", 1), ("b1", 1), ("a2", 2), ("b2", 2)]


def test_one_long_prompt_per_step_while_followers_wait_on_it(make_harness):
    h = limited(make_harness)
    add_two_prefixes(h)
    out, _ = h.step()
    # a2 follows a1's prefix, so b1 waits: a1's followers get their first token a step sooner.
    assert h.scheduled(out) == [("a1", 10)]
    assert h.waiting == ["b1", "a2", "b2"]
    out, _ = h.step()
    # a2 is short now (8 of its 10 tokens are cached) and goes first; b1 starts beside it.
    assert h.scheduled(out) == [("a1", 1), ("a2", 2), ("b1", 10)]
    assert h.block_ids("a2")[:2] == h.block_ids("a1")[:2] == [0, 1]
    out, _ = h.step()
    assert h.scheduled(out) == [("a1", 1), ("b1", 1), ("a2", 1), ("b2", 2)]
    assert h.block_ids("b2")[:2] == h.block_ids("b1")[:2]
    h.run_to_completion()
    h.assert_all_blocks_free()


def test_without_followers_long_prompts_batch_as_without_the_limit(make_harness):
    h = limited(make_harness)
    h.add("x", list(range(10, 20)))
    h.add("y", list(range(20, 30)))
    h.add("z", list(range(30, 40)))
    out, _ = h.step()
    assert h.scheduled(out) == [("x", 10), ("y", 10), ("z", 10)]


def test_short_prompts_go_ahead_of_long_ones(make_harness):
    h = limited(make_harness, max_num_batched_tokens=8)
    h.add("long", list(range(10, 22)))
    h.add("short", [1, 2, 3])
    out, _ = h.step()
    assert h.scheduled(out) == [("short", 3), ("long", 5)]


def test_running_long_chunk_counts_against_the_limit(make_harness):
    h = limited(make_harness, max_num_batched_tokens=12)
    h.add("a1", P + list(range(1, 11)))  # 18 tokens: chunked over two steps
    h.add("b1", Q + [3, 4])
    h.add("a2", P + [5, 6])
    h.add("a3", P + list(range(1, 9)) + [50, 51])  # follows a1 up to its fourth block
    out, _ = h.step()
    assert h.scheduled(out) == [("a1", 12)]
    out, _ = h.step()
    # a1's last 6 tokens are the step's long prompt and compute the block a3 waits on.
    assert h.scheduled(out) == [("a1", 6), ("a2", 2)]
    assert h.waiting == ["b1", "a3"]
    out, _ = h.step()
    assert h.scheduled(out) == [("a1", 1), ("a2", 1), ("a3", 2), ("b1", 8)]


def test_a_long_prompt_passed_over_too_often_goes_in_arrival_order(make_harness):
    # Budget 3: each step a new short prompt would take it all, ahead of the long one.
    h = limited(make_harness, max_num_batched_tokens=3, max_num_seqs=64, num_blocks=64)
    h.add("long", list(range(10, 22)))
    for step in range(MAX_WAITS):
        h.add(f"s{step}", [1000 + 3 * step, 1001 + 3 * step, 1002 + 3 * step], max_tokens=1)
        out, _ = h.step()
        assert h.scheduled(out) == [(f"s{step}", 3)]
    h.add("late", [7, 8, 9], max_tokens=1)
    out, _ = h.step()
    assert h.scheduled(out) == [("long", 3)]
    assert h.waiting == ["late"]


def test_short_prefill_steps_start_no_long_prompt_beside_short_ones(make_harness):
    h = make_harness(max_num_batched_tokens=32, num_blocks=20, short_prefill_steps=True,
                     long_prefill_token_threshold=4)
    h.add("a1", P + [1, 2], max_tokens=1)
    h.step()
    h.add("long", list(range(10, 20)))
    h.add("a2", P + [5, 6])  # 8 of its 10 tokens are cached: short
    out, _ = h.step()
    assert h.scheduled(out) == [("a2", 2)]
    assert h.block_ids("a2")[:2] == [0, 1]
    out, _ = h.step()
    assert h.scheduled(out) == [("a2", 1), ("long", 10)]


def test_short_prefill_steps_hold_a_long_prompt_back_once(make_harness):
    h = make_harness(max_num_batched_tokens=16, max_num_seqs=64, num_blocks=64,
                     short_prefill_steps=True, long_prefill_token_threshold=4)
    h.add("long", list(range(10, 22)))
    h.add("s0", [1000, 1001, 1002], max_tokens=1)
    out, _ = h.step()
    assert h.scheduled(out) == [("s0", 3)]
    h.add("s1", [2000, 2001, 2002], max_tokens=1)
    out, _ = h.step()
    assert h.scheduled(out) == [("s1", 3), ("long", 12)]


def test_default_threshold_is_four_percent_of_the_context():
    assert default_threshold(2048) == 81
    assert default_threshold(10) == 1


@pytest.mark.parametrize("field,value", [("max_long_partial_prefills", -1),
                                         ("long_prefill_token_threshold", -2)])
def test_negative_settings_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(model="m", **{field: value})


BASE_ARGV = ["--model", "m", "--engine-id", "e", "--redis-url", "redis://127.0.0.1:1"]


def test_engine_flags_reach_the_config():
    from engine.service.server import build_parser, options_from_args

    args = build_parser().parse_args(
        [*BASE_ARGV, "--max-long-partial-prefills", "1", "--long-prefill-token-threshold", "64"])
    engine = options_from_args(args).engine
    assert (engine.max_long_partial_prefills, engine.long_prefill_token_threshold) == (1, 64)
    assert not engine.short_prefill_steps
    default = options_from_args(build_parser().parse_args(BASE_ARGV)).engine
    assert (default.max_long_partial_prefills, default.long_prefill_token_threshold) == (None, 0)
    short = options_from_args(build_parser().parse_args([*BASE_ARGV, "--short-prefill-steps"]))
    assert short.engine.short_prefill_steps


def test_a_negative_flag_is_refused(capsys):
    from engine.service.server import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args([*BASE_ARGV, "--max-long-partial-prefills", "-1"])
    assert "--max-long-partial-prefills" in capsys.readouterr().err
