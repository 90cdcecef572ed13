"""Builds the engine's Speculator from its speculative_config (the proposer by method)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.spec_decode.spec_config import SpeculativeConfig
from engine.spec_decode.speculator import NgramRequestProposer, Proposer, Speculator

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


def build_speculator(config: SpeculativeConfig, engine: LLMEngine) -> Speculator:
    proposer: Proposer
    if config.method == "ngram":
        proposer = NgramRequestProposer(config)
    else:
        raise ValueError(f"speculative_config method {config.method!r} is not supported yet")
    return Speculator(config, proposer)
