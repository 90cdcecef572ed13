"""The fused MoE Triton kernels (kernels/triton/fused_moe.py) vs the PyTorch path of
engine.models.moe, the block alignment they rely on, and a Qwen3-MoE engine run through them.

Tiny shapes (the interpreter runs every program in Python): hidden and expert widths that are
not multiples of the 32-wide tiles, several experts per token, experts with no rows and with
more rows than one 16-row block. Float32 within 2e-5 absolute (values O(1), products summed
in another order); bfloat16 within 3e-2 of the float32 reference (a bfloat16 ulp at 1 is
2^-7; the weights themselves are rounded too).
"""

from __future__ import annotations

import pytest
import torch

from engine.models.config import ModelConfig
from engine.models.moe import SparseMoeBlock
from kernels.triton import runtime
from kernels.triton.fused_moe import align_block_size, fused_moe
from tests.fixtures.family_models import build_family_dir
from tests.fixtures.greedy import random_prompts, transformers_greedy
from tests.kernels_triton.test_engine_triton import NEW_TOKENS, run_checked, triton_llm


def make_block(hidden: int, inter: int, experts: int, top_k: int) -> SparseMoeBlock:
    config = ModelConfig.from_dict({
        "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": hidden,
        "intermediate_size": 2 * inter, "moe_intermediate_size": inter,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 16, "vocab_size": 32, "num_experts": experts,
        "num_experts_per_tok": top_k, "norm_topk_prob": True,
    })
    block = SparseMoeBlock(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in (block.gate, block.gate_up, block.down):
            param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    return block.eval()


def test_align_block_size_pads_each_expert_to_the_block():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 4]])  # expert 3 empty; 4 rows to expert 2
    rows, block_expert = align_block_size(ids, num_experts=5, block_m=2)
    n = ids.numel()
    used = [e for e in block_expert.tolist() if e < 5]
    assert used == [0, 1, 2, 2, 4]  # a block per 2 rows of each expert, in expert order
    assert block_expert.numel() * 2 == rows.numel()
    assert all(e == 5 for e in block_expert.tolist()[len(used):])
    flat = ids.reshape(-1).tolist()
    for block, expert in enumerate(used):
        members = [r for r in rows[2 * block : 2 * block + 2].tolist() if r < n]
        assert members and all(flat[r] == expert for r in members)
        assert members == sorted(members)  # token order within an expert
    assert sorted(r for r in rows.tolist() if r < n) == list(range(n))


@pytest.mark.parametrize(("tokens", "hidden", "inter", "experts", "top_k"), [
    (1, 40, 24, 4, 2),     # decode; widths below one tile
    (23, 48, 40, 4, 3),    # an expert past one 16-row block; column tails
    (9, 32, 32, 8, 2),     # experts left empty
])
def test_fused_moe_float32_matches_pytorch_path(device, tokens, hidden, inter, experts, top_k):
    block = make_block(hidden, inter, experts, top_k)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        weights, ids = block.route(x)
        expected = block.forward_reference(x, weights, ids)
        before = runtime.launch_counts["moe_down"]
        got = fused_moe(x.to(device), ids.to(device), weights.to(device),
                        block.gate_up.to(device), block.down.to(device))
    assert runtime.launch_counts["moe_down"] == before + 1
    torch.testing.assert_close(got.cpu(), expected, atol=2e-5, rtol=0)


def test_fused_moe_bfloat16_close_to_float32(device):
    block = make_block(48, 40, 4, 2)
    x = torch.randn(11, 48, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        weights, ids = block.route(x)
        expected = block.forward_reference(x, weights, ids)
        bf = torch.bfloat16
        got = fused_moe(x.to(device, bf), ids.to(device), weights.to(device),
                        block.gate_up.to(device, bf), block.down.to(device, bf))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.cpu().float(), expected, atol=3e-2, rtol=0)


def test_block_takes_the_triton_path_when_asked(device):
    """backend "triton" (what CUDA gets by default) runs the kernels from the block itself."""
    block = make_block(40, 24, 4, 2)
    x = torch.randn(5, 40, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        expected = block.forward_reference(x, *block.route(x))
        block.to(device).backend = "triton"
        before = runtime.launch_counts["moe_gate_up"]
        got = block(x.to(device))
    assert runtime.launch_counts["moe_gate_up"] == before + 1
    torch.testing.assert_close(got.cpu(), expected, atol=2e-5, rtol=0)


def test_fused_moe_refuses_mismatched_weights():
    block = make_block(40, 24, 4, 2)
    x = torch.randn(2, 40)
    with pytest.raises(ValueError, match="do not match hidden size 32"):
        fused_moe(x[:, :32], torch.zeros(2, 2, dtype=torch.int64), torch.ones(2, 2),
                  block.gate_up, block.down)


def test_engine_greedy_through_the_moe_kernels(tmp_path_factory):
    """Qwen3-MoE through engine.LLM with its MoE layer on these kernels (what CUDA runs by
    default; forced here, interpreted on CPU): transformers' greedy tokens, with chunked
    prefill and decode batches."""
    model_dir = build_family_dir(tmp_path_factory.mktemp("qwen3_moe_kernels"), "qwen3_moe",
                                 num_hidden_layers=2)
    prompts = random_prompts(model_dir, [1, 12, 29], seed=7)
    llm = triton_llm(model_dir, max_num_batched_tokens=16)
    blocks = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks
    for block in blocks:
        block.backend = "triton"
    before = runtime.launch_counts["moe_down"]
    assert run_checked(llm.engine, prompts) == transformers_greedy(model_dir, prompts,
                                                                   NEW_TOKENS)
    assert runtime.launch_counts["moe_down"] > before
