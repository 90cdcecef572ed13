"""What `make run` and `kvfleet up` serve without --model: the default model's own GGUF file,
directly, and that fleet end to end.

The fleet is started from `kvfleet up`'s own parser and config (2 engines, its threads, its
routing, the engines' default dtype), on real Redis, gRPC and HTTP, once for the module. A
greedy chat completion over HTTP equals transformers loading the same GGUF in float32, the
router's chat template is the file's own (`/tokenize` gives the ids transformers' template
gives), and the same chat again is a prefix hit; the demo `make run` prints shows prefix hits
on it. The CLI's model resolution and its errors naming --model need no fleet.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from engine.models.default_model import gguf_path
from kvfleet.cli import DEMO_PROMPTS, build_parser, resolve_model, run_demo, up_config
from kvfleet.fleet import Fleet
from tests.fixtures.fleets import running_fleet
from tests.fixtures.greedy import transformers_greedy

REPO_ROOT = Path(__file__).resolve().parents[2]
NEW_TOKENS = 24
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_up_without_model_serves_the_default_gguf() -> None:
    args = build_parser().parse_args(["up"])
    assert args.model is None
    assert resolve_model(args.model) == gguf_path()
    assert resolve_model(gguf_path()) == gguf_path()


def test_bad_model_is_refused_naming_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^--model .*missing\.gguf: no such file"):
        resolve_model(tmp_path / "missing.gguf")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"{}")
    with pytest.raises(ValueError, match=r"^--model .*model\.safetensors: a model file must be"):
        resolve_model(weights)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match=r"^--model .*garbage\.gguf: cannot read it as a GGUF"):
        resolve_model(garbage)


@pytest.mark.slow
def test_two_processes_build_one_companion_dir(tmp_path: Path) -> None:
    """Two engines started at once on a new GGUF both build its companion directory; one
    rename wins, the other keeps the winner's, and no staging directory is left."""
    script = ("from engine.models.default_model import gguf_path; "
              "from engine.quant.gguf_file import companion_dir; print(companion_dir(gguf_path()))")
    env = {**os.environ, "KVFLEET_CACHE_DIR": str(tmp_path)}
    racers = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT)
              for _ in range(2)]
    results = [racer.communicate(timeout=180) for racer in racers]
    assert [racer.returncode for racer in racers] == [0, 0], [err for _, err in results]
    built = {out.strip() for out, _ in results}
    assert len(built) == 1
    directory = Path(built.pop())
    assert sorted(p.name for p in (tmp_path / "gguf").iterdir()) == [directory.name]
    config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert "<|im_start|>" in config["chat_template"]


@pytest.fixture(scope="module")
def default_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """The fleet `kvfleet up` starts with no flags but a free HTTP port and a log dir here."""
    work = tmp_path_factory.mktemp("default_fleet")
    args = build_parser().parse_args(["up", "--http-port", "0", "--log-dir", str(work / "logs")])
    config = up_config(args, resolve_model(args.model))
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if f.name not in ("model_dir", "log_dir", "api_keys")}
    with running_fleet(config.model_dir, work, **fields) as fleet:
        yield fleet


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_default_fleet_chat_equals_transformers_on_the_gguf(default_fleet: Fleet) -> None:
    from transformers import AutoTokenizer

    gguf = gguf_path()
    assert len(default_fleet.engines) == 2
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    assert _post(default_fleet, "/tokenize", {"messages": CHAT})["tokens"] == prompt
    reference = transformers_greedy(gguf.parent, [prompt], NEW_TOKENS, gguf_file=gguf.name)[0]
    expected = tokenizer.decode(reference, skip_special_tokens=True)

    with OpenAI(base_url=f"{default_fleet.http_url}/v1", api_key="unused", max_retries=0,
                timeout=120) as client:
        assert [m.id for m in client.models.list().data] == [gguf.name]
        request = {"model": gguf.name, "messages": CHAT, "max_tokens": NEW_TOKENS,
                   "temperature": 0, "extra_body": {"ignore_eos": True}}
        first = client.chat.completions.create(**request)
        assert first.choices[0].message.content == expected
        assert first.usage is not None
        assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (
            len(prompt), NEW_TOKENS)
        stream = client.chat.completions.create(
            **request, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens >= 16  # the same chat: a prefix hit
    for engine in default_fleet.engines:  # the GGUF itself, in float32 (auto: its config's)
        log = engine.log_path.read_text(encoding="utf-8")
        assert f"GGUF {gguf.name}: weights" in log and "MiB (float32)" in log, log[-2000:]


def _post(fleet: Fleet, path: str, body: dict[str, object]) -> dict[str, object]:
    request = urllib.request.Request(f"{fleet.http_url}{path}", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        result: dict[str, object] = json.loads(reply.read())
    return result


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_demo_shows_prefix_hits_on_the_default_fleet(
    default_fleet: Fleet, capsys: pytest.CaptureFixture[str]
) -> None:
    asyncio.run(run_demo(default_fleet.router_address))
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("prompt "))
    table = [line.split() for line in lines[header + 1:] if line.startswith(DEMO_PROMPTS)]
    assert len(table) == 2 * len(DEMO_PROMPTS), "\n".join(lines)
    # Round two repeats round one's chats: at least the template's system-prompt block is
    # cached (SmolLM2's default system prompt is over 16 tokens), on the engine that holds it.
    assert all(int(row[-3]) >= 16 for row in table[len(DEMO_PROMPTS):]), "\n".join(lines)
    assert {row[-4] for row in table} <= {"engine-0", "engine-1"}
