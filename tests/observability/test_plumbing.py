"""In-process checks of the observability plumbing: flags, JSON log lines, /metrics endpoint."""

from __future__ import annotations

import argparse
import io
import json
import logging
import socket
import urllib.request
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry, Counter

from kvfleet.runtime.logs import JsonFormatter, request_context
from kvfleet.runtime.metrics import start_metrics_endpoint
from kvfleet.runtime.options import DEFAULT_METRICS_PORT, ServerOptions, add_server_arguments


def parse(argv: list[str]) -> ServerOptions:
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    return ServerOptions.from_args(parser.parse_args(argv))


def test_metrics_and_log_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KVFLEET_LOG_LEVEL", raising=False)
    monkeypatch.delenv("KVFLEET_LOG_FORMAT", raising=False)
    options = parse([])
    # On by default, like vLLM's /metrics; a taken default port falls back to a free one.
    assert options.metrics_port == DEFAULT_METRICS_PORT and options.metrics_port_fallback
    assert options.metrics_port_file is None
    assert (options.log_level, options.log_format) == ("INFO", "text")
    assert parse(["--no-metrics"]).metrics_port is None
    options = parse(["--metrics-port", "0", "--metrics-port-file", str(tmp_path / "m"),
                     "--log-format", "json", "--log-level", "DEBUG"])
    assert options.metrics_port == 0 and options.metrics_port_file == tmp_path / "m"
    assert not options.metrics_port_fallback  # asked for: a busy port is an error
    assert (options.log_level, options.log_format) == ("DEBUG", "json")
    monkeypatch.setenv("KVFLEET_LOG_LEVEL", "warning")
    monkeypatch.setenv("KVFLEET_LOG_FORMAT", "json")
    assert (parse([]).log_level, parse([]).log_format) == ("WARNING", "json")
    assert parse(["--log-level", "ERROR"]).log_level == "ERROR"  # the flag wins
    monkeypatch.setenv("KVFLEET_LOG_FORMAT", "xml")
    with pytest.raises(ValueError, match="log format"):
        parse([])


def test_json_lines_carry_request_tenant_and_trace() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    log = logging.getLogger("kvfleet.test.json")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    tracer = TracerProvider().get_tracer("test")
    try:
        log.info("outside")
        with request_context("req-1", "tenant-a"), tracer.start_as_current_span("s") as span:
            log.info("inside %d", 7)
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("failed")
    finally:
        log.removeHandler(handler)
    outside, inside, failed = (json.loads(line) for line in stream.getvalue().splitlines())
    assert outside["message"] == "outside" and "request_id" not in outside
    assert "trace_id" not in outside
    assert inside["message"] == "inside 7" and inside["level"] == "INFO"
    assert inside["request_id"] == "req-1" and inside["tenant"] == "tenant-a"
    assert inside["trace_id"] == format(span.get_span_context().trace_id, "032x")
    assert "request_id" not in failed and "RuntimeError: boom" in failed["exc"]


def test_metrics_endpoint_on_a_free_port(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    Counter("kvfleet:test_things", "things", registry=registry).inc(3)
    assert start_metrics_endpoint(registry, "127.0.0.1", None) is None
    endpoint = start_metrics_endpoint(registry, "127.0.0.1", 0, tmp_path / "metrics.port")
    assert endpoint is not None
    try:
        assert int((tmp_path / "metrics.port").read_text()) == endpoint.port
        url = f"http://127.0.0.1:{endpoint.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            assert "kvfleet:test_things_total 3.0" in response.read().decode()
    finally:
        endpoint.close()


def test_a_busy_default_metrics_port_falls_back_but_a_chosen_one_fails() -> None:
    registry = CollectorRegistry()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError):
            start_metrics_endpoint(registry, "127.0.0.1", port)
        endpoint = start_metrics_endpoint(registry, "127.0.0.1", port, fallback=True)
        assert endpoint is not None
        try:
            assert endpoint.port not in (0, port)
        finally:
            endpoint.close()
