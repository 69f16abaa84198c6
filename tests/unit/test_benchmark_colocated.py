"""vllm_benchmark's colocated runs find their instance's live cache settings by URL in the prefix check's
result (plugins/modules/vllm_prefix_cache_check.py returns each instance's URL), not by its position: the first
task of roles/vllm_benchmark/tasks/colocated.yml, run as it is by the real ansible-playbook on stand-in records,
with the prefix check's instances in another order than pd_instances gives them."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml
from test_preflight_inventories import ANSIBLE_PLAYBOOK, REPO, playbook_env

pytestmark = pytest.mark.skipif(ANSIBLE_PLAYBOOK is None, reason="ansible-playbook is not installed")


def record(address: str, name: str, port: int) -> dict:
    return {"address": address, "instances": [{"name": name, "port": port, "kv_transfer_port": port - 2500,
                                               "settings": {"block_size": 16}}]}


HOSTVARS = {"p1": record("10.0.0.11", "vllm-0", 8100), "d1": record("10.0.0.21", "vllm-0", 8100)}
# The prefix check's result, decode first: a lookup by position would give p1 decode's settings.
DEPLOYMENT = {"instances": [
    {"name": "vllm-0", "role": "decode", "url": "http://10.0.0.21:8100", "cache_dtype": "fp8"},
    {"name": "vllm-0", "role": "prefill", "url": "http://10.0.0.11:8100", "cache_dtype": "auto"},
]}


def test_the_colocated_instance_is_matched_by_url(tmp_path):
    tasks = yaml.safe_load((REPO / "roles" / "vllm_benchmark" / "tasks" / "colocated.yml").read_text())
    pick = tasks[0]
    assert "__vllm_benchmark_alone" in pick["ansible.builtin.set_fact"]
    play = [
        {"name": "Publish stand-in records", "hosts": "all", "gather_facts": False, "tasks": [
            {"name": "Publish", "ansible.builtin.set_fact": {
                "vllm_instance_published": "{{ records[inventory_hostname] }}"}}]},
        {"name": "Pick the colocated instance", "hosts": "p1", "gather_facts": False, "tasks": [
            pick, {"name": "Show it", "ansible.builtin.debug": {
                "msg": "PICKED {{ __vllm_benchmark_alone.url }} {{ __vllm_benchmark_alone.deployed.cache_dtype }}"}}]},
    ]
    (tmp_path / "play.yml").write_text(yaml.safe_dump(play), encoding="utf-8")
    inventory = {"prefill": {"hosts": {"p1": {}}}, "decode": {"hosts": {"d1": {}}}}
    (tmp_path / "hosts.json").write_text(json.dumps(inventory), encoding="utf-8")
    extra = {"records": HOSTVARS, "_vllm_benchmark_deployment": DEPLOYMENT}
    run = subprocess.run(
        [ANSIBLE_PLAYBOOK, "-i", str(tmp_path / "hosts.json"), str(tmp_path / "play.yml"), "-e", json.dumps(extra)],
        cwd=REPO, env=playbook_env(), capture_output=True, text=True, timeout=120, check=False)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert "PICKED http://10.0.0.11:8100 auto" in output, output
