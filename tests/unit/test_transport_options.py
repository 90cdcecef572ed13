"""The transport flags parse once into config and refuse what cannot work (docs/tls.md):
Redis credentials from files, the --tls-* triple, the router's HTTPS flags, engine names."""

from __future__ import annotations

import argparse
import ssl
from pathlib import Path

import pytest

from kvfleet.runtime.redis_access import RedisAccess, add_redis_access_arguments, describe
from kvfleet.runtime.tls import (
    ENGINE_ROLE,
    TlsFiles,
    TlsMaterial,
    engine_name,
    is_handshake_failure,
)
from router.http.https import HttpsOptions, add_https_arguments


def _redis_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis-url", default=None)
    add_redis_access_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_redis_password_comes_from_its_file_and_never_shows(tmp_path: Path) -> None:
    password_file = tmp_path / "pw"
    password_file.write_text("s3cret-pass\n")
    access = RedisAccess.from_args(_redis_args("--redis-url", "redis://h:6379/0",
                                               "--redis-password-file", str(password_file)))
    assert access.client_kwargs("redis://h:6379/0") == {"password": "s3cret-pass"}
    assert "s3cret" not in repr(access)
    assert describe("redis://user:s3cret@h:6379/0") == "redis://user:***@h:6379/0"
    assert describe("redis://h:6379/0") == "redis://h:6379/0"


def test_bad_redis_credentials_fail_at_start(tmp_path: Path) -> None:
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        RedisAccess.from_args(_redis_args("--redis-password-file",
                                          str(tmp_path / "empty"))).check()
    with pytest.raises(ValueError, match="cannot read"):
        RedisAccess.from_args(_redis_args("--redis-password-file",
                                          str(tmp_path / "missing"))).check()
    with pytest.raises(ValueError, match="use one"):
        RedisAccess.from_args(_redis_args("--redis-url", "redis://:a@h:1/0",
                                          "--redis-password-file", str(tmp_path / "empty")))


def test_rediss_urls_get_the_ca_file(tmp_path: Path) -> None:
    access = RedisAccess.from_args(_redis_args("--redis-ca-file", str(tmp_path / "ca.pem")))
    assert access.client_kwargs("rediss://h:6379/0") == {"ssl_ca_certs": str(tmp_path / "ca.pem")}
    assert access.client_kwargs("redis://h:6379/0") == {}


def test_tls_needs_all_three_files(tmp_path: Path) -> None:
    assert TlsFiles.from_flags(None, None, None) is None
    with pytest.raises(ValueError, match="together"):
        TlsFiles.from_flags(tmp_path / "c", tmp_path / "k", None)
    (tmp_path / "c").write_text("not pem")
    files = TlsFiles(tmp_path / "c", tmp_path / "c", tmp_path / "c")
    with pytest.raises(ValueError, match="not a PEM"):
        TlsMaterial.load(files)


def test_engine_names_bind_the_registered_id() -> None:
    assert engine_name("{engine_id}", "engine-3") == "engine-3"
    assert engine_name("{engine_id}", None) == ENGINE_ROLE  # a poll by address
    assert engine_name("kvfleet-engine", "engine-3") == "kvfleet-engine"
    assert is_handshake_failure("... Hostname Verification Check failed.")
    assert is_handshake_failure("Tls handshake failed (TSI_PROTOCOL_FAILURE)")
    assert not is_handshake_failure("failed to connect to all addresses; Connection refused")


def _https(*argv: str) -> HttpsOptions | None:
    parser = argparse.ArgumentParser()
    add_https_arguments(parser)
    return HttpsOptions.from_args(parser.parse_args(list(argv)))


def test_https_flags_as_vllm(tmp_path: Path) -> None:
    cert, key, ca = (tmp_path / n for n in ("c.pem", "k.pem", "ca.pem"))
    for path in (cert, key, ca):
        path.write_text("x")
    assert _https() is None
    https = _https("--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
                   "--ssl-ca-certs", str(ca), "--ssl-cert-reqs", "2")
    assert https is not None and https.cert_reqs == ssl.CERT_REQUIRED
    assert https.uvicorn_kwargs()["ssl_ca_certs"] == str(ca)
    with pytest.raises(ValueError, match="both"):
        _https("--ssl-certfile", str(cert))
    with pytest.raises(ValueError, match="no such file"):
        _https("--ssl-certfile", str(cert), "--ssl-keyfile", str(tmp_path / "missing"))
