"""`--chat-template` (a file or the template itself, as vLLM takes it) on the tokenizer
service: a model without a template can serve chats, and a bad value stops the start."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from kvfleet.fleet import FleetConfig, engine_command, tokenizer_command
from kvfleet.runtime.grpc_server import GrpcServer
from kvfleet.text.chat_template import resolve_chat_template
from kvfleet.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from tests.fixtures.servers import ThreadedServer
from tokenizer_svc import server as tokenizer_server

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
StartServer = Callable[[Callable[[], GrpcServer]], ThreadedServer]


@pytest.fixture
def no_template_model(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """The tiny model without its chat template."""
    model = tmp_path / "no-template"
    shutil.copytree(tiny_model_dir, model)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    return model


def tokenize_chat(address: str) -> tokenizer_pb2.TokenizeResponse:
    messages = common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role="user",
                                                                       content="hi")])
    with grpc.insecure_channel(address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        response: tokenizer_pb2.TokenizeResponse = stub.Tokenize(
            tokenizer_pb2.TokenizeRequest(messages=messages), timeout=30)
        return response


def test_resolve_takes_a_file_or_the_template_itself(tmp_path: Path) -> None:
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    assert resolve_chat_template(str(path)) == TEMPLATE
    assert resolve_chat_template(TEMPLATE) == TEMPLATE
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        resolve_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not compile"):
        resolve_chat_template("{% for m in messages %}")


def test_a_model_without_a_template_serves_chats_with_the_flag(
    no_template_model: Path, threaded_server: StartServer
) -> None:
    plain = threaded_server(lambda: tokenizer_server.build_server(no_template_model,
                                                                  "127.0.0.1", 0))
    with pytest.raises(grpc.RpcError) as info:
        tokenize_chat(plain.address)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no chat template" in (info.value.details() or "")

    templated = threaded_server(lambda: tokenizer_server.build_server(
        no_template_model, "127.0.0.1", 0, chat_template=TEMPLATE))
    assert tokenize_chat(templated.address).prompt == "[user] hi\n[assistant] "


def test_a_bad_template_stops_the_start(tiny_model_dir: Path, tmp_path: Path) -> None:
    argv = ["--model", str(tiny_model_dir), "--no-metrics", "--port", "0"]
    assert tokenizer_server.main([*argv, "--chat-template", str(tmp_path / "nope.jinja")]) == 2
    assert tokenizer_server.main([*argv, "--chat-template", "{% if %}"]) == 2


def test_a_fleet_passes_the_template_and_the_name_on(tiny_model_dir: Path) -> None:
    config = FleetConfig(model_dir=tiny_model_dir, chat_template=TEMPLATE,
                         served_model_name="named")
    tokenizer = tokenizer_command(config)
    assert tokenizer[tokenizer.index("--chat-template") + 1] == TEMPLATE
    assert tokenizer[tokenizer.index("--served-model-name") + 1] == "named"
    engine = engine_command(config, "engine-0", "redis://127.0.0.1:1")
    assert engine[engine.index("--served-model-name") + 1] == "named"
    assert "--chat-template" not in engine  # only the tokenizer renders chats
