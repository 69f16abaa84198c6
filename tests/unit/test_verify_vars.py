"""vllm_verify reads what it expects from the published records, not from copies of other roles' defaults:
the vLLM version the prefill and decode hosts published (vllm_instance_published.vllm_version) unless
vllm_verify_vllm_version is set, and the router's metrics URL from vllm_router_published. The role's defaults
and vars are resolved by the real ansible-playbook on stand-in records (no host is contacted)."""

from __future__ import annotations

import json
import subprocess

import pytest
from test_preflight_inventories import ANSIBLE_PLAYBOOK, REPO, playbook_env

pytestmark = pytest.mark.skipif(ANSIBLE_PLAYBOOK is None, reason="ansible-playbook is not installed")

INVENTORY = {"prefill": {"hosts": {"p1": {}}}, "decode": {"hosts": {"d1": {}}}, "router": {"hosts": {"r1": {}}}}
PLAYBOOK = f"""\
- name: Publish stand-in records (set_fact only)
  hosts: all
  gather_facts: false
  tasks:
    - name: Publish
      ansible.builtin.set_fact:
        vllm_instance_published:
          vllm_version: "0.31.1"
          served_model_name: m
          vllm_variant: "{{{{ variant | default('cpu') }}}}"
          settings: {{kv_transport: "{{{{ transport | default('auto') }}}}"}}
          instances: []
        vllm_router_published:
          metrics_urls: ["http://[::1]:29100", "http://[::1]:29101"]
          tls: false
          front_port: 8000
          venv: /opt/vllm-router/venv

- name: Resolve vllm_verify's variables
  hosts: r1
  gather_facts: false
  tasks:
    - name: Load the role's defaults and vars
      ansible.builtin.include_vars: "{{{{ item }}}}"
      loop: ["{REPO}/roles/vllm_verify/defaults/main.yml", "{REPO}/roles/vllm_verify/vars/main.yml"]

    - name: Show them
      ansible.builtin.debug:
        msg: >-
          RESOLVED {{{{ _vllm_verify_vllm_version }}}} {{{{ _vllm_verify_router.metrics_urls | first }}}}/metrics
          {{{{ _vllm_verify_kv_transport }}}} {{{{ _vllm_verify_min_kv_throughput }}}}
"""


@pytest.mark.parametrize(("extra", "version", "transport"), [
    ({}, "0.31.1", "tcp 1"),
    ({"vllm_verify_vllm_version": "0.32", "variant": "cuda"}, "0.32", "rdma 100"),
    ({"variant": "cuda", "transport": "tcp", "vllm_verify_min_kv_throughput_mib_s": {"tcp": 40}}, "0.31.1", "tcp 40"),
])
def test_the_version_metrics_url_and_kv_transport_come_from_the_records(tmp_path, extra, version, transport):
    (tmp_path / "hosts.json").write_text(json.dumps(INVENTORY), encoding="utf-8")
    (tmp_path / "play.yml").write_text(PLAYBOOK, encoding="utf-8")
    run = subprocess.run(
        [ANSIBLE_PLAYBOOK, "-i", str(tmp_path / "hosts.json"), str(tmp_path / "play.yml"), "-e", json.dumps(extra)],
        cwd=REPO, env=playbook_env(), capture_output=True, text=True, timeout=120, check=False)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert f"RESOLVED {version} http://[::1]:29100/metrics {transport}" in output, output


def test_the_kv_throughput_floors_of_the_proof_the_rollout_and_the_alert_are_the_same():
    import yaml

    def floors(role, name):
        return yaml.safe_load((REPO / "roles" / role / "defaults" / "main.yml").read_text(encoding="utf-8"))[name]

    assert floors("vllm_verify", "vllm_verify_min_kv_throughput_mib_s") == floors(
        "vllm_monitoring", "vllm_monitoring_kv_throughput_min_mib_s") == floors(
        "vllm_rollout", "vllm_rollout_min_kv_throughput_mib_s") == {"tcp": 10, "rdma": 100}


def test_no_copy_of_another_roles_default_is_left():
    for path in ("defaults/main.yml", "vars/main.yml", "tasks/main.yml"):
        text = (REPO / "roles" / "vllm_verify" / path).read_text(encoding="utf-8")
        for copy in ("0.32.0", "29000", "vllm_install_version |", "vllm_router_metrics_port"):
            assert copy not in text, f"roles/vllm_verify/{path} holds {copy!r}"
