"""Sliding-window KV groups (engine.core.kv_groups, engine.core.sliding_blocks) in the KV
manager: exact block ids and counts, the window bound at 8k context, prefix hits after the
sliding layers dropped part of a prefix, and rollback/free.
"""

import pytest

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_groups import plan_kv_groups
from engine.core.request import Request
from engine.core.sliding_blocks import group_key
from kvfleet.contracts.sampling_params import SamplingParams

BS = 4
WINDOW = 6  # a query at p sees keys p - 5 .. p


def make_request(rid, tokens, max_tokens=64):
    return Request(
        request_id=rid,
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=max_tokens),
        max_tokens=max_tokens,
        block_size=BS,
        arrival_seq=0,
    )


def make_manager(num_blocks=40, windows=(WINDOW, None), block_size=BS, step=2048):
    return KVCacheManager(num_blocks, block_size, groups=plan_kv_groups(list(windows)),
                          max_step_tokens=step)


def run_step(manager, request, num_new):
    """Allocate, 'compute' and cache like the scheduler around one step."""
    assert manager.allocate_slots(request, num_new) is not None
    request.num_computed_tokens += num_new
    manager.cache_computed_blocks(request)
    manager.check_integrity()


def decode(manager, request, token=7):
    request.append_output_token(token)
    run_step(manager, request, 1)


def test_plan_gemma2_alternating_layers():
    plan = plan_kv_groups([4096, None, 4096, None])
    assert plan is not None
    assert (plan.layer_group, plan.layer_slot, plan.group_size) == ((1, 0, 1, 0), (0, 0, 1, 1), 2)


def test_plan_gemma3_five_local_per_global_layer():
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]  # Gemma 3 1B
    plan = plan_kv_groups(windows)
    assert plan is not None
    assert plan.group_size == 4 and plan.num_groups == 7  # 4 global layers, 22 local in 6 groups
    assert [plan.layer_group[i] for i in (5, 11, 17, 23)] == [0, 0, 0, 0]
    assert plan.layer_group[:5] == (1, 1, 1, 1, 2) and plan.layer_group[24:] == (6, 6)
    # No two layers of one group share a KV tensor.
    pairs = list(zip(plan.layer_group, plan.layer_slot, strict=True))
    assert len(set(pairs)) == 26


@pytest.mark.parametrize("windows", [
    [None, None], [16, 16], [16, None, 32, None], [16, None, None],
])
def test_no_plan_without_one_window_and_enough_sliding_layers(windows):
    assert plan_kv_groups(windows) is None


def test_exact_block_ids_as_the_window_moves():
    manager = make_manager(num_blocks=12)
    request = make_request("a", range(10))
    run_step(manager, request, 10)
    # Sliding group first, then the full group, from the front of the free queue.
    assert manager.get_group_block_ids("a") == [[0, 1, 2]]
    assert manager.get_block_ids("a") == [3, 4, 5]
    decode(manager, request)  # query at 10 sees 5..10: block 0 (0..3) is out
    assert manager.get_group_block_ids("a") == [[0, 1, 2]]  # 0 is the placeholder now
    assert manager.sliding.num_held("a") == [2]
    assert manager.num_free_blocks == 12 - 5
    decode(manager, request)  # query at 11: new block for 12.. not yet; still 2 held
    decode(manager, request)  # query at 12 needs block 3: allocated, block 1 (4..7) still seen
    assert manager.sliding.num_held("a") == [3]
    assert manager.get_block_ids("a") == [3, 4, 5, 7]
    decode(manager, request)  # query at 13 sees 8..13: block 1 is out
    assert manager.get_group_block_ids("a") == [[0, 0, 2, 6]]
    manager.free(request)
    manager.check_integrity()
    assert manager.num_free_blocks == 12


@pytest.mark.parametrize(("window", "windows"), [
    (4096, [4096, None] * 13),  # Gemma 2: one sliding group of 13 layers
    (512, [None if (i + 1) % 6 == 0 else 512 for i in range(26)]),  # Gemma 3 1B: 6 groups
])
def test_8k_context_sliding_blocks_bounded_by_window(window, windows):
    block_size, chunk = 16, 2048
    plan = plan_kv_groups(windows)
    manager = make_manager(num_blocks=4096, windows=windows, block_size=block_size, step=chunk)
    request = Request(
        request_id="long", prompt_token_ids=[i % 1000 for i in range(8192)],
        sampling_params=SamplingParams(max_tokens=64), max_tokens=64, block_size=block_size,
        arrival_seq=0,
    )
    chunk_bound = -(-(window - 1 + chunk) // block_size) + 1
    while request.num_computed_tokens < 8192:
        run_step(manager, request, chunk)
        assert max(manager.sliding.num_held("long")) <= chunk_bound
    decode_bound = -(-window // block_size) + 1
    seen = set()
    for _ in range(40):
        decode(manager, request)
        held = manager.sliding.num_held("long")
        assert len(held) == plan.num_sliding_groups and len(set(held)) == 1
        seen.add(held[0])
    # ceil(window / 16) + 1 while the window starts inside a block, one less when it starts
    # on a block boundary.
    assert seen == {decode_bound, decode_bound - 1}
    full = len(manager.get_block_ids("long"))
    assert full == -(-(8192 + 40) // block_size)
    # Memory: block ids x layers per block, against every layer keeping every block.
    used = manager.num_blocks - manager.num_free_blocks
    assert used == full + sum(manager.sliding.num_held("long"))
    # 8,232 tokens: Gemma 2 (515 + 257 blocks of 13 layers) holds 0.75x the layer-blocks of
    # every layer keeping every block; Gemma 3 1B (515 + 6 x 33 of 4 layers) 0.21x.
    assert used * plan.group_size / (full * len(windows)) < (0.75 if window == 4096 else 0.22)


def test_prefix_hit_needs_only_the_window_before_it():
    manager = make_manager(num_blocks=60)
    a = make_request("a", range(40))
    for _ in range(5):
        run_step(manager, a, 8)  # chunked: sliding blocks 0..5 leave the window on the way
    assert manager.get_group_block_ids("a")[0][:6] == [0] * 6  # the last chunk saw 27..39
    assert manager.sliding.num_held("a") == [4]
    manager.free(a)
    # Evict the sliding blocks 0..3 (freed first, so first in LRU order): not needed.
    num_unhashed = sum(1 for blk in manager.pool.blocks if blk.block_hash is None)
    manager.pool.allocate(num_unhashed + 4)
    assert [manager.pool.get_cached_block(group_key(h, 1)) is None
            for h in a.block_hashes[:7]] == [True] * 4 + [False] * 3
    b = make_request("b", list(range(28)) + [99] * 12)
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert num_hit_tokens == 28  # 7 shared blocks; the next query (28) sees 23.. = blocks 5, 6
    assert manager.allocate_slots(b, 40 - 28, hits) is not None
    sliding_a = [manager.pool.get_cached_block(group_key(a.block_hashes[j], 1)) for j in (5, 6)]
    assert manager.get_group_block_ids("b")[0][:7] == [0] * 5 + [blk.block_id for blk in sliding_a]
    manager.pool.check_integrity()  # (the evicting allocation above has no owning request)


def test_prefix_hit_cut_where_the_window_before_it_was_evicted():
    manager = make_manager(num_blocks=30)
    a = make_request("a", range(28))
    run_step(manager, a, 28)
    for _ in range(12):  # decode to 40: sliding blocks 0..7 leave the window, freed cached
        decode(manager, a)
    manager.free(a)
    # Another request's allocation evicts the free queue's front: the unhashed blocks, then
    # the sliding blocks freed first (LRU), before any of a's full-attention blocks.
    num_unhashed = sum(1 for blk in manager.pool.blocks if blk.block_hash is None)
    manager.pool.allocate(num_unhashed + 8)
    assert all(manager.pool.get_cached_block(h) is not None for h in a.block_hashes[:7])
    b = make_request("b", list(range(28)) + [99] * 12)
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    # Full attention still caches 7 blocks, but no k <= 7 has its window cached: no hit.
    assert (hits, num_hit_tokens) == ([], 0)


def test_spec_rollback_frees_sliding_blocks_past_the_kept_tokens():
    manager = make_manager(num_blocks=20)
    request = make_request("a", range(10))
    run_step(manager, request, 10)
    request.append_output_token(5)
    assert manager.allocate_slots(request, 1 + 6) is not None  # 6 drafts: up to position 16
    assert len(manager.get_group_block_ids("a")[0]) == 5
    manager.free_blocks_beyond(request, 12)
    assert len(manager.get_group_block_ids("a")[0]) == 3
    assert len(manager.get_block_ids("a")) == 3
    manager.check_integrity()


def test_allocation_is_all_groups_or_none():
    manager = make_manager(num_blocks=5)
    request = make_request("a", range(12))
    assert manager.allocate_slots(request, 12) is None  # 3 full + 3 sliding > 5
    assert manager.num_free_blocks == 5 and manager.get_group_block_ids("a") == []
    manager.check_integrity()


def test_sliding_blocks_are_cached_but_never_published():
    manager = make_manager()
    request = make_request("a", range(8))
    run_step(manager, request, 8)
    stored, removed = manager.pool.take_events()
    assert stored == request.block_hashes[:2] and removed == []
    assert manager.pool.get_cached_block(group_key(request.block_hashes[0], 1)) is not None


def test_can_fit_counts_the_sliding_blocks_of_a_step():
    manager = make_manager(num_blocks=10, step=8)
    # 32 tokens: 8 full blocks; sliding at most ceil((6 - 1 + 8) / 4) + 1 = 5.
    assert not manager.can_fit(32)
    assert manager.can_fit(20)  # 5 + 5


def test_kv_imports_refused_with_sliding_groups():
    manager = make_manager()
    with pytest.raises(ValueError, match="disable_hybrid_kv_cache_manager"):
        manager.reserve("import-1", 2)


@pytest.mark.parametrize(("argv", "disabled"), [
    ([], False), (["--disable-hybrid-kv-cache-manager"], True),
    # A KV handoff moves one block table per request: disaggregated roles keep every block.
    (["--role", "prefill"], True), (["--role", "decode"], True),
])
def test_engine_service_flag_and_roles(argv, disabled):
    from engine.service.server import build_parser, options_from_args

    args = build_parser().parse_args(
        ["--model", "m", "--engine-id", "e", "--redis-url", "redis://127.0.0.1:1/0", *argv])
    assert options_from_args(args).engine.disable_hybrid_kv_cache_manager is disabled


def test_drafts_count_a_block_per_table():
    from engine.spec_decode.spec_scheduling import drafts_to_verify

    manager = make_manager(num_blocks=8)
    request = make_request("a", range(10))
    run_step(manager, request, 10)  # 3 full + 3 sliding blocks: 2 free
    request.append_output_token(5)
    request.spec_token_ids = [1, 2, 3, 4, 5, 6]
    # Each further 4 positions take a block in both tables: 2 free blocks are 4 positions,
    # up to position 15 (the last known token at 10, then 5 drafts).
    drafts = drafts_to_verify(request, 64, 1, None, manager, 0)
    assert drafts == (1, 2, 3, 4, 5)
    # One request behind it reserves a block per table: both free blocks; only the room left
    # in the held blocks (positions 10, 11) remains.
    assert drafts_to_verify(request, 64, 1, None, manager, 1) == (1,)
    assert manager.allocate_slots(request, 1 + len(drafts)) is not None
    manager.check_integrity()


@pytest.mark.parametrize(("engine_args", "max_model_len", "on"), [
    ({}, 512, True),
    ({}, 16, False),  # every context fits the window: nothing would ever be freed
    ({"disable_hybrid_kv_cache_manager": True}, 512, False),
    ({"preemption_mode": "swap"}, 512, False),
    ({"kv_offloading_size": 1.0}, 512, False),
])
def test_when_the_engine_plans_sliding_kv(engine_args, max_model_len, on):
    import json

    import transformers

    from engine.config import EngineConfig
    from engine.core.kv_sizing import plan_sliding_kv
    from engine.models.config import ModelConfig

    hf = transformers.AutoConfig.for_model(
        "gemma2", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
        max_position_embeddings=512)
    raw = {**json.loads(hf.to_json_string()), "architectures": ["Gemma2ForCausalLM"]}
    config = EngineConfig(model="m", **engine_args)
    plan = plan_sliding_kv(config, ModelConfig.from_dict(raw), max_model_len, False)
    assert (plan is not None) is on
    assert plan_sliding_kv(EngineConfig(model="m"), ModelConfig.from_dict(raw), 512, True) is None
