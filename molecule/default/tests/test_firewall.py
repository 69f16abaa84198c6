"""The nftables rules of roles/vllm_firewall on the live pair: each instance's KV transfer (NIXL side
channel) port answers the prefill/decode hosts only, its API the router and the Podman host only.
Connections are tried for real from the containers and from a throwaway container on the same network."""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import DECODE, PREFILL, container_ip

# The scenario's network (scripts/sandbox/up.sh's is inferops-sandbox).
NETWORK = os.environ.get("INFEROPS_NETWORK", "inferops-molecule")
IMAGE = os.environ["INFEROPS_BASE_IMAGE"]

# (instance host, KV transfer port, API port), as the sandbox inventory sets them.
INSTANCES = [(PREFILL, 5600, 8100), (DECODE, 5700, 8200)]

CONNECT = (
    "import socket, sys\n"
    "try:\n"
    "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).close()\n"
    "except ConnectionRefusedError:\n"
    "    print('refused'); sys.exit(3)\n"
    "except OSError as exc:\n"
    "    print(type(exc).__name__, exc); sys.exit(4)\n"
    "print('connected')\n"
)


def connect_from(host, address: str, port: int) -> str:
    """Try a TCP connection from a container host (testinfra); 'connected', 'refused' or the error."""
    return host.run("python3 -c %s %s %s", CONNECT, address, str(port)).stdout.strip()


def connect_from_outsider(address: str, port: int) -> str:
    """The same from a new container on the sandbox network: an address neither peer nor router."""
    proc = subprocess.run(
        ["podman", "run", "--rm", "--network", NETWORK, IMAGE, "python3", "-c", CONNECT, address, str(port)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.stdout.strip(), proc.stderr
    return proc.stdout.strip()


@pytest.mark.parametrize("fixture", ["prefill_host", "decode_host"])
def test_rules_loaded_by_an_enabled_unit(request, fixture):
    host = request.getfixturevalue(fixture)
    unit = host.service("inferops-vllm-firewall")
    assert unit.is_enabled and unit.is_running
    rules = host.file("/etc/inferops-vllm/firewall.nft")
    assert rules.user == "root" and rules.mode == 0o644
    live = host.check_output("nft list table inet inferops_vllm")
    assert "reject with tcp reset" in live


@pytest.mark.parametrize(("name", "kv_port", "api_port"), INSTANCES)
def test_kv_port_answers_the_other_pd_host_only(prefill_host, decode_host, router_host, name, kv_port, api_port):
    address = container_ip(name)
    peer = decode_host if name == PREFILL else prefill_host
    assert connect_from(peer, address, kv_port) == "connected"
    # The router and any other address are refused.
    assert connect_from(router_host, address, kv_port) == "refused"
    assert connect_from_outsider(address, kv_port) == "refused"


@pytest.mark.parametrize(("name", "kv_port", "api_port"), INSTANCES)
def test_api_port_answers_the_router_not_others(router_host, name, kv_port, api_port):
    address = container_ip(name)
    assert connect_from(router_host, address, api_port) == "connected"
    assert connect_from_outsider(address, api_port) == "refused"
