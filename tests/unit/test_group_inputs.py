"""engine.worker.group_inputs: each KV group's metadata derived from the step's equals the step
built from scratch through that group's block tables (prefill chunks, decodes, drafts; one
group and several, decode-only steps)."""

from dataclasses import replace

import torch

from engine.attention.unified_batch import build_unified_batch
from engine.core.request import Request
from engine.core.scheduler_output import ScheduledRequest
from engine.worker.group_inputs import for_groups
from engine.worker.input_batch import build_model_input
from kvfleet.contracts.sampling_params import SamplingParams

BS = 4


def scheduled_step():
    def request(rid, num_prompt, num_computed):
        r = Request(request_id=rid, prompt_token_ids=list(range(num_prompt)),
                    sampling_params=SamplingParams(max_tokens=8), max_tokens=8, block_size=BS,
                    arrival_seq=0)
        r.num_computed_tokens = num_computed
        return r

    return [
        ScheduledRequest(request("chunk", 30, 8), 9),  # prefill chunk: positions 8..16
        ScheduledRequest(request("decode", 11, 10), 1),
        ScheduledRequest(request("verify", 14, 13), 3, (5, 6)),  # last token + 2 drafts
        ScheduledRequest(request("decode2", 6, 5), 1),
    ]


FULL = {"chunk": [1, 2, 3, 4, 5], "decode": [6, 7, 8], "verify": [9, 10, 11, 12],
        "decode2": [13, 14]}
SLIDING = {"chunk": [0, 20, 21, 22, 23], "decode": [0, 24, 25], "verify": [0, 0, 26, 27],
           "decode2": [28, 29]}
SLIDING_2 = {"chunk": [0, 30, 31, 32, 33], "decode": [0, 34, 35], "verify": [0, 0, 36, 37],
             "decode2": [38, 39]}


def assert_same_step(got, want, unified=None):
    assert torch.equal(got.slot_mapping, want.slot_mapping)
    assert (got.decode is None) == (want.decode is None)
    if want.decode is not None:
        assert torch.equal(got.decode.block_tables, want.decode.block_tables)
        assert got.decode.block_tables.is_contiguous()
        assert torch.equal(got.decode.context_slots, want.decode.context_slots)
        assert got.decode.shared is None
    assert (got.prefill_batch is None) == (want.prefill_batch is None)
    if want.prefill_batch is not None:
        assert torch.equal(got.prefill_batch.block_tables, want.prefill_batch.block_tables)
        assert got.prefill_batch.block_tables.is_contiguous()
    assert len(got.prefills) == len(want.prefills)
    for a, b in zip(got.prefills, want.prefills, strict=True):
        assert torch.equal(a.context_slots, b.context_slots)
    if unified is not None:
        assert got.unified is not None
        assert torch.equal(got.unified.block_tables, unified.block_tables)
    assert got.groups == ()


def test_group_metadata_equals_the_step_built_from_its_tables():
    scheduled = scheduled_step()
    step = build_model_input(scheduled, FULL, BS, use_decode_kernel=True)
    meta = replace(step.meta, unified=build_unified_batch(scheduled, FULL, BS))
    (got,) = for_groups(meta, scheduled, {rid: [t] for rid, t in SLIDING.items()},
                        step.positions, BS)
    want = build_model_input(scheduled, SLIDING, BS, use_decode_kernel=True).meta
    assert len(want.prefills) == 2
    assert_same_step(got, want, build_unified_batch(scheduled, SLIDING, BS))


def test_every_group_gets_its_own_tables():
    scheduled = scheduled_step()
    step = build_model_input(scheduled, FULL, BS, use_decode_kernel=True)
    tables = {rid: [SLIDING[rid], SLIDING_2[rid]] for rid in FULL}
    got = for_groups(step.meta, scheduled, tables, step.positions, BS)
    assert len(got) == 2
    for metas, group in zip(got, (SLIDING, SLIDING_2), strict=True):
        assert_same_step(metas, build_model_input(scheduled, group, BS,
                                                  use_decode_kernel=True).meta)


def test_decode_only_step():
    scheduled = [item for item in scheduled_step() if item.num_new_tokens == 1]
    full = {item.request.request_id: FULL[item.request.request_id] for item in scheduled}
    step = build_model_input(scheduled, full, BS, use_decode_kernel=True)
    tables = {rid: [SLIDING[rid], SLIDING_2[rid]] for rid in full}
    got = for_groups(step.meta, scheduled, tables, step.positions, BS)
    for metas, group in zip(got, (SLIDING, SLIDING_2), strict=True):
        assert metas.prefill_batch is None and metas.prefills == ()
        assert_same_step(metas, build_model_input(
            scheduled, {rid: group[rid] for rid in full}, BS, use_decode_kernel=True).meta)
