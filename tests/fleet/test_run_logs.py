"""Where `kvfleet up` keeps logs (one directory per run, old runs pruned) and `kvfleet logs`."""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path

import pytest

from kvfleet import run_logs
from kvfleet.cli import main


def make_run(root: Path, name: str, logs: dict[str, str]) -> Path:
    run = root / name
    run.mkdir(parents=True)
    for service, text in logs.items():
        (run / f"{service}.log").write_text(text)
    return run


def test_new_runs_are_latest_and_old_ones_are_pruned(tmp_path: Path) -> None:
    for index in range(4):
        make_run(tmp_path, f"20260101-00000{index}-1", {"router": "x\n"})
    run = run_logs.new_run_dir(tmp_path, keep=3)
    runs = sorted(p.name for p in tmp_path.iterdir() if not p.is_symlink())
    assert runs == ["20260101-000002-1", "20260101-000003-1", run.name]
    assert (tmp_path / run_logs.LATEST).resolve() == run.resolve()
    assert run_logs.latest_run_dir(tmp_path) == run


def test_logs_root_follows_the_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVFLEET_CACHE_DIR", str(tmp_path))
    assert run_logs.logs_root() == tmp_path / "logs"
    monkeypatch.delenv("KVFLEET_CACHE_DIR")
    assert run_logs.logs_root() == Path.home() / ".cache" / "kvfleet" / "logs"


def test_tails_prefix_lines_by_service_when_several(tmp_path: Path) -> None:
    run = make_run(tmp_path, "r", {"router": "a\nb\nc\n", "engine-0": "x\ny"})
    out = io.StringIO()
    run_logs.print_tails(run_logs.select_logs(run, []), 2, out)
    assert out.getvalue().splitlines() == [
        "engine-0  | x", "engine-0  | y", "router    | b", "router    | c"]
    out = io.StringIO()
    run_logs.print_tails(run_logs.select_logs(run, ["router"]), 1, out)
    assert out.getvalue() == "c\n"
    with pytest.raises(KeyError, match="tokenizer"):
        run_logs.select_logs(run, ["tokenizer"])


def test_follow_prints_appended_lines(tmp_path: Path) -> None:
    run = make_run(tmp_path, "r", {"router": "old\n"})
    out = io.StringIO()
    logs = run_logs.select_logs(run, ["router"])
    appended = threading.Event()

    def append() -> None:
        time.sleep(0.3)
        with open(run / "router.log", "a") as f:
            f.write("new\n")
        appended.set()

    writer = threading.Thread(target=append)
    writer.start()
    run_logs.follow(logs, out, stop_after_s=1.5)
    writer.join()
    assert appended.is_set() and out.getvalue() == "new\n"


def test_logs_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVFLEET_CACHE_DIR", str(tmp_path))
    assert main(["logs"]) == 1  # no run yet
    assert "no logs under" in capsys.readouterr().err
    run = run_logs.new_run_dir()
    (run / "router.log").write_text("serving\n")
    assert main(["logs", "-n", "5"]) == 0
    assert capsys.readouterr().out == "serving\n"
    assert main(["logs", "engine-7"]) == 1
    assert "no log for engine-7" in capsys.readouterr().err
