"""A prefill engine hands a request's KV to a decode engine: greedy text equals transformers.

Offline (two `LLMEngine`s in this process, the KV moved as wire bytes): the prefill engine
runs prefill-only requests (chunked, with prefix hits on its side), exports their blocks; the
decode engine imports them (with prefix hits on its side for the second round) and decodes
on without recomputing. Block accounting is checked after every step on both engines, and
every block ends free.
"""

from __future__ import annotations

from engine import LLM
from engine.core.llm_engine import LLMEngine
from engine.core.request import RequestStatus
from engine.disagg.kv_payload import BlockFormat, KVExport, block_bytes, blocks_from_bytes
from kvfleet.contracts.sampling_params import SamplingParams
from tests.engine.test_exactness import GREEDY, NEW_TOKENS, prompts, reference  # noqa: F401


def _drain(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for update in engine.step():
            tokens.setdefault(update.request.request_id, []).extend(update.new_token_ids)
        engine.kv.check_integrity()
    return tokens


def _handoff(prefill: LLMEngine, decode: LLMEngine, batch: list[list[int]], tag: str,
             params: SamplingParams) -> list[list[int]]:
    requests = [prefill.add_request(f"{tag}-{i}", p, params, prefill_only=True)
                for i, p in enumerate(batch)]
    first = _drain(prefill)
    fmt = BlockFormat.of(prefill.runner.kv_caches)
    for i, (request, prompt) in enumerate(zip(requests, batch, strict=True)):
        assert request.status is RequestStatus.FINISHED_HANDOFF
        exported = request.exported_kv
        assert isinstance(exported, KVExport)
        assert exported.num_tokens == len(prompt)
        chunks = [block_bytes(exported.blocks, b) for b in range(exported.num_blocks)]
        transfer = f"t-{tag}-{i}"
        num_full = len(prompt) // prefill.config.block_size
        assert list(exported.block_hashes) == request.block_hashes[:num_full]
        ids = decode.handoff.begin_import(transfer, len(chunks), len(prompt),
                                     list(exported.block_hashes))
        assert len(ids) == len(chunks)
        decode.handoff.write_import(
            transfer, list(range(len(chunks))), blocks_from_bytes(chunks, fmt)
        )
        decode.handoff.imports.complete(transfer)
        decode.add_imported_request(request.request_id, prompt, first[request.request_id][0],
                                    params, transfer_id=transfer)
    rest = _drain(decode)
    return [first[r.request_id] + rest[r.request_id] for r in requests]


def test_handoff_matches_transformers(tiny_model_dir, prompts, reference):  # noqa: F811
    """Chunked prefill on the prefill side (whole prompts: tests/disagg/test_disagg_fleet.py)."""
    prefill = LLM(tiny_model_dir, dtype="float32", num_kv_blocks=128,
                  max_num_batched_tokens=32).engine
    decode = LLM(tiny_model_dir, dtype="float32", num_kv_blocks=128).engine
    assert _handoff(prefill, decode, prompts, "a", GREEDY) == reference
    # Second round: prefix hits on both sides (prefill cache, decode's imported blocks).
    assert _handoff(prefill, decode, prompts, "b", GREEDY) == reference
    assert prefill.kv.stats.hits > 0
    for engine in (prefill, decode):
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
        assert len(engine.handoff.imports) == 0


def test_first_token_that_ends_the_request_is_no_handoff(tiny_model_dir, prompts):  # noqa: F811
    prefill = LLM(tiny_model_dir, dtype="float32", num_kv_blocks=64).engine
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    request = prefill.add_request("one", prompts[5], one, prefill_only=True)
    _drain(prefill)
    assert request.status is RequestStatus.FINISHED_LENGTH
    assert request.exported_kv is None


def test_decode_recomputes_without_transfer(tiny_model_dir, prompts, reference):  # noqa: F811
    """The fallback of a failed transfer: no KV, the decode engine recomputes prompt + first."""
    decode = LLM(tiny_model_dir, dtype="float32", num_kv_blocks=128).engine
    for i, prompt in enumerate(prompts):
        decode.add_imported_request(f"r{i}", prompt, reference[i][0], GREEDY)
    rest = _drain(decode)
    assert [[reference[i][0], *rest[f"r{i}"]] for i in range(len(prompts))] == reference
    assert len(reference[0]) == NEW_TOKENS
