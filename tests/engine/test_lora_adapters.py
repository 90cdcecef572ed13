"""LoRA adapters through the engine: bad adapters refused with a message naming the problem,
the host-memory LRU (`max_cpu_loras`), load / unload with a request in flight, and the
block-hash key of a name re-used for other weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, LoRARequest, SamplingParams
from engine.lora.peft_adapter import CONFIG_FILE, WEIGHTS_FILE
from engine.models.config import ModelConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = {"prompt_token_ids": list(range(20, 60))}  # 40 tokens: 32 cacheable


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(tiny_model_dir, dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=2)


def edited_copy(source: Path, dest: Path, config=None, tensors=None) -> Path:
    """A copy of adapter `source` with its config and/or tensors edited by callables."""
    shutil.copytree(source, dest)
    if config is not None:
        data = json.loads((dest / CONFIG_FILE).read_text())
        config(data)
        (dest / CONFIG_FILE).write_text(json.dumps(data))
    if tensors is not None:
        weights = load_file(str(dest / WEIGHTS_FILE))
        tensors(weights)
        save_file(weights, str(dest / WEIGHTS_FILE))
    return dest


def _lm_head(tensors: dict) -> None:
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, 64)


def _wrong_shape(tensors: dict) -> None:
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors[key] = torch.zeros(8, 65)


def _no_b(tensors: dict) -> None:
    del tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]


def _layer_9(tensors: dict) -> None:
    tensors["base_model.model.model.layers.9.mlp.down_proj.lora_A.weight"] = torch.zeros(8, 128)
    tensors["base_model.model.model.layers.9.mlp.down_proj.lora_B.weight"] = torch.zeros(64, 8)


BAD = {
    "no-config": (lambda d: (d / CONFIG_FILE).unlink(), "missing adapter_config.json"),
    "no-weights": (lambda d: (d / WEIGHTS_FILE).unlink(), "missing adapter_model.safetensors"),
    "dora": ({"config": lambda c: c.update(use_dora=True)}, "unsupported PEFT option(s) use_dora"),
    "target": (
        {"config": lambda c: c.update(target_modules=["q_proj", "lm_head"])},
        "unsupported target module(s) lm_head",
    ),
    "lm-head-tensor": ({"tensors": _lm_head}, "unsupported module tensor"),
    "shape": ({"tensors": _wrong_shape}, "do not fit the base model"),
    "missing-b": ({"tensors": _no_b}, "layers.1.down_proj has no lora_B weight"),
    "layer": ({"tensors": _layer_9}, "names layer 9 but the base model has 2 layers"),
    "not-lora": ({"config": lambda c: c.update(peft_type="IA3")}, "is not LORA"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_adapter_is_refused_naming_the_problem(llm, tiny_lora_dirs, tmp_path, case):
    edit, message = BAD[case]
    if callable(edit):
        path = edited_copy(tiny_lora_dirs["all-r8"], tmp_path / case)
        edit(path)
    else:
        path = edited_copy(tiny_lora_dirs["all-r8"], tmp_path / case, **edit)
    before = llm.engine.list_loras()
    with pytest.raises(ValueError, match=_escaped(message)):
        llm.generate(PROMPT, GREEDY, use_tqdm=False, lora_request=LoRARequest(case, 9, str(path)))
    assert llm.engine.list_loras() == before
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].finished  # still serving


def test_rank_above_max_lora_rank_is_refused(tiny_model_dir, tiny_lora_dirs):
    llm = LLM(tiny_model_dir, dtype="float32", enable_lora=True, max_lora_rank=4)
    request = LoRARequest("all-r8", 1, str(tiny_lora_dirs["all-r8"]))
    with pytest.raises(ValueError, match=r"rank 8 exceeds max_lora_rank \(4\)"):
        llm.generate(PROMPT, GREEDY, use_tqdm=False, lora_request=request)


def test_lora_requests_need_enable_lora(tiny_model_dir, tiny_lora_dirs):
    llm = LLM(tiny_model_dir, dtype="float32")
    request = LoRARequest("all-r8", 1, str(tiny_lora_dirs["all-r8"]))
    with pytest.raises(ValueError, match="not enabled"):
        llm.generate(PROMPT, GREEDY, use_tqdm=False, lora_request=request)
    # Without LoRA the projections stay plain Linear modules: the base path is untouched.
    qkv = llm.engine.model.layers[0].self_attn.qkv_proj
    assert type(qkv).__name__ == "Linear"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"max_loras": 0}, "max_loras must be at least 1"),
        ({"max_lora_rank": 0}, "max_lora_rank must be at least 1"),
        ({"max_loras": 3, "max_cpu_loras": 2}, r"max_cpu_loras \(2\) must be at least"),
    ],
)
def test_bad_lora_flags(tiny_model_dir, args, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_model_dir, dtype="float32", enable_lora=True, **args)


def test_name_served_from_another_path_is_refused(llm, tiny_lora_dirs):
    llm.engine.add_lora(LoRARequest("taken", 1, str(tiny_lora_dirs["qv-r4"])))
    with pytest.raises(ValueError, match="'taken' is already loaded from"):
        llm.engine.add_lora(LoRARequest("taken", 2, str(tiny_lora_dirs["mlp-r2"])))
    llm.engine.add_lora(LoRARequest("taken", 1, str(tiny_lora_dirs["qv-r4"])))  # same: no-op
    assert llm.engine.remove_lora("taken")
    with pytest.raises(ValueError, match="'taken' is not loaded"):
        llm.engine.add_request("x", [1, 2, 3], GREEDY, lora_request="taken")


def test_host_lru_keeps_max_cpu_loras_and_reloads(tiny_model_dir, tiny_lora_dirs):
    llm = LLM(tiny_model_dir, dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=2)
    requests = [
        LoRARequest(name, i + 1, str(p)) for i, (name, p) in enumerate(tiny_lora_dirs.items())
    ]
    outputs = [llm.generate(PROMPT, GREEDY, use_tqdm=False, lora_request=r) for r in requests]
    registry = llm.engine.lora.registry
    assert registry.cached_keys == [requests[1].lora_name, requests[2].lora_name]
    again = llm.generate(PROMPT, GREEDY, use_tqdm=False, lora_request=requests[0])
    assert again[0].outputs[0].token_ids == outputs[0][0].outputs[0].token_ids
    assert registry.cached_keys == [requests[2].lora_name, requests[0].lora_name]


def test_unload_lets_the_request_in_flight_finish(llm, tiny_lora_dirs):
    engine = llm.engine
    lora = LoRARequest("flight", 1, str(tiny_lora_dirs["all-r8"]))
    want = llm.generate(PROMPT, GREEDY, use_tqdm=False, lora_request=lora)[0].outputs[0].token_ids
    request = engine.add_request(
        "flying", PROMPT["prompt_token_ids"], GREEDY, lora_request="flight"
    )
    engine.step()
    assert engine.remove_lora("flight")
    assert "flight" not in [r.lora_name for r in engine.list_loras()]
    with pytest.raises(ValueError, match="'flight' is not loaded"):
        engine.add_request("late", [1, 2, 3], GREEDY, lora_request="flight")
    while engine.has_unfinished_requests():
        engine.step()
    assert request.output_token_ids == want


def test_name_reused_for_other_weights_gets_no_stale_hit(llm, tiny_lora_dirs):
    first = LoRARequest("reused", 1, str(tiny_lora_dirs["qv-r4"]))
    other = LoRARequest("reused", 1, str(tiny_lora_dirs["mlp-r2"]))
    out = llm.generate(PROMPT, GREEDY, use_tqdm=False, lora_request=first)[0]
    llm.engine.remove_lora("reused")
    swapped = llm.generate(PROMPT, GREEDY, use_tqdm=False, lora_request=other)[0]
    assert swapped.num_cached_tokens == 0
    assert swapped.outputs[0].token_ids != out.outputs[0].token_ids
    llm.engine.remove_lora("reused")
    back = llm.generate(PROMPT, GREEDY, use_tqdm=False, lora_request=first)[0]
    assert back.num_cached_tokens == 32  # the first weights' key is the plain name again
    assert back.outputs[0].token_ids == out.outputs[0].token_ids


def test_tiny_model_shapes_match_the_bad_cases(tiny_model_dir):
    config = ModelConfig.from_dir(Path(tiny_model_dir))
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (64, 128, 2)


def _escaped(text: str) -> str:
    import re

    return re.escape(text)
