"""`--lora-allowed-dirs` (kvfleet/contracts/adapter_paths.py): what resolves inside the roots,
the one refusal for everything else, and the engine's start-up adapters inside them too."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.service.server import build_parser, options_from_args
from kvfleet.contracts.adapter_paths import REFUSED_MESSAGE, AdapterRoots
from kvfleet.contracts.errors import InvalidFieldError


@pytest.fixture
def root(tmp_path: Path) -> Path:
    adapter = tmp_path / "adapters" / "a"
    adapter.mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (adapter / name).write_text("{}")
    (tmp_path / "adapters" / "out").symlink_to(tmp_path, target_is_directory=True)
    (tmp_path / "adapters" / "in").symlink_to(adapter, target_is_directory=True)
    return tmp_path / "adapters"


def test_paths_inside_the_roots_resolve(root: Path) -> None:
    roots = AdapterRoots.of([root])
    assert roots.check_loadable(str(root / "a")) == str((root / "a").resolve())
    assert roots.check_loadable(str(root / "in")) == str((root / "a").resolve())
    assert roots.check_inside(str(root / "not-yet" / "x")).endswith("/not-yet/x")


def test_everything_else_is_one_refusal(root: Path, tmp_path: Path) -> None:
    roots = AdapterRoots.of([root])
    inside_only = ["/etc", f"{root}/../x", str(root / "out"), "a", str(tmp_path),
                   f"{root}x/a"]
    on_disk = [*inside_only, str(root / "missing"), str(root / "a" / "adapter_config.json")]
    for path in on_disk:
        with pytest.raises(InvalidFieldError) as caught:
            roots.check_loadable(path)
        assert (caught.value.param, str(caught.value)) == ("lora_path", REFUSED_MESSAGE), path
    for path in inside_only:
        with pytest.raises(InvalidFieldError):
            roots.check_inside(path)


def test_no_roots_leave_paths_alone_and_bad_roots_are_refused(tmp_path: Path) -> None:
    assert AdapterRoots().check_loadable("/anything") == "/anything"
    with pytest.raises(ValueError, match="not a directory"):
        AdapterRoots.of([tmp_path / "nope"])
    with pytest.raises(ValueError, match="not an absolute path"):
        AdapterRoots.of(["relative"], must_exist=False)
    assert AdapterRoots.of([tmp_path / "nope"], must_exist=False).configured


def test_engine_start_up_adapters_must_be_inside_the_roots(root: Path, tmp_path: Path) -> None:
    base = ["--model", str(tmp_path), "--engine-id", "e", "--redis-url", "redis://r:6379",
            "--enable-lora", "--lora-allowed-dirs", str(root)]
    options = options_from_args(build_parser().parse_args(
        [*base, "--lora-modules", f"a={root / 'a'}"]))
    assert options.lora_roots.dirs == (str(root.resolve()),)
    assert options.lora_modules[0].lora_path == str((root / "a").resolve())
    with pytest.raises(ValueError, match="outside --lora-allowed-dirs"):
        options_from_args(build_parser().parse_args([*base, "--lora-modules", "b=/etc"]))
