"""Graceful shutdown of a real tokenizer server process (`python -m tokenizer_svc.server`).

SIGTERM while a slow DetokenizeStream is in flight: the stream runs to completion, new work
is refused with UNAVAILABLE while health reports NOT_SERVING, and the process exits 0.
Past the grace period, stragglers are cut off and the process still exits 0.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvfleet.text.tokenizer import Tokenizer
from kvfleet.v1 import tokenizer_pb2, tokenizer_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60
TIMEOUT_S = 30
TEXT = "Slow stream: café, 東京, 🙂 and more words to finish."


class ServerProcess:
    """The tokenizer server in a subprocess, on a free port announced via --port-file."""

    def __init__(self, model_dir: Path, tmp_path: Path, *extra_args: str) -> None:
        port_file = tmp_path / "port"
        self.log_path = tmp_path / "server.log"
        self._log = self.log_path.open("wb")
        command = [sys.executable, "-m", "tokenizer_svc.server", "--model", str(model_dir)]
        command += ["--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file)]
        self.process = subprocess.Popen(
            [*command, *extra_args], cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not port_file.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"server did not start:\n{self.log()}")
            time.sleep(0.05)
        self.address = f"127.0.0.1:{int(port_file.read_text())}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._log.close()


@pytest.fixture
def server_process(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    started: list[ServerProcess] = []

    def start(*extra_args: str) -> ServerProcess:
        server = ServerProcess(tiny_model_dir, tmp_path, *extra_args)
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


class ControlledStream:
    """A DetokenizeStream whose request messages the test sends one at a time."""

    def __init__(self, stub: tokenizer_pb2_grpc.TokenizerStub) -> None:
        self._outbox: queue.Queue[list[int] | None] = queue.Queue()
        self.responses = stub.DetokenizeStream(self._requests(), timeout=TIMEOUT_S)

    def _requests(self) -> Iterator[tokenizer_pb2.DetokenizeStreamRequest]:
        while (ids := self._outbox.get(timeout=TIMEOUT_S)) is not None:
            yield tokenizer_pb2.DetokenizeStreamRequest(token_ids=ids)

    def send(self, token_id: int) -> str:
        self._outbox.put([token_id])
        return next(self.responses).text_delta

    def finish(self) -> list[str]:
        self._outbox.put(None)
        return [r.text_delta for r in self.responses]


def health_status(channel: grpc.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT_S).status


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_lets_in_flight_stream_finish_and_exits_zero(server_process, tiny_model_dir, signum):
    ids = Tokenizer.from_dir(tiny_model_dir).encode(TEXT, add_special_tokens=False)
    server = server_process("--grace-period", "20")
    with grpc.insecure_channel(server.address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        assert health_status(channel) == health_pb2.HealthCheckResponse.SERVING
        stream = ControlledStream(stub)
        deltas = [stream.send(t) for t in ids[:3]]
        os.kill(server.process.pid, signum)
        deadline = time.monotonic() + TIMEOUT_S
        while health_status(channel) != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline, "health never turned NOT_SERVING"
            time.sleep(0.02)
        with pytest.raises(grpc.RpcError) as info:  # new work goes to another replica
            stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="hi"), timeout=TIMEOUT_S)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        for token_id in ids[3:]:  # the in-flight stream keeps going, slowly
            time.sleep(0.02)
            deltas.append(stream.send(token_id))
        deltas.extend(stream.finish())
    assert "".join(deltas) == TEXT
    assert server.process.wait(TIMEOUT_S) == 0, server.log()
    assert f"{signal.Signals(signum).name} received: draining" in server.log()


@pytest.mark.parametrize(
    ("grace_period", "second_signal", "reason"),
    [
        pytest.param("0.5", False, "after the grace period", id="grace-expires"),
        pytest.param("60", True, "on a second signal", id="second-signal"),
    ],
)
def test_stragglers_are_cut_off_and_exit_is_zero(
    server_process, grace_period, second_signal, reason
):
    server = server_process("--grace-period", grace_period)
    with grpc.insecure_channel(server.address) as channel:
        stream = ControlledStream(tokenizer_pb2_grpc.TokenizerStub(channel))
        stream.send(5)  # the stream is open and is never finished by the client
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        if second_signal:
            deadline = time.monotonic() + TIMEOUT_S
            while "SIGTERM received: draining" not in server.log():
                assert time.monotonic() < deadline, server.log()
                time.sleep(0.02)
            server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(TIMEOUT_S) == 0, server.log()
        assert time.monotonic() - started < 10
        with pytest.raises(grpc.RpcError):
            stream.finish()
    assert f"cancelling 1 in-flight RPC(s) {reason}" in server.log()
