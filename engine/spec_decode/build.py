"""Builds the engine's Speculator from its speculative_config (the proposer by method)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from engine.spec_decode.draft_proposer import DraftModelProposer
from engine.spec_decode.spec_config import SpeculativeConfig
from engine.spec_decode.speculator import NgramRequestProposer, Proposer, Speculator

if TYPE_CHECKING:
    from engine.core.llm_engine import LLMEngine


def build_speculator(config: SpeculativeConfig, engine: LLMEngine) -> Speculator:
    proposer: Proposer
    if config.method == "ngram":
        proposer = NgramRequestProposer(config)
    else:
        assert config.model is not None  # SpeculativeConfig checks it
        proposer = DraftModelProposer(
            Path(config.model),
            engine.model_config,
            config.num_speculative_tokens,
            engine.kv_layout.num_blocks,
            engine.config.block_size,
            engine.dtype,
            engine.runner.linear_backend,
        )
    return Speculator(config, proposer)
