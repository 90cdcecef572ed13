"""Structured outputs through the offline API, on the tiny model: exact against a reference.

The reference is a plain loop: transformers' float32 logits of the whole sequence, the same
llguidance grammar (kvfleet.contracts.structured_grammar) followed by a matcher built here
from tokenizer.json, its bitmask unpacked with numpy, argmax over the allowed ids, until EOS
or max_tokens. Random weights emit garbage, so the grammar alone gives the output its shape.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import llguidance
import llguidance.torch
import numpy as np
import pytest
import torch
import transformers

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.core.request import TenantShare
from engine.lora.request import LoRARequest
from kvfleet.contracts.errors import InvalidFieldError
from kvfleet.contracts.structured_grammar import llguidance_grammar
from kvfleet.text.tokenizer import load_generation_eos_ids
from tests.fixtures.greedy import random_prompts, run_checked
from tests.fixtures.lora_adapters import ADAPTERS, peft_model

MAX_TOKENS = 24
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json": StructuredOutputsParams(json=PERSON, disable_any_whitespace=True),
    "json_object": StructuredOutputsParams(json_object=True),
    "regex": StructuredOutputsParams(regex=r"[a-z]{2,5}-[0-9]{1,3}"),
    "choice": StructuredOutputsParams(choice=["yes", "no", "maybe not"]),
    "grammar": StructuredOutputsParams(grammar='start: "a" ("b" | "c")* "d"'),
    "gbnf": StructuredOutputsParams(grammar='root ::= "x" [0-9]+ "y"'),
}


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(tiny_model_dir, dtype="float32")


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts(tiny_model_dir) -> list[list[int]]:
    return random_prompts(tiny_model_dir, [1, 9, 30], seed=37)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, hf_model):
    return reference_loop(tiny_model_dir, hf_model)


def reference_loop(tiny_model_dir, hf_model):
    """(prompt, constraint) -> the constrained greedy tokens of `hf_model` (cached)."""
    vocab = hf_model.config.vocab_size
    eos = load_generation_eos_ids(tiny_model_dir)
    tokenizer = llguidance.LLTokenizer(
        (Path(tiny_model_dir) / "tokenizer.json").read_text(), n_vocab=vocab, eos_token=eos
    )

    @torch.inference_mode()
    def run(prompt: tuple[int, ...], params: StructuredOutputsParams) -> list[int]:
        matcher = llguidance.LLMatcher(tokenizer, llguidance_grammar(params))
        bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
        step = hf_model(torch.tensor([prompt]), use_cache=True)
        out: list[int] = []
        while len(out) < MAX_TOKENS:
            logits = step.logits[0, -1].float()
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[:vocab]
            logits[torch.from_numpy(bits == 0)] = float("-inf")
            token = int(logits.argmax())
            out.append(token)
            assert matcher.consume_token(token)
            if token in eos:
                break
            step = hf_model(torch.tensor([[token]]), past_key_values=step.past_key_values,
                            use_cache=True)
        return out

    cache: dict[tuple[tuple[int, ...], str], list[int]] = {}

    def cached(prompt: list[int], params: StructuredOutputsParams) -> list[int]:
        key = (tuple(prompt), params.key)
        if key not in cache:
            cache[key] = run(key[0], params)
        return cache[key]

    return cached


def greedy(constraint: StructuredOutputsParams | None, **kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(temperature=0.0, structured_outputs=constraint, **kwargs)


def token_ids(llm: LLM, prompts: list[list[int]], params) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


# Any token at all (llguidance's token-range syntax). `regex=r"[\s\S]*"` is not permissive
# on a byte-level vocabulary: it keeps the text valid UTF-8, and random weights soon pick a
# byte that cannot continue it.
PERMISSIVE = "start: <[*]>*"


def test_permissive_grammar_leaves_greedy_tokens_unchanged(llm, prompts):
    plain = token_ids(llm, prompts, greedy(None))
    permissive = token_ids(llm, prompts, greedy(StructuredOutputsParams(grammar=PERMISSIVE)))
    assert permissive == plain
    assert max(len(ids) for ids in plain) == MAX_TOKENS  # long enough to mean something


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_constrained_greedy_matches_reference(llm, prompts, reference, kind):
    constraint = CONSTRAINTS[kind]
    got = token_ids(llm, prompts, greedy(constraint))
    assert got == [reference(p, constraint) for p in prompts]


def test_outputs_match_their_constraint(llm, prompts):
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [greedy(CONSTRAINTS["json"]), greedy(CONSTRAINTS["regex"]), greedy(CONSTRAINTS["choice"])],
        use_tqdm=False,
    )
    person, code, choice = (o.outputs[0] for o in outputs)
    if person.finish_reason == "stop":
        assert set(json.loads(person.text)) == {"name", "age"}
    if code.finish_reason == "stop":
        assert re.fullmatch(r"[a-z]{2,5}-[0-9]{1,3}", code.text)
    assert choice.finish_reason == "stop" and choice.text in ("yes", "no", "maybe not")


def test_mixed_batch_leaves_unconstrained_rows_unchanged(llm, prompts, reference):
    plain = token_ids(llm, prompts, greedy(None))
    constraint = CONSTRAINTS["regex"]
    params = [greedy(None), greedy(constraint), greedy(None)]
    mixed = token_ids(llm, prompts, params)
    assert [mixed[0], mixed[2]] == [plain[0], plain[2]]
    assert mixed[1] == reference(prompts[1], constraint)


@pytest.mark.parametrize(
    ("mode", "extra"),
    [("recompute", {}), ("swap", {"num_swap_blocks": 200})],
)
def test_constrained_greedy_under_preemption_and_prefix_hits(tiny_model_dir, llm, mode, extra):
    # Eight requests of 40-token prompts cannot share 12 blocks: some are preempted (their KV
    # recomputed, or swapped out and back) after generating part of their output, and their
    # matchers must still follow it. The reference is the roomy engine, itself checked against
    # transformers above.
    prompts = random_prompts(tiny_model_dir, [40] * 8, seed=5)
    small = LLM(tiny_model_dir, dtype="float32", num_kv_blocks=12, max_num_batched_tokens=64,
                preemption_mode=mode, **extra)
    constraint = greedy(CONSTRAINTS["json_object"])
    got, _ = run_checked(small.engine, prompts, constraint)
    stats = small.get_stats()
    assert stats["num_preemptions"] > 0
    assert mode != "swap" or stats["swapped_out_blocks"] > 0
    assert got == token_ids(llm, prompts, constraint)
    assert token_ids(small, prompts[:2], constraint) == got[:2]  # now with prefix hits


def test_constrained_request_served_in_an_urgent_step(tiny_model_dir, llm):
    # Tenant A's long constrained prompts are mid-prefill (32-token budget) when B's arrives:
    # B gets an urgent step of its own; every output equals the roomy engine's.
    prompts = random_prompts(tiny_model_dir, [100, 120, 7], seed=8)
    constraint = greedy(CONSTRAINTS["regex"], max_tokens=8)
    expected = token_ids(llm, prompts, constraint)
    small = LLM(tiny_model_dir, dtype="float32", max_num_batched_tokens=32)
    engine, urgent = small.engine, small.engine.urgent
    requests = [
        engine.add_request(f"a{i}", prompts[i], constraint, share=TenantShare("A"))
        for i in range(2)
    ]
    engine.step()
    requests.append(engine.add_request("b0", prompts[2], constraint, share=TenantShare("B")))
    assert urgent.due() == ["b0"]
    assert [u.request.request_id for u in urgent.run(["b0"])] == ["b0"]
    while engine.has_unfinished_requests():
        engine.step()
    assert [r.output_token_ids for r in requests] == expected


def test_constrained_greedy_with_a_lora_adapter_matches_peft(
    tiny_model_dir, tiny_lora_dirs, prompts, reference
):
    spec = ADAPTERS[0]
    lora = LoRARequest(spec.name, 1, str(tiny_lora_dirs[spec.name]))
    base_reference = reference
    reference = reference_loop(tiny_model_dir, peft_model(tiny_model_dir, spec))
    llm = LLM(tiny_model_dir, dtype="float32", enable_lora=True, max_loras=1)
    constraint = CONSTRAINTS["json"]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(constraint),
                           lora_request=lora, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outputs]
    assert got == [reference(p, constraint) for p in prompts]
    assert got != [base_reference(p, constraint) for p in prompts]  # the adapter matters


def test_spec_decode_on_and_off_give_the_same_tokens(tiny_model_dir, llm, prompts):
    # Repetitive constrained outputs give the n-gram proposer drafts to verify; drafts the
    # grammar refuses are dropped or rejected, so greedy tokens are the same either way.
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    repeating = StructuredOutputsParams(regex=r"(ab|cd|ef )+!")
    batch = [*prompts, [5, 6, 7, 8] * 6]
    params = [greedy(repeating), greedy(CONSTRAINTS["json_object"]), greedy(CONSTRAINTS["regex"]),
              greedy(None, ignore_eos=True)]
    with_spec = LLM(tiny_model_dir, dtype="float32", speculative_config=spec)
    only_constrained = greedy(repeating)
    assert token_ids(with_spec, prompts, only_constrained) == token_ids(
        llm, prompts, only_constrained
    )
    assert with_spec.get_stats()["spec_decode_num_accepted_tokens"] > 0
    assert token_ids(with_spec, batch, params) == token_ids(llm, batch, params)
    sampled = SamplingParams(temperature=1.0, seed=1, max_tokens=MAX_TOKENS,
                             structured_outputs=repeating)
    outputs = with_spec.generate([{"prompt_token_ids": p} for p in prompts], sampled,
                                 use_tqdm=False)
    for output in outputs:
        sample = output.outputs[0]
        if sample.finish_reason == "stop":
            assert re.fullmatch(r"(ab|cd|ef )+!", sample.text)
        else:
            assert re.fullmatch(r"(ab|cd|ef )*(a|c|e|ef)?", sample.text)


def test_n_samples_each_follow_the_grammar(llm, prompts):
    params = SamplingParams(
        n=4, temperature=1.0, seed=3, max_tokens=MAX_TOKENS,
        structured_outputs=StructuredOutputsParams(choice=["red", "green", "blue"]),
    )
    outputs = llm.generate([{"prompt_token_ids": prompts[1]}], params, use_tqdm=False)
    samples = outputs[0].outputs
    assert len(samples) == 4
    assert all(s.text in ("red", "green", "blue") and s.finish_reason == "stop" for s in samples)


@pytest.mark.parametrize("kind", ["json", "regex", "grammar"])
def test_n_greedy_samples_each_equal_the_reference(llm, prompts, reference, kind):
    # Each sample has its own matcher, copied from one compile: a sample's tokens must not
    # advance its siblings' grammar state.
    params = greedy(CONSTRAINTS[kind], n=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = reference(prompt, CONSTRAINTS[kind])
        assert [list(s.token_ids) for s in output.outputs] == [expected] * 3


def test_logprobs_of_constrained_rows_cover_allowed_tokens_only(llm, prompts, tiny_model_dir):
    tokenizer = llm.get_tokenizer()
    eos = load_generation_eos_ids(tiny_model_dir)
    params = greedy(StructuredOutputsParams(regex=r"[0-9]+"), logprobs=5, max_tokens=4)
    out = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None
    for step in out.logprobs:
        finite = [t for t, lp in step.items() if lp.logprob > float("-inf")]
        digits = [t for t in finite if t not in eos]
        assert digits and all(tokenizer.decode([t]).isdigit() for t in digits)


def test_stop_strings_apply_to_constrained_output(llm, prompts):
    params = greedy(StructuredOutputsParams(regex=r"(ab)+c"), stop=["bab"], max_tokens=12)
    out = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "bab" and out.text == "a"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"regex": "(", "json_object": True}, "structured_outputs"),
        ({}, "structured_outputs"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"grammar": ""}, "structured_outputs.grammar"),
    ],
)
def test_bad_shapes_name_the_field(fields, param):
    with pytest.raises(InvalidFieldError) as info:
        SamplingParams(structured_outputs=StructuredOutputsParams(**fields))
    assert info.value.param == param


@pytest.mark.parametrize(
    ("constraint", "param"),
    [
        (StructuredOutputsParams(regex="(unclosed"), "structured_outputs.regex"),
        (StructuredOutputsParams(json={"type": "no-such-type"}), "structured_outputs.json"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "structured_outputs.grammar"),
        # Only the engine's compile (with its tokenizer) can tell this one is bad.
        (StructuredOutputsParams(grammar="start: <[99999]>"), "structured_outputs.grammar"),
    ],
)
def test_a_grammar_that_does_not_compile_fails_that_request_only(llm, prompts, constraint, param):
    batch = [{"prompt_token_ids": p} for p in prompts[:2]]
    with pytest.raises(InvalidFieldError) as info:
        llm.generate(batch, [greedy(None), greedy(constraint)], use_tqdm=False)
    assert info.value.param == param
    assert not llm.engine.has_unfinished_requests()
    assert token_ids(llm, prompts[:1], greedy(None, max_tokens=2))  # the engine still serves


def test_a_json_string_schema_is_the_same_constraint_as_the_dict():
    as_text = StructuredOutputsParams(json=json.dumps(PERSON), disable_any_whitespace=True)
    assert as_text.key == CONSTRAINTS["json"].key
    assert llguidance_grammar(as_text) == llguidance_grammar(CONSTRAINTS["json"])
