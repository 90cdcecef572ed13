"""The fleet benchmark's prompts: written once per case to a JSONL file every system is sent.

- `prefix_repetition`: vLLM's own dataset of that name (`--num-prefixes` random-token prefixes
  of `--prefix-len` tokens, each prompt one of them + `--suffix-len` own tokens), built by
  vLLM's sampler itself (benchmarks/vllm_prompts.py in .venv-peers, with bench serve's flags
  and seed), so the text is exactly what `vllm bench serve --dataset-name prefix_repetition`
  would send;
- `multi_tenant`: `--tenants` tenants, each with a system prompt of `--system-tokens` tokens
  (benchmarks/serve.py's word prompts), and `--users` users per tenant, each sending `--turns`
  turns: turn k is the system prompt, the user's earlier turns each followed by a canned
  assistant answer, then the new question. Conversations are interleaved at random, each in
  its own order (a follow-up is never sent before the turn it follows).
Every file is sent as bench serve's `custom` dataset, as text, unshuffled and without a chat
template, with `--output-len` tokens per request.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
from collections.abc import Sequence
from pathlib import Path

from benchmarks.online import dataset_args
from benchmarks.serve import system_prompts, words_to_tokens
from benchmarks.vllm_runner import (
    LAUNCHER,
    REPO,
    PeerConfig,
    PeerError,
    log_tail,
    peer_env,
    peer_python,
)
from kvfleet.text.tokenizer import Tokenizer

CASES = ("prefix_repetition", "multi_tenant")
PROMPTS_SCRIPT = LAUNCHER.with_name("vllm_prompts.py")


def custom_dataset_args(path: Path, output_len: int) -> list[str]:
    """bench serve flags sending `path`'s prompts as they are, in file order."""
    return ["--dataset-name", "custom", "--dataset-path", str(path), "--skip-chat-template",
            "--disable-shuffle", "--custom-output-len", str(output_len)]


def write_prefix_repetition(path: Path, model_dir: Path, args: argparse.Namespace,
                            cfg: PeerConfig, seed: int) -> Path:
    """vLLM's prefix_repetition prompts for `seed`, by vLLM's own sampler."""
    path.parent.mkdir(parents=True, exist_ok=True)
    log = path.with_suffix(".log")
    argv = [str(peer_python()), "-I", str(PROMPTS_SCRIPT), "--out", str(path),
            "--backend", "openai", "--endpoint", "/v1/completions", "--model", model_dir.name,
            "--tokenizer", str(model_dir), *dataset_args("prefix_repetition", args),
            "--num-prompts", str(args.num_prompts), "--seed", str(seed)]
    with log.open("w", encoding="utf-8") as out:
        code = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out,
                              stderr=subprocess.STDOUT, env=peer_env(cfg), cwd=REPO,
                              timeout=600, check=False).returncode
    if code != 0:
        raise PeerError(f"vllm_prompts.py failed ({code}); log {log}:\n{log_tail(log)}")
    return path


def conversation_order(num_conversations: int, turns: int, rng: random.Random
                       ) -> list[tuple[int, int]]:
    """(conversation, turn) pairs, conversations interleaved at random, turns in order."""
    slots = [c for c in range(num_conversations) for _ in range(turns)]
    rng.shuffle(slots)
    next_turn = [0] * num_conversations
    order = []
    for c in slots:
        order.append((c, next_turn[c]))
        next_turn[c] += 1
    return order


def multi_tenant_prompts(tokenizer: Tokenizer, args: argparse.Namespace, seed: int) -> list[str]:
    """The first `--num-prompts` turns of the interleaved multi-tenant conversations."""
    rng = random.Random(seed)
    systems = system_prompts(tokenizer, args.tenants, args.system_tokens)
    conversations = [(t, u) for t in range(args.tenants) for u in range(args.users)]
    questions = [[words_to_tokens(tokenizer, rng, f"User {u} of tenant {t}, question {k}:",
                                  args.user_tokens) for k in range(args.turns)]
                 for t, u in conversations]
    answer = words_to_tokens(tokenizer, random.Random(seed + 1), "Here is my answer:",
                             args.output_len)
    prompts = []
    for c, k in conversation_order(len(conversations), args.turns, rng)[:args.num_prompts]:
        history = "".join(f"User: {q}\nAssistant: {answer}\n" for q in questions[c][:k])
        prompts.append(f"{systems[conversations[c][0]]}\n\n{history}User: {questions[c][k]}\n"
                       "Assistant:")
    return prompts


def write_prompts(path: Path, prompts: Sequence[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts), encoding="utf-8")
    return path


def read_prompts(path: Path) -> list[str]:
    return [json.loads(line)["prompt"] for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip()]


def write_case(case: str, path: Path, model_dir: Path, tokenizer: Tokenizer,
               args: argparse.Namespace, cfg: PeerConfig, seed: int) -> list[str]:
    """Write `case`'s prompts to `path`; return them."""
    if case == "prefix_repetition":
        write_prefix_repetition(path, model_dir, args, cfg, seed)
    elif case == "multi_tenant":
        write_prompts(path, multi_tenant_prompts(tokenizer, args, seed))
    else:
        raise ValueError(f"unknown case {case!r}")
    return read_prompts(path)
