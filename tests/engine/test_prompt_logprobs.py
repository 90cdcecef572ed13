"""Prompt logprobs through the engine and the offline API, on the tiny model.

The reference is transformers on the same float32 checkpoint: the entry of prompt token i is
log_softmax(model(prompt).logits)[i - 1] gathered at prompt[i]. Our prompt is computed in
chunks over the paged cache, transformers' in one pass, so values agree only to float32 noise,
which grows with context: over five random prompt sets the worst difference was 8.5e-5 at 40
tokens and 9.5e-5 at 100 (the same with a 32-token budget as with 2,048), hence TOL = 2e-4.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers

import engine.worker.model_runner
from engine import LLM, SamplingParams
from engine.core.scheduler_output import RequestUpdate

PROMPT_LENGTHS = [1, 2, 7, 17, 40, 100]
BUDGET = 32  # max_num_batched_tokens: the 40- and 100-token prompts take several steps


TOL = 2e-4


def greedy(max_tokens: int = 6, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def ids_prompts(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(tiny_model_dir, dtype="float32", max_num_batched_tokens=BUDGET, num_kv_blocks=64)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts(tiny_model_dir) -> list[list[int]]:
    vocab = transformers.AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    rng = random.Random(7)
    return [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


def reference(model, prompt: list[int]) -> torch.Tensor:
    """Row i - 1: transformers' log_softmax predicting prompt token i."""
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)


def assert_matches(entries, prompt: list[int], expected: torch.Tensor, num_top: int) -> None:
    """vLLM's shape and transformers' values: None, then one dict per prompt token."""
    assert len(entries) == len(prompt)
    assert entries[0] is None
    for i in range(1, len(prompt)):
        entry, token, row = entries[i], prompt[i], expected[i - 1]
        assert next(iter(entry)) == token  # the prompt token comes first
        assert set(row.topk(num_top).indices.tolist()) <= set(entry)
        assert len(entry) in (num_top, num_top + 1)
        for token_id, logprob in entry.items():
            assert logprob.token_id == token_id
            assert logprob.logprob == pytest.approx(row[token_id].item(), abs=TOL)
        # Rank = 1 + tokens strictly more likely, up to ties within float noise.
        value = row[token]
        rank = entry[token].rank
        assert 1 + int((row > value + TOL).sum()) <= rank <= 1 + int((row > value - TOL).sum())


class ScheduleRecorder:
    """Records (request id, num_new_tokens) of every scheduled chunk."""

    def __init__(self, llm: LLM) -> None:
        self.chunks: list[tuple[str, int]] = []
        scheduler = llm.engine.scheduler
        schedule = scheduler.schedule

        def recording():
            out = schedule()
            self.chunks.extend((s.request.request_id, s.num_new_tokens) for s in out.scheduled)
            return out

        scheduler.schedule = recording  # type: ignore[method-assign]

    def prefill_chunks(self, request_id: str) -> list[int]:
        return [n for rid, n in self.chunks if rid == request_id and n > 1]


def test_prompt_logprobs_match_transformers_over_chunked_prefill(tiny_model_dir, hf_model,
                                                                 prompts):
    llm = LLM(tiny_model_dir, dtype="float32", max_num_batched_tokens=BUDGET, num_kv_blocks=64)
    recorder = ScheduleRecorder(llm)
    outs = llm.generate(ids_prompts(prompts), greedy(prompt_logprobs=3), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches(out.prompt_logprobs, prompt, reference(hf_model, prompt), 3)
        assert out.num_cached_tokens == 0
    # The long prompt really was split over several steps (all prompts share the budget).
    assert len(recorder.prefill_chunks(outs[-1].request_id)) >= 4


def test_pieces_of_logits_are_bounded(llm, hf_model, prompts, monkeypatch):
    """Logits are computed a few rows at a time, and pieces that end mid-chunk lose nothing."""
    monkeypatch.setattr(engine.worker.model_runner, "PROMPT_LOGPROBS_MAX_ROWS", 5)
    model = llm.engine.model
    compute_logits = model.compute_logits
    sizes: list[int] = []

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        sizes.append(hidden.shape[0])
        return compute_logits(hidden)

    monkeypatch.setattr(model, "compute_logits", recording)
    # Sampling through the full logits too (not the screened argmax), so its calls are known.
    monkeypatch.setattr(model, "greedy_tokens", lambda hidden: None)
    prompt = prompts[-1]
    out = llm.generate({"prompt_token_ids": prompt}, greedy(prompt_logprobs=2), use_tqdm=False)[0]
    assert_matches(out.prompt_logprobs, prompt, reference(hf_model, prompt), 2)
    assert max(sizes) == 5
    # 99 entries in pieces of at most 5 rows within chunks of 32 (sampling adds 1-row calls).
    assert sum(sizes) - len(out.outputs[0].token_ids) == len(prompt) - 1


def test_cached_prefix_is_recomputed_and_blocks_still_cached(llm, hf_model):
    prompt = list(range(20, 68))  # 48 tokens: three full blocks of 16
    first = llm.generate({"prompt_token_ids": prompt}, greedy(), use_tqdm=False)[0]
    before = llm.get_stats()
    out = llm.generate({"prompt_token_ids": prompt}, greedy(prompt_logprobs=1),
                       use_tqdm=False)[0]
    after = llm.get_stats()
    assert out.num_cached_tokens == 0
    assert_matches(out.prompt_logprobs, prompt, reference(hf_model, prompt), 1)
    assert out.outputs[0].token_ids == first.outputs[0].token_ids
    # No lookup was made for it, so it counts as no query.
    assert after["prefix_cache_queries"] == before["prefix_cache_queries"]
    # It still stores its blocks: a fresh prompt computed with prompt logprobs serves a
    # later plain request from the cache.
    fresh = list(range(200, 248))
    llm.generate({"prompt_token_ids": fresh}, greedy(prompt_logprobs=0), use_tqdm=False)
    again = llm.generate({"prompt_token_ids": fresh}, greedy(), use_tqdm=False)[0]
    assert again.num_cached_tokens == 32


def test_top_k_order_ranks_and_decoded_tokens(llm, prompts):
    prompt = prompts[4]
    out = llm.generate({"prompt_token_ids": prompt}, greedy(prompt_logprobs=4), use_tqdm=False)[0]
    tokenizer = llm.get_tokenizer()
    for entry, token in zip(out.prompt_logprobs[1:], prompt[1:], strict=True):
        scored = entry[token]
        assert next(iter(entry)) == token
        assert len(entry) == (4 if scored.rank <= 4 else 5)
        by_value = sorted(entry.values(), key=lambda lp: -lp.logprob)
        assert [lp.rank for lp in by_value[:4]] == [1, 2, 3, 4]
        if scored.rank > 4:
            assert by_value[4] is scored
        for lp in entry.values():
            assert lp.decoded_token == tokenizer.decode([lp.token_id], skip_special_tokens=False)
    zero = llm.generate({"prompt_token_ids": prompt}, greedy(prompt_logprobs=0),
                        use_tqdm=False)[0]
    assert zero.prompt_logprobs[0] is None
    assert [list(entry) for entry in zero.prompt_logprobs[1:]] == [[t] for t in prompt[1:]]


def test_other_requests_in_the_batch_are_unchanged(llm, prompts):
    def params(i: int) -> SamplingParams:
        return greedy(12, logprobs=1, prompt_logprobs=2 if i % 2 else None)

    mixed = llm.generate(ids_prompts(prompts), [params(i) for i in range(len(prompts))],
                         use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(prompts, mixed, strict=True)):
        alone = llm.generate({"prompt_token_ids": prompt}, params(i), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        assert (out.prompt_logprobs is None) == (i % 2 == 0)
        for got, want in zip(out.outputs[0].logprobs, alone.outputs[0].logprobs, strict=True):
            assert list(got) == list(want)


def test_n_samples_take_the_first_samples_prompt_logprobs(llm, hf_model, prompts):
    prompt = prompts[4]
    params = SamplingParams(n=3, seed=2, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    before = llm.get_stats()["prefix_cache_hits"]
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert_matches(out.prompt_logprobs, prompt, reference(hf_model, prompt), 1)
    assert len(out.outputs) == 3
    # Only sample 0 computes them; samples 1 and 2 share its two full prompt blocks.
    assert llm.get_stats()["prefix_cache_hits"] - before == 2 * 32


def run_engine(llm: LLM) -> tuple[list[RequestUpdate], dict[str, int]]:
    """Step until done: every update, and per request the output count at each preemption."""
    engine = llm.engine
    updates: list[RequestUpdate] = []
    preempted_outputs: dict[str, int] = {}
    requests = dict(engine.scheduler.requests)
    while engine.has_unfinished_requests():
        updates.extend(engine.step())
        for request_id in engine.last_step_preempted:
            preempted_outputs.setdefault(request_id, requests[request_id].num_output_tokens)
    return updates, preempted_outputs


@pytest.mark.parametrize(
    ("num_blocks", "plain_max_tokens", "prompt_len", "max_tokens", "preempted_with"),
    [
        # The older plain request outgrows the pool while the long prompt is still prefilling.
        (8, 60, 100, 4, "no outputs"),
        # The prompt-logprobs request is preempted after its first token went out.
        (6, 80, 20, 40, "outputs"),
    ],
)
def test_preemption_never_duplicates_prompt_logprobs(
    tiny_model_dir, hf_model, num_blocks, plain_max_tokens, prompt_len, max_tokens,
    preempted_with,
):
    llm = LLM(tiny_model_dir, dtype="float32", num_kv_blocks=num_blocks,
              max_num_batched_tokens=BUDGET)
    prompt = list(range(100, 100 + prompt_len))
    params = greedy(max_tokens, prompt_logprobs=2)
    llm.engine.add_request("plain", list(range(10, 25)), greedy(plain_max_tokens))
    request = llm.engine.add_request("p", prompt, params)
    updates, preempted = run_engine(llm)
    assert llm.get_stats()["num_preemptions"] > 0
    assert request.num_preemptions > 0
    assert (preempted["p"] > 0) == (preempted_with == "outputs")
    carrying = [u for u in updates if u.prompt_logprobs is not None]
    assert [u.request.request_id for u in carrying] == ["p"]
    assert carrying[0].new_token_ids == request.output_token_ids[:1]
    expected = reference(hf_model, prompt)
    entries = carrying[0].prompt_logprobs
    assert entries is not None and len(entries) == prompt_len and entries[0] is None
    for i, entry in enumerate(entries[1:], 1):
        assert entry is not None and entry.sampled.token_id == prompt[i]
        assert entry.sampled.logprob == pytest.approx(expected[i - 1, prompt[i]].item(),
                                                      abs=TOL)
        assert [lp.rank for lp in entry.top] == [1, 2]
    assert request.pending_prompt_logprobs == []
    # The preempted request's tokens are those it produces alone.
    alone = LLM(tiny_model_dir, dtype="float32").generate(
        {"prompt_token_ids": prompt}, params, use_tqdm=False
    )[0]
    assert request.output_token_ids == alone.outputs[0].token_ids
