"""The vllm_instance role's preflight reads the host's fabric (inferops.vllm.rdma_fabric_facts on this machine's
own /sys, which has no RDMA device, like a GPU host whose RDMA is missing) and refuses a host of the cuda build
before anything is changed, unless vllm_instance_kv_transport says tcp. The real ansible-playbook on localhost
(connection local); only the role's preflight runs, nothing is written."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from test_instance_templates import ANSIBLE_PLAYBOOK, REPO, _collections_path, _host, inventory

pytestmark = [
    pytest.mark.skipif(ANSIBLE_PLAYBOOK is None, reason="ansible-playbook is not installed"),
    pytest.mark.skipif(Path("/sys/class/infiniband").is_dir(), reason="this machine has RDMA devices"),
]

PLAY = [{
    "name": "The vllm_instance role's preflight",
    "hosts": "prefill:decode",
    "gather_facts": True,
    "gather_subset": ["network"],
    "tasks": [{"name": "Preflight", "ansible.builtin.include_role": {
        "name": "inferops.vllm.vllm_instance", "tasks_from": "preflight"}}],
}]


def preflight(tmp_path: Path, **host_vars) -> subprocess.CompletedProcess[str]:
    hosts = inventory(peers=False)
    hosts["all"]["vars"].update(vllm_install_variant="cuda", vllm_instance_kv_buffer_device="cuda")
    hosts["prefill"]["hosts"] = {"p1": _host("10.0.0.11", **host_vars)}
    # d1 says tcp: it passes on the same machine.
    hosts["decode"]["hosts"] = {"d1": _host("10.0.0.21", vllm_instance_kv_transport="tcp")}
    (tmp_path / "hosts.yml").write_text(yaml.safe_dump(hosts), encoding="utf-8")
    (tmp_path / "play.yml").write_text(yaml.safe_dump(PLAY, sort_keys=False), encoding="utf-8")
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_COLLECTIONS_PATH": _collections_path(),
           "ANSIBLE_NOCOLOR": "1", "ANSIBLE_LOCALHOST_WARNING": "0",
           "ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.default"}
    return subprocess.run([ANSIBLE_PLAYBOOK, "-i", str(tmp_path / "hosts.yml"), str(tmp_path / "play.yml"),
                           "-e", json.dumps({})], cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                          check=False)


def test_a_gpu_host_without_rdma_is_refused_and_one_that_says_tcp_is_not(tmp_path):
    run = preflight(tmp_path)
    output = " ".join((run.stdout + run.stderr).split())
    assert run.returncode != 0, output
    assert "p1: the KV path cannot work on this host:" in output, output
    assert ("instance prefill-0: KV would travel over RDMA (vllm_instance_kv_transport is auto on a cuda build), but "
            "the host has no active RDMA port: no RDMA device in /sys/class/infiniband") in output, output
    assert "d1: the KV path cannot work" not in output
    assert "d1 : ok=" in output and "failed=0" in output.split("d1 : ok=")[1][:80], output


def test_saying_tcp_passes(tmp_path):
    run = preflight(tmp_path, vllm_instance_kv_transport="tcp")
    assert run.returncode == 0, run.stdout + run.stderr
