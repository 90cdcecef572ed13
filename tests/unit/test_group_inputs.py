"""engine.worker.group_inputs: a KV group's metadata derived from the step's equals the step
built from scratch through that group's block tables (prefill chunks, decodes, drafts)."""

from dataclasses import replace

import torch

from engine.attention.unified_batch import build_unified_batch
from engine.core.request import Request
from engine.core.scheduler_output import ScheduledRequest
from engine.worker.group_inputs import for_group_tables
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


def test_group_metadata_equals_the_step_built_from_its_tables():
    scheduled = scheduled_step()
    step = build_model_input(scheduled, FULL, BS, use_decode_kernel=True)
    meta = replace(step.meta, unified=build_unified_batch(scheduled, FULL, BS))
    got = for_group_tables(meta, scheduled, SLIDING, step.positions, BS)
    want = build_model_input(scheduled, SLIDING, BS, use_decode_kernel=True).meta
    unified = build_unified_batch(scheduled, SLIDING, BS)
    assert torch.equal(got.slot_mapping, want.slot_mapping)
    assert got.decode is not None and want.decode is not None
    assert torch.equal(got.decode.block_tables, want.decode.block_tables)
    assert torch.equal(got.decode.context_slots, want.decode.context_slots)
    assert got.decode.shared is None
    assert got.prefill_batch is not None and want.prefill_batch is not None
    assert torch.equal(got.prefill_batch.block_tables, want.prefill_batch.block_tables)
    assert len(got.prefills) == len(want.prefills) == 2
    for a, b in zip(got.prefills, want.prefills, strict=True):
        assert torch.equal(a.context_slots, b.context_slots)
    assert got.unified is not None
    assert torch.equal(got.unified.block_tables, unified.block_tables)
    assert got.groups == ()
