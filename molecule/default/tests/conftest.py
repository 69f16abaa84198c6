"""Shared helpers for the molecule verify step: hosts through `podman exec` (fast, unlike one
ansible process per check) and plain HTTP from the controller to the containers' addresses."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request

import pytest
import testinfra
from prometheus_client.parser import text_string_to_metric_families

# Overridable so that the same checks run against the sandbox of scripts/sandbox/up.sh.
PREFILL = os.environ.get("INFEROPS_PREFILL_HOST", "molecule-prefill")
DECODE = os.environ.get("INFEROPS_DECODE_HOST", "molecule-decode")
ROUTER = os.environ.get("INFEROPS_ROUTER_HOST", "molecule-router")


def pytest_configure(config):
    config.addinivalue_line("markers", "changes_deployment: changes what the other tests read (day-2 operations); "
                                       "runs after every test without the mark, in the order written")


def pytest_collection_modifyitems(items):
    """Tests that change the deployment run after those that only read it, whatever their file names (a stable
    sort: the order within each group is pytest's, i.e. file by file, as written)."""
    items.sort(key=lambda item: item.get_closest_marker("changes_deployment") is not None)


def front_ca() -> str | None:
    """The CA of the front's certificate: molecule's prepare step makes one (TLS on); the sandbox of
    up.sh serves plain HTTP (none), unless INFEROPS_FRONT_CA names one."""
    ephemeral = os.environ.get("MOLECULE_EPHEMERAL_DIRECTORY", "/nonexistent")
    path = os.environ.get("INFEROPS_FRONT_CA") or os.path.join(ephemeral, "tls", "ca.pem")
    return path if os.path.isfile(path) else None


def secret(name: str) -> str:
    """A sandbox key, as the inventory's password lookups made it (scripts/sandbox/lib.sh)."""
    with open(os.path.join(os.environ["INFEROPS_SECRETS_DIR"], name)) as f:
        return f.read().split()[0]


def deploy_playbook(inventory: str, name: str, *args: str, timeout: int = 1800) -> subprocess.CompletedProcess:
    """ansible-playbook of this checkout's playbooks/NAME with molecule's ansible.cfg, output captured."""
    project = os.environ.get("MOLECULE_PROJECT_DIRECTORY", "")
    env = dict(os.environ)
    cfg = os.path.join(os.environ.get("MOLECULE_EPHEMERAL_DIRECTORY", "/nonexistent"), "ansible.cfg")
    if os.path.isfile(cfg):
        env["ANSIBLE_CONFIG"] = cfg
    return subprocess.run(["ansible-playbook", "-i", inventory, os.path.join(project, "playbooks", name), *args],
                          cwd=project, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def container_ip(name: str) -> str:
    out = subprocess.run(
        ["podman", "inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", name],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    assert out, f"container {name} has no IP address"
    return out


def http_json(url: str, body: dict | None = None, timeout: float = 180, headers: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def instance_auth(key: str | None = None) -> dict:
    """The header the instances require on every route but /health (roles/vllm_instance's inferops_vllm_auth.py):
    the sandbox's instance key unless ``key`` is given."""
    return {"Authorization": f"Bearer {key or secret('instance_api_key')}"}


def metric_samples(url: str, key: str | None = None) -> dict[tuple[str, tuple], float]:
    """All samples of an instance's /metrics page (sent with the instance key, or ``key``), keyed by (name,
    sorted labels without model/engine)."""
    with urllib.request.urlopen(urllib.request.Request(url, headers=instance_auth(key)), timeout=30) as resp:
        text = resp.read().decode()
    out: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine")))
            out[(s.name, labels)] = out.get((s.name, labels), 0.0) + s.value
    return out


# CPU seconds (user + system) of every process that systemd counts in a unit, read in the host.
_UNIT_CPU_SCRIPT = r"""
import os, subprocess, sys
unit = sys.argv[1]
ticks = 0
for line in subprocess.run(["ps", "-eo", "pid=,unit="], capture_output=True, text=True, check=True).stdout.splitlines():
    pid, _, owner = line.strip().partition(" ")
    if owner.strip() != unit:
        continue
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        continue
    ticks += int(fields[11]) + int(fields[12])
print(ticks / os.sysconf("SC_CLK_TCK"))
"""


def unit_cpu_seconds(host, unit: str) -> float:
    return float(host.check_output("python3 -c %s %s", _UNIT_CPU_SCRIPT, unit))


def journal_tail(host, unit: str, lines: int = 60) -> str:
    """The unit's last journal lines, for the message of a failed test."""
    return host.run(f"journalctl -u {unit} -n {lines} --no-pager -o cat").stdout


@pytest.fixture(scope="session")
def prefill_host():
    return testinfra.get_host(f"podman://{PREFILL}")


@pytest.fixture(scope="session")
def decode_host():
    return testinfra.get_host(f"podman://{DECODE}")


@pytest.fixture(scope="session")
def router_host():
    return testinfra.get_host(f"podman://{ROUTER}")


@pytest.fixture(scope="session")
def front_url():
    return f"{'https' if front_ca() else 'http'}://{container_ip(ROUTER)}:8000"


@pytest.fixture(scope="session")
def prefill_url():
    return f"http://{container_ip(PREFILL)}:8100"


@pytest.fixture(scope="session")
def decode_url():
    return f"http://{container_ip(DECODE)}:8200"
