"""Hugging Face checkpoint tensor names -> our parameters (and which part of them).

Our layers fuse what checkpoints keep apart: q/k/v are one `qkv_proj`, gate/up one
`gate_up_proj`, and an MoE layer's experts are batched `gate_up` [E, 2I, H] / `down` [E, H, I]
tensors. A checkpoint tensor therefore fills a `Target`: a parameter, optionally one expert's
slice of it and a run of rows, and the named pieces it completes. Checkpoints that already
fuse (Phi-3's qkv_proj / gate_up_proj) fill every piece at once.

Invariant: `expected_pieces(name)` lists the pieces a parameter needs, so a loader can prove
every parameter was filled completely (a missing k_proj or expert fails loudly).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine.models.config import ModelConfig

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_QKV = {"q_proj": "q", "k_proj": "k", "v_proj": "v"}
_GATE_UP = {"gate_proj": "gate", "up_proj": "up", "w1": "gate", "w3": "up"}
_EXPERT = re.compile(
    r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$"
)


@dataclass(frozen=True)
class Target:
    param: str
    expert: int | None = None
    rows: tuple[int, int] | None = None  # (start, length) along dim 0 of the (expert) slice
    pieces: tuple[str, ...] = ("",)


class WeightNames:
    def __init__(self, config: ModelConfig, tied: bool) -> None:
        self.config = config
        self.tied = tied
        # Multimodal (engine.models.family_config.TEXT_OF_MULTIMODAL): the language model's
        # tensors under its prefix (transformers 4 and 5 spellings); the rest is not ours.
        self.text_prefixes = (
            ("language_model.", "model.language_model.") if config.multimodal else ())

    def target(self, hf_name: str) -> Target | None:
        """Where `hf_name` goes, or None for a tensor we do not load (recomputed, tied, or
        a multimodal checkpoint's vision tower and projector)."""
        if self.text_prefixes:
            prefix = next((p for p in self.text_prefixes if hf_name.startswith(p)), None)
            if prefix is None and hf_name != "lm_head.weight":
                return None
            hf_name = hf_name.removeprefix(prefix or "")
        name = hf_name.removeprefix("model.")
        if name.endswith("rotary_emb.inv_freq"):
            return None  # recomputed, never loaded
        if name == "lm_head.weight" and self.tied:
            return None  # tied: some checkpoints still carry a copy of the embedding
        match = _LAYER.match(name)
        if match is None:
            return Target(name)
        prefix = f"layers.{match.group(1)}."
        return self._layer_target(prefix, match.group(2))

    def _layer_target(self, prefix: str, rest: str) -> Target:
        cfg = self.config
        expert = _EXPERT.match(rest)
        if expert is not None:
            index, proj = int(expert.group(1)), expert.group(2)
            if proj in ("down_proj", "w2"):
                return Target(f"{prefix}mlp.down", index, None, (str(index),))
            part = _GATE_UP[proj]
            inter = cfg.moe_intermediate_size
            rows = (0, inter) if part == "gate" else (inter, inter)
            return Target(f"{prefix}mlp.gate_up", index, rows, (f"{index}.{part}",))
        if rest in ("block_sparse_moe.gate.weight", "mlp.gate.weight"):
            return Target(f"{prefix}mlp.gate")
        if rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):  # already batched
            param = f"{prefix}mlp.{rest.rsplit('.', 1)[1].removesuffix('_proj')}"
            return Target(param, pieces=self.expected_pieces(param))
        block, _, tail = rest.partition(".")
        proj, _, kind = tail.partition(".")
        if block == "self_attn" and proj in _QKV:
            starts = {"q": 0, "k": cfg.q_size, "v": cfg.q_size + cfg.kv_size}
            sizes = {"q": cfg.q_size, "k": cfg.kv_size, "v": cfg.kv_size}
            part = _QKV[proj]
            return Target(f"{prefix}self_attn.qkv_proj.{kind}", None,
                          (starts[part], sizes[part]), (part,))
        if block == "self_attn" and proj == "qkv_proj":  # Phi-3: fused in the checkpoint
            return Target(f"{prefix}{rest}", pieces=("q", "k", "v"))
        if block == "mlp" and proj in ("gate_proj", "up_proj"):
            inter = cfg.intermediate_size
            part = _GATE_UP[proj]
            rows = (0, inter) if part == "gate" else (inter, inter)
            return Target(f"{prefix}mlp.gate_up_proj.{kind}", None, rows, (part,))
        if block == "mlp" and proj == "gate_up_proj":  # Phi-3: fused in the checkpoint
            return Target(f"{prefix}{rest}", pieces=("gate", "up"))
        return Target(f"{prefix}{rest}")

    def expected_pieces(self, name: str) -> tuple[str, ...]:
        if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            return ("q", "k", "v")
        if name.endswith("gate_up_proj.weight"):
            return ("gate", "up")
        experts = range(self.config.num_experts)
        if name.endswith("mlp.gate_up"):
            return tuple(f"{e}.{p}" for e in experts for p in ("gate", "up"))
        if name.endswith("mlp.down"):
            return tuple(str(e) for e in experts)
        return ("",)
