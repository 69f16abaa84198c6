"""A lowered vllm_router_replicas (issue #24 point 5): the replicas past the new count are stopped and their ports
files removed, by the role's own tasks of roles/vllm_router/tasks/service.yml (read from the file, after the read of
tasks/host_state.yml that lists the ports files on the host before the run), run by the real
ansible-playbook on localhost against a temporary directory; the systemd task is replaced by a debug task that
names the units it would stop. The sandbox run that lowered 2 replicas to 1 under load (0 failed of 64) is in
benchmarks/RESULTS.md."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml
from monitoring_support import ANSIBLE_PLAYBOOK, REPO, run_playbook

pytestmark = pytest.mark.skipif(ANSIBLE_PLAYBOOK is None, reason="ansible-playbook is not installed")

SERVICE = REPO / "roles" / "vllm_router" / "tasks" / "service.yml"
HOST_STATE = REPO / "roles" / "vllm_router" / "tasks" / "host_state.yml"
ROLE_VARS = REPO / "roles" / "vllm_router" / "vars" / "main.yml"
STOP = "Stop and disable the replicas past vllm_router_replicas"
REMOVE = "Remove the ports files of the stopped replicas"


def task(name: str) -> dict[str, Any]:
    (found,) = [t for t in yaml.safe_load(SERVICE.read_text(encoding="utf-8")) if t.get("name") == name]
    return dict(found)


def plays(config_dir: str) -> list[dict[str, Any]]:
    (read,) = yaml.safe_load(HOST_STATE.read_text(encoding="utf-8"))
    stop = task(STOP)
    assert stop["ansible.builtin.systemd_service"] == {
        "name": "vllm-router@{{ __vllm_router_extra }}.service", "state": "stopped", "enabled": False}
    stop = {k: v for k, v in stop.items() if k != "ansible.builtin.systemd_service"}
    stop["ansible.builtin.debug"] = {"msg": "STOP vllm-router@{{ __vllm_router_extra }}.service"}
    return [{
        "name": "The replicas past vllm_router_replicas",
        "hosts": "localhost",
        "gather_facts": False,
        "vars": {"vllm_router_config_dir": config_dir},
        "vars_files": [str(ROLE_VARS)],
        "tasks": [read, stop, task(REMOVE)],
    }]


@pytest.mark.parametrize("replicas, stopped, kept", [
    (2, [2, 3, 10], ["replica-0.env", "replica-1.env"]),
    (4, [10], ["replica-0.env", "replica-1.env", "replica-2.env", "replica-3.env"]),
    (11, [], ["replica-0.env", "replica-1.env", "replica-10.env", "replica-2.env", "replica-3.env"]),
])
def test_the_replicas_past_the_count_stop_and_their_files_go(tmp_path, replicas, stopped, kept):
    config_dir = tmp_path / "vllm-router"
    config_dir.mkdir()
    for name in ("replica-0.env", "replica-1.env", "replica-2.env", "replica-3.env", "replica-10.env",
                 "router.env", "replica-x.env"):
        (config_dir / name).write_text("x\n")
    run = run_playbook(tmp_path, "lowered", plays(str(config_dir)), extra={"vllm_router_replicas": replicas})
    assert run.returncode == 0, run.stdout + run.stderr
    said = sorted(int(n) for n in re.findall(r"STOP vllm-router@([0-9]+)[.]service", run.stdout))
    assert said == stopped, run.stdout
    assert sorted(p.name for p in config_dir.iterdir()) == sorted(kept + ["router.env", "replica-x.env"])
    changed = re.search(r"localhost\s*: ok=\d+\s+changed=(\d+)", run.stdout)
    # The removal reports the change (the debug task standing in for the stop reports ok); nothing to do: no change.
    assert changed and int(changed.group(1)) == (1 if stopped else 0), run.stdout
