"""Builds the engine's Speculator from its speculative_config (the proposer by method).

It receives the few facts a proposer needs (the target's model config, the KV cache's
size, dtype and linear backend), never the engine: speculation sits below the engine loop,
which owns and wires it (engine.core.llm_engine).
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.models.config import ModelConfig
from engine.spec_decode.draft_proposer import DraftModelProposer
from engine.spec_decode.spec_config import SpeculativeConfig
from engine.spec_decode.speculator import NgramRequestProposer, Proposer, Speculator


def build_speculator(
    config: SpeculativeConfig,
    *,
    target_config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    linear_backend: str,
) -> Speculator:
    """`num_blocks`, `block_size`: the target's KV cache (a draft model sizes its own cache
    like it); `linear_backend`: the runner's resolved one, so the draft runs the same GEMMs."""
    proposer: Proposer
    if config.method == "ngram":
        proposer = NgramRequestProposer(config)
    else:
        assert config.model is not None  # SpeculativeConfig checks it
        proposer = DraftModelProposer(
            Path(config.model),
            target_config,
            config.num_speculative_tokens,
            num_blocks,
            block_size,
            dtype,
            linear_backend,
        )
    return Speculator(config, proposer)
