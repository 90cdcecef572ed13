"""A Redis started with a password (what `kvfleet up` runs) refuses clients without it, and
the password never reaches the server's command line."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from kvfleet.redis_server import RedisServer


def test_a_redis_server_with_a_password_refuses_anonymous_clients() -> None:
    with RedisServer(password="pw-for-the-test") as server:
        assert "pw-for-the-test" not in server.url_without_password
        with redis.Redis(host=server.host, port=server.port) as anonymous, \
                pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        with redis.Redis.from_url(server.url) as client:
            assert client.ping()
        server.stop()
        server.start()  # "Redis restarted empty" (fault tests): same port, same password
        with redis.Redis.from_url(server.url) as client:
            assert client.ping()
    with pytest.raises(ValueError):
        RedisServer(password='has "quotes"')


def test_the_password_is_not_on_redis_servers_command_line() -> None:
    with RedisServer(password="pw-not-in-argv") as server:
        assert server._process is not None
        argv = Path(f"/proc/{server._process.pid}/cmdline").read_bytes()
        assert b"pw-not-in-argv" not in argv
