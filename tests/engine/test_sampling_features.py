"""Penalties, logprobs, n > 1 and stop strings through the offline API, on the tiny model.

Exactness references come from transformers on the same float32 checkpoint: greedy with
repetition_penalty equals `generate(repetition_penalty=...)` token for token (transformers,
like vLLM, penalises prompt and output tokens), and logprobs equal log_softmax of the raw
logits (before penalties and temperature) of the same sequence.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from kvfleet.contracts.parallel_sampling import fan_out

NEW_TOKENS = 24
PROMPT_LENGTHS = [1, 7, 17, 40, 100]


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, **kwargs)


def ids_prompts(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(tiny_model_dir, dtype="float32")


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def prompts(tiny_model_dir) -> list[list[int]]:
    vocab = transformers.AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    rng = random.Random(99)
    return [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


def hf_greedy(model, ids: list[int], **kwargs) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the log_softmax of its raw logits at each step."""
    input_ids = torch.tensor([ids])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
        **kwargs,
    )
    return out.sequences[0, len(ids) :].tolist(), torch.stack(out.logits)[:, 0].log_softmax(-1)


def hf_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits predicting each output token (one forward pass)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0]
    return logits[len(prompt) - 1 : -1].float().log_softmax(-1)


def sampled_logprobs(completion) -> list[float]:
    return [d[t].logprob for d, t in zip(completion.logprobs, completion.token_ids, strict=True)]


# ---------------------------------------------------------------------------- penalties
def test_greedy_repetition_penalty_matches_transformers(llm, hf_model, prompts):
    outs = llm.generate(ids_prompts(prompts), greedy(repetition_penalty=1.3), use_tqdm=False)
    plain = llm.generate(ids_prompts(prompts), greedy(), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        expected, _ = hf_greedy(hf_model, prompt, repetition_penalty=1.3)
        assert out.outputs[0].token_ids == expected
    # The penalty really changed something, so the comparison above is not vacuous.
    assert [o.outputs[0].token_ids for o in outs] != [o.outputs[0].token_ids for o in plain]


def test_frequency_penalty_reduces_repeats(llm, prompts):
    def repeats(frequency_penalty: float) -> int:
        params = SamplingParams(
            temperature=1.0, seed=5, max_tokens=32, ignore_eos=True,
            frequency_penalty=frequency_penalty,
        )
        outs = llm.generate(ids_prompts(prompts), params, use_tqdm=False)
        return sum(32 - len(set(o.outputs[0].token_ids)) for o in outs)

    assert repeats(2.0) < repeats(0.0)


def test_batches_without_penalties_never_reach_the_penalty_code(llm, prompts, monkeypatch):
    import engine.worker.sampler

    def fail(*args, **kwargs):
        raise AssertionError("penalties applied to a batch that has none")

    monkeypatch.setattr(engine.worker.sampler, "apply_penalties", fail)
    params = [greedy(), greedy(logprobs=2), SamplingParams(max_tokens=4, seed=1)]
    llm.generate(ids_prompts(prompts[:3]), params, use_tqdm=False)


def test_plain_greedy_rows_are_unchanged_in_a_mixed_batch(llm, prompts):
    alone = llm.generate(ids_prompts(prompts), greedy(), use_tqdm=False)
    mixed_params = [
        greedy(),
        greedy(repetition_penalty=1.5, logprobs=3),
        greedy(),
        SamplingParams(temperature=0.8, frequency_penalty=1.0, presence_penalty=0.5,
                       logprobs=1, max_tokens=NEW_TOKENS, ignore_eos=True),
        greedy(),
    ]
    mixed = llm.generate(ids_prompts(prompts), mixed_params, use_tqdm=False)
    for i in (0, 2, 4):
        assert mixed[i].outputs[0].token_ids == alone[i].outputs[0].token_ids
        assert mixed[i].outputs[0].logprobs is None
        assert mixed[i].outputs[0].cumulative_logprob is None


# ---------------------------------------------------------------------------- logprobs
def test_greedy_logprobs_match_transformers(llm, hf_model, prompts):
    outs = llm.generate(ids_prompts(prompts), greedy(logprobs=5), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        completion = out.outputs[0]
        expected_ids, expected = hf_greedy(hf_model, prompt)
        # float32 noise grows with context: on the 100-token prompt transformers' own cached
        # generate and a full forward pass differ by 1.6e-4 (measured), ours by 1.4e-4.
        tol = 1e-4 if len(prompt) <= 40 else 3e-4
        assert completion.token_ids == expected_ids
        for step, (entry, token) in enumerate(zip(completion.logprobs, expected_ids, strict=True)):
            assert entry[token].rank == 1
            for token_id, logprob in entry.items():
                assert logprob.token_id == token_id
                assert logprob.logprob == pytest.approx(expected[step, token_id].item(), abs=tol)
        got = sampled_logprobs(completion)
        assert completion.cumulative_logprob == pytest.approx(sum(got), abs=1e-9)


def test_logprobs_are_raw_under_penalties_and_temperature(llm, hf_model, prompts):
    params = SamplingParams(
        temperature=0.6, seed=3, frequency_penalty=1.5, repetition_penalty=1.2, logprobs=3,
        max_tokens=NEW_TOKENS, ignore_eos=True,
    )
    out = llm.generate({"prompt_token_ids": prompts[2]}, params, use_tqdm=False)[0].outputs[0]
    expected = hf_logprobs(hf_model, prompts[2], out.token_ids)
    for step, (entry, token) in enumerate(zip(out.logprobs, out.token_ids, strict=True)):
        row = expected[step]
        for token_id, logprob in entry.items():
            assert logprob.logprob == pytest.approx(row[token_id].item(), abs=1e-4)
        # Ranks against the whole raw distribution (this model's margins are far above 1e-4).
        assert entry[token].rank == 1 + int((row > row[token]).sum())
        top3 = set(row.topk(3).indices.tolist())
        assert top3 <= set(entry) <= top3 | {token}


def test_top_k_logprobs_order_ranks_and_decoded_tokens(llm, prompts):
    out = llm.generate({"prompt_token_ids": prompts[1]},
                       SamplingParams(max_tokens=12, seed=11, logprobs=4, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    assert len(out.logprobs) == len(out.token_ids) == 12
    for entry, token in zip(out.logprobs, out.token_ids, strict=True):
        sampled = entry[token]
        assert next(iter(entry)) == token  # the sampled token comes first, as in vLLM
        assert len(entry) == (4 if sampled.rank <= 4 else 5)
        by_value = sorted(entry.values(), key=lambda lp: -lp.logprob)
        assert [lp.rank for lp in by_value[:4]] == [1, 2, 3, 4]
        if sampled.rank > 4:
            assert by_value[4] is sampled
        for lp in entry.values():
            assert lp.decoded_token == tokenizer.decode([lp.token_id], skip_special_tokens=False)


def test_logprobs_zero_lists_only_the_sampled_token(llm, prompts):
    out = llm.generate({"prompt_token_ids": prompts[0]}, greedy(logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    assert [list(entry) for entry in out.logprobs] == [[t] for t in out.token_ids]


# ---------------------------------------------------------------------------- n > 1
def test_n_seeded_samples_are_reproducible_and_differ(llm, prompts):
    params = SamplingParams(n=3, seed=7, temperature=1.0, max_tokens=12, ignore_eos=True)
    first = llm.generate(ids_prompts(prompts[:2]), params, use_tqdm=False)
    second = llm.generate(ids_prompts(prompts[:2]), params, use_tqdm=False)
    for a, b, prompt in zip(first, second, prompts[:2], strict=True):
        assert [c.index for c in a.outputs] == [0, 1, 2]
        samples = [c.token_ids for c in a.outputs]
        assert samples == [c.token_ids for c in b.outputs]
        assert len({tuple(s) for s in samples}) == 3
        assert a.prompt_token_ids == prompt
    # Sample i is the request with seed + i (kvfleet.contracts.parallel_sampling).
    single = SamplingParams(seed=8, temperature=1.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": prompts[0]}, single, use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == first[0].outputs[1].token_ids


def test_n_samples_share_the_prompt_blocks(tiny_model_dir):
    llm = LLM(tiny_model_dir, dtype="float32", num_kv_blocks=64)
    engine = llm.engine
    peak = 0
    step = engine.step

    def recording_step():
        nonlocal peak
        updates = step()
        peak = max(peak, engine.kv.num_blocks - engine.kv.num_free_blocks)
        return updates

    engine.step = recording_step  # type: ignore[method-assign]
    prompt = list(range(100, 140))  # 40 tokens: two full blocks of 16, then 8 more
    params = SamplingParams(n=3, seed=1, max_tokens=8, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 8 for c in out.outputs)
    stats = llm.get_stats()
    # Samples 1 and 2 each hit the two full prompt blocks that sample 0 filled.
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (120, 64)
    assert out.num_cached_tokens == 0
    # Three separate prompts need 3 blocks each (47 computed tokens); shared: 2 + 3 x 1.
    assert peak == 5
    assert stats["kv_blocks_free"] == 64


def test_chat_with_n(llm):
    messages = [{"role": "user", "content": "hello"}]
    out = llm.chat(messages, SamplingParams(n=2, seed=0, max_tokens=4, ignore_eos=True),
                   use_tqdm=False)
    assert len(out) == 1 and [c.index for c in out[0].outputs] == [0, 1]


def test_fan_out_ids_and_seeds():
    params = SamplingParams(n=2, seed=10)
    assert [(rid, p.n, p.seed) for rid, p in fan_out("x", params)] == [
        ("0_x", 1, 10), ("1_x", 1, 11)
    ]
    assert fan_out("x", SamplingParams()) == [("x", SamplingParams())]


# ---------------------------------------------------------------------------- stop strings
STOP_PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def reference_text(llm) -> tuple[str, list[int]]:
    out = llm.generate(STOP_PROMPT, greedy(), use_tqdm=False)[0].outputs[0]
    return out.text, out.token_ids


def pick_stop(text: str, occurrences: int = 1) -> str:
    """A 2-character ASCII stop string occurring at least `occurrences` times after the start."""
    for i in range(1, len(text) - 1):
        candidate = text[i : i + 2]
        if candidate.isascii() and candidate.isprintable() and text.count(candidate) >= occurrences:
            return candidate
    pytest.skip("the tiny model's greedy text has no suitable stop string")


def test_stop_string_cuts_text_and_ends_the_request(llm, reference_text):
    text, token_ids = reference_text
    stop = pick_stop(text)
    before = llm.get_stats()["generation_tokens"]
    out = llm.generate(STOP_PROMPT, greedy(stop=[stop], logprobs=1), use_tqdm=False)[0].outputs[0]
    assert out.text == text[: text.index(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    tokenizer = llm.get_tokenizer()
    # Token ids run up to the token that completed the stop string, and no further.
    assert out.token_ids == token_ids[: len(out.token_ids)]
    assert stop in tokenizer.decode(out.token_ids)
    assert stop not in tokenizer.decode(out.token_ids[:-1])
    assert len(out.logprobs) == len(out.token_ids)
    # The engine request ended at the match: no tokens generated past it, blocks all free.
    assert llm.get_stats()["generation_tokens"] - before == len(out.token_ids)
    assert llm.get_stats()["kv_blocks_free"] == llm.get_stats()["kv_blocks_total"]


def test_include_stop_str_in_output(llm, reference_text):
    text, _ = reference_text
    stop = pick_stop(text)
    out = llm.generate(STOP_PROMPT, greedy(stop=["\x00never", stop],
                                           include_stop_str_in_output=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[: text.index(stop) + len(stop)]
    assert out.stop_reason == stop


def test_stop_string_is_checked_only_from_min_tokens(llm, reference_text):
    text, token_ids = reference_text
    stop = pick_stop(text, occurrences=2)
    tokenizer = llm.get_tokenizer()
    first_end = next(n for n in range(1, len(token_ids) + 1)
                     if stop in tokenizer.decode(token_ids[:n]))
    out = llm.generate(STOP_PROMPT, greedy(stop=[stop], min_tokens=first_end + 1),
                       use_tqdm=False)[0].outputs[0]
    second = text.index(stop, text.index(stop) + 1)
    assert out.finish_reason == "stop"
    assert out.text == text[:second]


def test_stop_string_never_seen_runs_to_length(llm, reference_text):
    text, token_ids = reference_text
    out = llm.generate(STOP_PROMPT, greedy(stop=["\x00never"]), use_tqdm=False)[0].outputs[0]
    assert (out.text, out.token_ids) == (text, token_ids)
    assert (out.finish_reason, out.stop_reason) == ("length", None)
