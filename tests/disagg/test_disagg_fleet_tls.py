"""Under the fleet's mutual TLS the prefill engine pushes the KV over TLS with its own
certificate (not the recompute fallback): the transfer is counted as sent."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import grpc
import pytest

from kvfleet.router_client import build_request
from kvfleet.runtime.tls import ROUTER_ROLE, name_options
from tests.fixtures.fleets import FleetOptions, running_fleet
from tests.fixtures.router_fleet import API_KEYS, RouterClient, greedy

pytestmark = pytest.mark.timeout(240)


def _sent_transfers(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
        lines = page.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith("kvfleet:kv_transfers_total")
               and 'side="send"' in line and 'outcome="ok"' in line)


def test_handoff_over_mutual_tls(tiny_model_dir: Path, tmp_path: Path) -> None:
    options: FleetOptions = {
        "prefill_engines": 1, "decode_engines": 1, "api_keys": True, "tls": True,
        "router_args": ("--disagg-prefill-threshold", "32"),
    }
    with running_fleet(tiny_model_dir, tmp_path, **options) as fleet:
        assert fleet.ca_file is not None
        credentials = grpc.ssl_channel_credentials(root_certificates=fleet.ca_file.read_bytes())
        with grpc.secure_channel(fleet.router_address, credentials,
                                 name_options(ROUTER_ROLE)) as channel:
            client = RouterClient(channel)
            prompt = [(5 * i + 1) % 500 + 3 for i in range(50)]
            completion = client.generate(build_request(
                prompt_token_ids=prompt, params=greedy(4, ignore_eos=True)), API_KEYS["tenant-0"])
        assert completion.num_tokens == 4 and completion.engine_id == "engine-1"
        port = fleet.engines[0].metrics_port
        assert port is not None and _sent_transfers(port) == 1
