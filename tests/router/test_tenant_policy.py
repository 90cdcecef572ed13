"""The tenant policy file, its hot reload and the per-request rules, as pure functions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfleet.contracts.errors import InvalidFieldError, NotFoundError
from kvfleet.contracts.sampling_params import SamplingParams
from kvfleet.v1 import router_pb2
from router.tenancy.policy_reload import PolicyStore
from router.tenancy.request_rules import TenantRules
from router.tenancy.tenant_policy import PriorityRange, TenantLimits, load_policy

POLICY_YAML = """\
defaults:
  requests_per_second: 5
  tokens_per_minute: 60000
tenants:
  acme:
    keys: [sk-acme-1, sk-acme-2]
    tokens_per_minute: 200000
    max_tokens: 512
    default_max_tokens: 128
    priority: {min: -5, max: 10, default: 2}
    weight: 2
    models: [small]
  legacy: [sk-legacy]
keys:
  sk-solo: solo
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_full_policy_and_the_old_key_file_forms(tmp_path: Path) -> None:
    policy = load_policy(write(tmp_path, "policy.yaml", POLICY_YAML))
    acme = policy.identify([("authorization", "Bearer sk-acme-2")])
    assert acme.name == "acme"
    assert acme.limits == TenantLimits(
        requests_per_second=5.0, tokens_per_minute=200000, max_tokens=512,
        default_max_tokens=128, priority=PriorityRange(-5, 10, 2), weight=2.0,
        models=frozenset({"small"}),
    )
    assert acme.limits.burst == 5
    for key, name in (("sk-legacy", "legacy"), ("sk-solo", "solo")):
        tenant = policy.identify([("x-api-key", key)])
        assert tenant.name == name and tenant.limits == policy.defaults
    # The key file of before loads unchanged: no limits, priorities >= 0.
    old = load_policy(write(tmp_path, "keys.json", json.dumps({"tenants": {"t": ["k"]}})))
    assert old.identify([("x-api-key", "k")]).limits == TenantLimits()


@pytest.mark.parametrize(("text", "expected"), [
    ("tenants:\n  acme:\n    keys: [k]\n    weight: -1\n",
     "bad.yaml:4: tenants.acme.weight: must be a number > 0"),
    ("tenants:\n  acme:\n    keys: [k]\n    tokens_per_minut: 5\n",
     "bad.yaml:4: tenants.acme.tokens_per_minut: unknown field"),
    ("defaults:\n  priority: {min: 5, max: 1}\n",
     "bad.yaml:2: defaults.priority: min (5) is above max (1)"),
    ("tenants:\n  acme: {keys: [k], max_tokens: 10, default_max_tokens: 20}\n",
     "bad.yaml:2: tenants.acme.default_max_tokens: must be at most max_tokens (10)"),
    ("tenants:\n  a: [k]\n  b: [k]\n", "bad.yaml:3: tenants.b.keys.0: a key is listed for two"),
    ("tenants: [\n", "bad.yaml:2: not valid YAML"),
])
def test_bad_files_name_the_line_and_field(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(ValueError) as caught:
        load_policy(write(tmp_path, "bad.yaml", text))
    assert str(caught.value).startswith(str(tmp_path / expected.split(":")[0]))
    assert expected.split(":", 1)[1] in str(caught.value)


def test_bad_json_names_its_line(tmp_path: Path) -> None:
    path = write(tmp_path, "bad.json", '{"tenants": {\n  "a": {"keys": ["k"],\n "weight": 0}}}')
    with pytest.raises(ValueError, match=r"bad.json:3: tenants.a.weight"):
        load_policy(path)
    write(tmp_path, "bad.json", '{"tenants": {\n  "a": [k]}}')
    with pytest.raises(ValueError, match=r"bad.json:2: not valid JSON"):
        load_policy(path)


def test_reload_takes_good_versions_and_keeps_the_last_good_one(tmp_path: Path) -> None:
    path = write(tmp_path, "policy.json", json.dumps({"tenants": {"a": ["k1"]}}))
    outcomes: list[str] = []
    store = PolicyStore(load_policy(path), path, on_reload=outcomes.append)
    assert not store.check()  # unchanged
    path.write_text(json.dumps({"tenants": {"a": ["k1"], "b": ["k2"]}}))
    assert store.check() and store.current.identify([("x-api-key", "k2")]).name == "b"
    path.write_text("{not json")
    assert not store.check()
    assert store.current.identify([("x-api-key", "k2")]).name == "b"
    path.unlink()
    assert not store.check()
    assert outcomes == ["ok", "error", "error"]


def rules(tmp_path: Path, **fields: object) -> TenantRules:
    policy = load_policy(write(tmp_path, "policy.yaml", POLICY_YAML))
    tenant = policy.identify([("x-api-key", "sk-acme-1")])
    request = router_pb2.RouterGenerateRequest(prompt="hi", **fields)  # type: ignore[arg-type]
    max_tokens = request.sampling_params.max_tokens if request.sampling_params.HasField(
        "max_tokens") else None
    return TenantRules.of(request, tenant, SamplingParams(max_tokens=max_tokens))


def test_priority_is_clamped_to_the_tenants_range(tmp_path: Path) -> None:
    assert rules(tmp_path).priority == 2  # unset: the tenant's default
    assert rules(tmp_path, priority=-(2**31)).priority == -5
    assert rules(tmp_path, priority=0).priority == 0  # explicit 0 is kept
    assert rules(tmp_path, priority=99).priority == 10
    anyone = PriorityRange()
    assert (anyone.clamp(None), anyone.clamp(-7), anyone.clamp(3)) == (0, 0, 3)


def test_max_tokens_cap_default_and_models(tmp_path: Path) -> None:
    settled = rules(tmp_path)
    assert settled.model == "small"  # an unnamed model: the tenant's allowed one
    assert settled.max_tokens(None, 100, 2048) == 128  # the tenant's default
    assert settled.max_tokens(None, 2000, 2048) == 48  # bounded by the context left
    assert settled.max_tokens(7, 100, 2048) == 7
    sampling = router_pb2.RouterGenerateRequest().sampling_params
    sampling.max_tokens = 513
    with pytest.raises(InvalidFieldError, match="at most 512") as caught:
        rules(tmp_path, sampling_params=sampling)
    assert caught.value.param == "max_tokens"
    with pytest.raises(NotFoundError):
        rules(tmp_path, model="large")


ADMIN_POLICY = """\
tenants:
  ops: {keys: [sk-ops], admin: true}
  acme:
    keys: [sk-acme, {key: sk-acme-admin, admin: true}]
    weight: 2
keys:
  sk-solo: solo
"""


def test_admin_tenants_and_admin_keys(tmp_path: Path) -> None:
    policy = load_policy(write(tmp_path, "policy.yaml", ADMIN_POLICY))
    admins = {key: policy.identify([("x-api-key", key)]).admin
              for key in ("sk-ops", "sk-acme", "sk-acme-admin", "sk-solo")}
    assert admins == {"sk-ops": True, "sk-acme": False, "sk-acme-admin": True, "sk-solo": False}
    acme_admin = policy.identify([("x-api-key", "sk-acme-admin")])
    assert acme_admin.name == "acme" and acme_admin.limits.weight == 2.0
    # Without a policy file nobody is told apart (as vLLM): the one caller is admin.
    assert PolicyStore.open().current.identify([]).admin


@pytest.mark.parametrize(("text", "message"), [
    ("tenants: {t: {keys: [k], admin: 'yes'}}", "tenants.t.admin: must be true or false"),
    ("tenants: {t: {keys: [{key: k, admin: 1}]}}", "tenants.t.keys.0.admin: must be true or"),
    ("tenants: {t: {keys: [{key: k, root: true}]}}", "tenants.t.keys.0.root: unknown field"),
    ("defaults: {admin: true}\ntenants: {t: [k]}", "defaults.admin: unknown field"),
])
def test_bad_admin_fields_are_refused(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        load_policy(write(tmp_path, "policy.yaml", text))
