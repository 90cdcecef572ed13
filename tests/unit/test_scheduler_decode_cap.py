"""The decode-role prompt cap (engine.core.decode_prefill_cap): in a step that decodes,
prompts get at most `max_prefill_tokens_per_decode_step` tokens between them; decodes are
never held back, and without decodes (or without the cap) prompts get the whole budget."""

from __future__ import annotations

from engine.core.decode_prefill_cap import PrefillCap


def _decoding(harness, *ids):
    for request_id in ids:
        harness.add(request_id, 3, max_tokens=30)
    harness.step()  # their prompts, whole: nothing decodes yet
    return ids


def test_prompt_beside_decodes_is_chunked_to_the_cap(make_harness):
    h = make_harness(num_blocks=40, max_num_batched_tokens=32,
                     max_prefill_tokens_per_decode_step=4)
    _decoding(h, "a", "b")
    h.add("p", 10)
    chunks = []
    for _ in range(3):
        out, _ = h.step()
        got = dict(h.scheduled(out))
        assert got["a"] == 1 and got["b"] == 1  # decodes go every step
        chunks.append(got["p"])
    assert chunks == [4, 4, 2]
    out, _ = h.step()
    assert dict(h.scheduled(out)) == {"a": 1, "b": 1, "p": 1}


def test_prompts_share_the_cap_in_order(make_harness):
    h = make_harness(num_blocks=40, max_num_batched_tokens=32,
                     max_prefill_tokens_per_decode_step=4)
    _decoding(h, "a")
    h.add("p", 6)
    h.add("q", range(20, 26))
    out, _ = h.step()
    assert h.scheduled(out) == [("a", 1), ("p", 4)]
    assert h.waiting == ["q"]  # keeps its place for the next step
    out, _ = h.step()
    assert sorted(h.scheduled(out)) == [("a", 1), ("p", 2), ("q", 2)]


def test_no_cap_without_decodes_or_without_the_setting(make_harness):
    capped = make_harness(num_blocks=40, max_num_batched_tokens=32,
                          max_prefill_tokens_per_decode_step=4)
    capped.add("p", 10)
    capped.add("q", range(20, 30))
    out, _ = capped.step()
    assert h_tokens(capped, out) == {"p": 10, "q": 10}  # nothing decodes: whole budget
    plain = make_harness(num_blocks=40, max_num_batched_tokens=32)
    _decoding(plain, "a")
    plain.add("p", 10)
    out, _ = plain.step()
    assert h_tokens(plain, out) == {"a": 1, "p": 10}


def test_capped_prompts_finish_and_free_their_blocks(make_harness):
    h = make_harness(num_blocks=60, max_num_batched_tokens=32,
                     max_prefill_tokens_per_decode_step=3)
    _decoding(h, "a", "b")
    requests = [h.add(f"p{i}", range(40 * i + 10, 40 * i + 17 + i), max_tokens=5)
                for i in range(3)]
    h.run_to_completion()
    assert [r.num_output_tokens for r in requests] == [5, 5, 5]
    assert h.scheduler.num_preemptions == 0
    h.assert_all_blocks_free()


def test_cap_ignores_imported_and_decoding_requests(make_harness):
    h = make_harness(num_blocks=40, max_model_len=64)
    request = h.add("i", 9)
    cap = PrefillCap(0)
    assert cap.limit(request, 16) == 0  # a prompt: none of the spent cap
    request.kv_imported = True
    assert cap.limit(request, 16) == 16  # its prompt's KV came from a prefill engine
    request.kv_imported = False
    request.num_computed_tokens = 8
    assert cap.limit(request, 16) == 0  # its last prompt token is still a prompt token
    request.num_computed_tokens = 9
    request.append_output_token(500)
    assert cap.limit(request, 16) == 16  # a decode row
    assert PrefillCap.for_step(4, False, [request]).left is None  # no chunked prefill


def h_tokens(harness, out):
    return dict(harness.scheduled(out))
