"""Speculative decoding keeps greedy output equal to transformers' `generate`, token for token.

Drafts come from the real n-gram proposer and from an oracle proposer that drafts the reference
continuation with deliberate mistakes at fixed positions, so every verification outcome occurs
on the random tiny model: all drafts kept (plus the bonus token), some kept, none kept, and
drafts crossing block boundaries. The oracle is a proposer like any other (the engine verifies
whatever it drafts); it makes acceptance deterministic, which n-gram lookup on a random model
cannot. Every scheduling mode of test_exactness runs: one mixed batch with non-speculating
requests, a tiny token budget (chunked prefill, drafts cut to the budget), preemption, prefix
hits. Block-pool integrity is checked after every step and every block is free at the end.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import transformers

from engine import LLM, SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.core.request import Request
from engine.spec_decode.speculator import max_drafts
from tests.fixtures.greedy import run_checked as run_to_completion
from tests.fixtures.greedy import transformers_greedy

NEW_TOKENS = 32
PROMPT_LENGTHS = [1, 2, 7, 16, 17, 33, 64, 100]
NUM_DRAFTS = 5
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": NUM_DRAFTS,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tiny_model_dir) -> list[list[int]]:
    vocab = transformers.AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    rng = random.Random(4321)
    out = [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENGTHS]
    phrase = [rng.randrange(vocab) for _ in range(9)]
    return [*out, phrase * 5]  # a repetitive prompt, where n-gram lookup finds matches


@pytest.fixture(scope="module")
def reference(tiny_model_dir, prompts) -> list[list[int]]:
    return transformers_greedy(tiny_model_dir, prompts, NEW_TOKENS)


class OracleProposer:
    """Drafts the reference continuation of the request's prompt; at output index t, draft
    (t + len(prompt)) % 7 is wrong when there is one (so 2 windows in 7 are all right, and a
    wrong first draft keeps none); prompts without a reference get no drafts."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        self.continuations = continuations
        self.vocab = vocab

    def propose_for(self, requests: Sequence[Request]) -> None:
        for request in requests:
            reference = self.continuations.get(tuple(request.prompt_token_ids))
            if reference is None:
                request.spec_token_ids = []
                continue
            t = request.num_output_tokens
            salt = request.num_prompt_tokens
            drafts = reference[t : t + min(NUM_DRAFTS, max_drafts(request))]
            request.spec_token_ids = [
                (token + 1) % self.vocab if (t + salt) % 7 == j else token
                for j, token in enumerate(drafts)
            ]


def run_checked(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams):
    return run_to_completion(engine, prompts, params)[0]


def oracle_llm(
    tiny_model_dir, prompts, reference, speculating: Sequence[int], **engine_args
) -> LLM:
    llm = LLM(tiny_model_dir, dtype="float32", speculative_config=NGRAM, **engine_args)
    speculator = llm.engine.speculator
    assert speculator is not None
    vocab = llm.engine.model_config.vocab_size
    continuations = {tuple(prompts[i]): reference[i] for i in speculating}
    speculator.proposer = OracleProposer(continuations, vocab)
    return llm


def spec_stats(llm: LLM) -> dict[str, int | float]:
    return {k: v for k, v in llm.get_stats().items() if k.startswith("spec_decode")}


MODES = [
    pytest.param({}, id="one-batch"),
    pytest.param({"max_num_batched_tokens": 32}, id="chunked-32"),
    pytest.param({"max_num_seqs": 3}, id="max-seqs-3"),
    pytest.param({"enable_prefix_caching": False}, id="no-prefix-cache"),
    pytest.param({"attention_backend": "torch"}, id="torch-attention"),
    pytest.param({"num_kv_blocks": 20, "max_num_batched_tokens": 64}, id="preemption"),
]


@pytest.mark.parametrize("engine_args", MODES)
def test_oracle_drafts_keep_greedy_exact(tiny_model_dir, prompts, reference, engine_args):
    # Even requests speculate, odd ones decode plainly in the same batches.
    llm = oracle_llm(tiny_model_dir, prompts, reference, range(0, len(prompts), 2), **engine_args)
    got = run_checked(llm.engine, prompts, GREEDY)
    assert got == reference
    stats = spec_stats(llm)
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    # Some steps kept all five drafts, some kept none.
    assert stats[f"spec_decode_num_accepted_tokens_per_pos_{NUM_DRAFTS - 1}"] > 0
    assert stats["spec_decode_num_accepted_tokens_per_pos_0"] < stats["spec_decode_num_drafts"]
    if "num_kv_blocks" in engine_args:
        assert llm.get_stats()["num_preemptions"] > 0


def test_ngram_keeps_greedy_exact(tiny_model_dir, prompts, reference):
    llm = LLM(tiny_model_dir, dtype="float32", speculative_config=NGRAM)
    assert run_checked(llm.engine, prompts, GREEDY) == reference
    assert spec_stats(llm)["spec_decode_num_draft_tokens"] > 0


def test_prefix_hits_after_speculation_are_exact(tiny_model_dir, prompts, reference):
    """Blocks cached while speculating hold only kept tokens: a second pass over prompt +
    output hits them and still decodes exactly."""
    llm = oracle_llm(tiny_model_dir, prompts, reference, range(len(prompts)))
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == reference
    assert spec_stats(llm)["spec_decode_num_accepted_tokens"] > 0
    # Continue each request from prompt + its first 20 output tokens: their full blocks were
    # cached while speculating; the oracle has no reference for the new ids.
    extended = [p + r[:20] for p, r in zip(prompts, reference, strict=True)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    second = llm.generate([{"prompt_token_ids": p} for p in extended], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in second] == [r[20:] for r in reference]
    hits = [o.num_cached_tokens for o in second]
    assert hits == [((len(p) - 1) // 16) * 16 for p in extended]


def _outputs(llm: LLM, prompts, params) -> list[tuple]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        (c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in (o.outputs[0] for o in outs)
    ]


def test_stops_inside_a_kept_run_end_where_plain_decoding_ends(tiny_model_dir, prompts, reference):
    """Stop tokens, stop strings and max_tokens that land inside a run of kept drafts."""
    plain = LLM(tiny_model_dir, dtype="float32")
    spec = oracle_llm(tiny_model_dir, prompts, reference, range(len(prompts)))
    tokenizer = plain.get_tokenizer()
    for i, ref in enumerate(reference):
        stop_token = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop_token_ids=[ref[9]])
        text = tokenizer.decode(ref[:20])
        stop_string = SamplingParams(
            temperature=0.0,
            max_tokens=NEW_TOKENS,
            ignore_eos=True,
            stop=[text[len(text) // 2 : len(text) // 2 + 2]],
        )
        length = SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True)
        for params in (stop_token, stop_string, length):
            expected = _outputs(plain, [prompts[i]], params)
            assert _outputs(spec, [prompts[i]], params) == expected, (i, params)
            spec.engine.scheduler.check_integrity()
    assert spec_stats(spec)["spec_decode_num_accepted_tokens"] > 0
    assert spec.engine.kv.num_free_blocks == spec.engine.kv.num_blocks


def test_logprobs_of_verified_tokens_match_plain_decoding(tiny_model_dir, prompts, reference):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    plain = LLM(tiny_model_dir, dtype="float32").generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )
    spec = oracle_llm(tiny_model_dir, prompts, reference, range(len(prompts))).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )
    for a, b in zip(plain, spec, strict=True):
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids == cb.token_ids
        assert ca.logprobs is not None and cb.logprobs is not None
        for da, db in zip(ca.logprobs, cb.logprobs, strict=True):
            assert list(da) == list(db)
            assert [x.logprob for x in da.values()] == pytest.approx(
                [x.logprob for x in db.values()], abs=1e-4
            )


def test_penalties_and_min_tokens_see_the_drafts_before_them(tiny_model_dir, prompts):
    """Row j of a verification is processed with drafts 1..j as outputs (penalties) and
    with EOS banned while outputs would be under min_tokens, as plain decoding does."""
    plain = LLM(tiny_model_dir, dtype="float32")
    eos = sorted(plain.engine.eos_token_ids)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=NEW_TOKENS,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.4,
        min_tokens=12,
        stop_token_ids=[t for t in range(40)],
    )
    expected = _outputs(plain, prompts, params)
    spec = oracle_llm(tiny_model_dir, prompts, [e[0] for e in expected], range(len(prompts)))
    assert _outputs(spec, prompts, params) == expected
    assert spec_stats(spec)["spec_decode_num_accepted_tokens"] > 0
    assert eos  # the tiny model has an EOS id, banned before min_tokens


def test_seeded_sampling_with_speculation_repeats(tiny_model_dir, prompts, reference):
    """Rejection sampling draws only from the request's own generator: a seeded request gives
    the same tokens run to run, alone or beside other requests."""
    params = SamplingParams(
        temperature=0.8, top_k=50, top_p=0.9, seed=7, max_tokens=NEW_TOKENS, ignore_eos=True
    )
    unseeded = SamplingParams(temperature=1.0, max_tokens=NEW_TOKENS, ignore_eos=True)

    def run(batch: bool) -> list[int]:
        llm = oracle_llm(tiny_model_dir, prompts, reference, range(len(prompts)))
        items = [{"prompt_token_ids": prompts[-1]}]
        all_params = [params]
        if batch:
            items += [{"prompt_token_ids": p} for p in prompts[:4]]
            all_params += [unseeded] * 4
        outs = llm.generate(items, all_params, use_tqdm=False)
        assert spec_stats(llm)["spec_decode_num_drafts"] > 0
        return outs[0].outputs[0].token_ids

    alone = run(batch=False)
    assert run(batch=False) == alone
    assert run(batch=True) == alone
