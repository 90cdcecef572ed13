"""The fused MoE kernels (kernels/cpu/fused_moe.cpp; fused_moe_panel.cpp, float32 on packed
weights) vs the PyTorch path of engine.models.moe on the same block, routing and weights; the
packed layout; and the start-up path choice.

Shapes: decode (one token), rows that fill and overflow the kernel's 4-row tiles and 32-row
blocks, experts that receive no rows, top-1/2/3, hidden sizes with a K tail (not a multiple of
the 16- or 32-element step) and expert widths not a multiple of the 3- and 6-column tiles.
Float32: within 2e-5 absolute (outputs are O(1); a few hundred products summed in another
order). bfloat16 (products summed in float32, rounded at the activation and the output,
where the PyTorch path rounds at every op): within 3e-2 absolute of the float32 reference
(values ~1, a bfloat16 ulp there is 2^-7).
"""

from __future__ import annotations

import pytest
import torch

from engine.models.config import ModelConfig
from engine.models.moe import MoePlan, SparseMoeBlock
from engine.models.moe_select import choose_plan, fused_available

pytestmark = pytest.mark.skipif(not fused_available(torch.float32), reason="no C++ CPU kernels")


def make_block(hidden: int, inter: int, experts: int, top_k: int, seed: int = 0,
               architecture: str = "MixtralForCausalLM") -> SparseMoeBlock:
    config = ModelConfig.from_dict({
        "architectures": [architecture], "hidden_size": hidden, "intermediate_size": inter,
        "moe_intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "vocab_size": 32, "num_local_experts": experts,
        "num_experts": experts, "num_experts_per_tok": top_k, "norm_topk_prob": True,
    })
    block = SparseMoeBlock(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in (block.gate, block.gate_up, block.down):
            param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    return block.eval()


def run_both(block: SparseMoeBlock, tokens: int, seed: int = 1,
             dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(tokens, block.gate.shape[1], generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        weights, ids = block.route(x)
        expected = block.forward_reference(x, weights, ids)
        block.to(dtype)
        got = block.forward_fused(x.to(dtype), weights, ids)
        block.float()
    return got, expected


@pytest.mark.parametrize("tokens", [1, 3, 4, 9, 70])
@pytest.mark.parametrize(("hidden", "inter", "experts", "top_k"), [
    (64, 96, 8, 2),    # tiles exact
    (40, 50, 6, 3),    # K tails (40 = 2 x 16 + 8), 50 columns: partial 3- and 6-tiles
    (96, 32, 16, 1),   # top-1, most experts empty at few tokens
])
def test_fused_float32_matches_pytorch_path(tokens, hidden, inter, experts, top_k):
    got, expected = run_both(make_block(hidden, inter, experts, top_k), tokens)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize("tokens", [1, 9, 70])
@pytest.mark.parametrize(("hidden", "inter"), [(64, 96), (72, 50)])
def test_fused_bfloat16_close_to_float32(tokens, hidden, inter):
    got, expected = run_both(make_block(hidden, inter, 8, 2), tokens, dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=0)


def test_fused_routes_every_token_independently():
    """A token's output does not depend on the batch it is in (no cross-token mixing)."""
    block = make_block(64, 96, 8, 2)
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        weights, ids = block.route(x)
        batch = block.forward_fused(x, weights, ids)
        alone = block.forward_fused(x[7:8], weights[7:8], ids[7:8])
    torch.testing.assert_close(batch[7:8], alone, atol=1e-6, rtol=0)


def test_fused_refuses_bad_inputs():
    block = make_block(64, 96, 8, 2)
    x = torch.randn(3, 64)
    weights = torch.full((3, 2), 0.5)
    bad_ids = torch.tensor([[0, 1], [2, 8], [3, 4]])
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="topk_ids holds expert 8"):
            block.forward_fused(x, weights, bad_ids)
        with pytest.raises(RuntimeError, match="topk_ids must be int64"):
            torch.ops.kvfleet_cpu.fused_moe(torch.empty_like(x), x, bad_ids.int(), weights,
                                            block.gate_up, block.down)
        with pytest.raises(RuntimeError, match="shapes disagree"):
            torch.ops.kvfleet_cpu.fused_moe(torch.empty(3, 32), x[:, :32], bad_ids.clamp(max=7),
                                            weights, block.gate_up, block.down)


def test_plan_picks_per_batch_size():
    plan = MoePlan(rows=(1, 8, 64), fused=(True, True, False))
    assert [plan.use_fused(n) for n in (1, 2, 8, 9, 64, 4096)] == [
        True, True, True, False, False, False]
    assert not MoePlan().use_fused(1)
    assert MoePlan.always().use_fused(10_000)


def test_choose_plan_measures_up_to_the_largest_batch():
    plan = choose_plan(make_block(64, 96, 8, 2), max_rows=64)
    assert plan.rows == (1, 8, 64) and len(plan.fused) == 3
    # float16 has no fused kernel: the PyTorch path always.
    assert choose_plan(make_block(64, 96, 8, 2).half(), max_rows=64) == MoePlan()


@pytest.mark.parametrize("tokens", [1, 4, 13, 70, 300])
@pytest.mark.parametrize(("hidden", "inter", "experts", "top_k"), [
    (64, 96, 8, 2),    # 6 gate/up panels, 2 down panels
    (40, 48, 6, 3),    # hidden 40: the last down panel zero-padded past H
    (96, 32, 16, 1),   # top-1, most experts empty at few tokens
])
def test_panel_float32_matches_pytorch_path(tokens, hidden, inter, experts, top_k):
    """The float32 kernel on panel-packed weights (fused_moe_panel.cpp); 300 tokens make
    row blocks past one 12-row tile per expert."""
    block = make_block(hidden, inter, experts, top_k)
    assert block.pack_panels()
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens))
    with torch.inference_mode():
        weights, ids = block.route(x)
        expected = block.forward_reference(x, weights, ids)
        got = block.forward_fused(x, weights, ids)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)


def test_expert_panels_layout():
    block = make_block(40, 48, 3, 2)
    assert block.pack_panels() and block.panels is not None
    gu, dn = block.panels
    w, d = block.gate_up.detach(), block.down.detach()
    assert gu.shape == (3, 3, 40, 32) and dn.shape == (3, 2, 48, 32)
    # Panel p: gate columns 16p..16p+15, then up columns 16p..16p+15, one row per k.
    torch.testing.assert_close(gu[1, 2, :, :16], w[1, 32:48].T, atol=0, rtol=0)
    torch.testing.assert_close(gu[1, 2, :, 16:], w[1, 48 + 32:48 + 48].T, atol=0, rtol=0)
    torch.testing.assert_close(dn[2, 1, :, :8], d[2, 32:40].T, atol=0, rtol=0)
    assert not dn[:, 1, :, 8:].any()  # past hidden 40: zeros


def test_panels_only_where_they_apply():
    assert not make_block(64, 96, 8, 2).to(torch.bfloat16).pack_panels()
    assert not make_block(64, 50, 8, 2).pack_panels()  # 50 columns: not whole 16-column panels
    block = make_block(64, 96, 8, 2)
    assert block.pack_panels()
    x = torch.randn(5, 64)
    with torch.inference_mode():
        weights, ids = block.route(x)
        with pytest.raises(RuntimeError, match="topk_ids holds expert 8"):
            block.forward_fused(x, weights, ids.clamp(max=6) + 2)
        with pytest.raises(RuntimeError, match="must be packed"):
            torch.ops.kvfleet_cpu.fused_moe_panel(torch.empty_like(x), x, ids, weights,
                                                  block.gate_up, block.down)


@pytest.mark.parametrize(("experts", "top_k", "renorm"), [(8, 2, True), (6, 3, False),
                                                          (16, 1, True)])
def test_route_op_matches_pytorch_route(experts, top_k, renorm):
    """kvfleet_cpu::moe_route: the experts of PyTorch's softmax + top-k (same order), their
    weights to float32 rounding (only exp's last bit may differ)."""
    block = make_block(64, 32, experts, top_k)
    block.norm_topk_prob = renorm
    x = torch.randn(300, 64, generator=torch.Generator().manual_seed(experts))
    with torch.inference_mode():
        expected_w, expected_ids = block.route(x)
        block.fused_route = True
        got_w, got_ids = block.route(x)
    assert torch.equal(got_ids, expected_ids)
    torch.testing.assert_close(got_w, expected_w, atol=1e-6, rtol=1e-6)
    if renorm:
        torch.testing.assert_close(got_w.sum(dim=-1), torch.ones(300), atol=1e-6, rtol=0)
    with torch.inference_mode():  # bfloat16 logits (ties) stay on the PyTorch path
        block.to(torch.bfloat16)
        block.fused_route = False
        expected_bf16 = block.route(x.bfloat16())
        block.fused_route = True
        got_bf16 = block.route(x.bfloat16())
    assert all(torch.equal(a, b) for a, b in zip(got_bf16, expected_bf16, strict=True))


def test_route_op_refuses_bad_inputs():
    logits = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="top_k must be in"):
        torch.ops.kvfleet_cpu.moe_route(logits, 9, True)
    with pytest.raises(RuntimeError, match="logits must be float32"):
        torch.ops.kvfleet_cpu.moe_route(logits.bfloat16(), 2, True)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.kvfleet_cpu.moe_route(logits.t(), 2, True)


def test_configure_moe_turns_the_route_op_on():
    from torch import nn

    from engine.models.moe_select import configure_moe

    blocks = nn.ModuleList([make_block(64, 96, 8, 2)])
    configure_moe(blocks, enabled=False, max_rows=8)
    assert not blocks[0].fused_route
    configure_moe(blocks, enabled=True, max_rows=8)
    assert blocks[0].fused_route
