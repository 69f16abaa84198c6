"""Helpers for the nvidia_driver scenario's verify step: hosts through `podman exec`, and
ansible-playbook runs against the scenario's inventory with the JSON callback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import testinfra

SCENARIO = Path(__file__).resolve().parents[1]
DEBIAN = "driver-debian12"
UBUNTU = "driver-ubuntu2204"


@pytest.fixture(scope="session")
def debian():
    return testinfra.get_host(f"podman://{DEBIAN}")


@pytest.fixture(scope="session")
def ubuntu():
    return testinfra.get_host(f"podman://{UBUNTU}")


def run_playbook(playbook: str, *args: str) -> tuple[int, dict]:
    """ansible-playbook on the scenario's inventory; returns (rc, the JSON callback's report)."""
    inventory = os.environ["MOLECULE_INVENTORY_FILE"]
    env = dict(os.environ, ANSIBLE_STDOUT_CALLBACK="ansible.posix.json", ANSIBLE_FORCE_COLOR="0")
    # Other stdout-writing callbacks (profile_tasks, say) would break the JSON.
    env.pop("ANSIBLE_CALLBACKS_ENABLED", None)
    if os.environ.get("MOLECULE_EPHEMERAL_DIRECTORY"):
        cfg = Path(os.environ["MOLECULE_EPHEMERAL_DIRECTORY"]) / "ansible.cfg"
        if cfg.is_file():
            env["ANSIBLE_CONFIG"] = str(cfg)
    cmd = [shutil.which("ansible-playbook") or "ansible-playbook", "-i", inventory, str(SCENARIO / playbook), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert proc.stdout.strip(), f"no output from {cmd}: {proc.stderr}"
    return proc.returncode, json.loads(proc.stdout)


def task_results(report: dict, host: str) -> dict[str, dict]:
    """{task name: that host's result} over all plays (later tasks of the same name win)."""
    results = {}
    for play in report["plays"]:
        for task in play["tasks"]:
            if host in task["hosts"]:
                # Role tasks are named "<role> : <task>".
                results[task["task"]["name"].split(" : ", 1)[-1]] = task["hosts"][host]
    return results


def failure_messages(report: dict, host: str) -> list[str]:
    return [r.get("msg", "") for r in task_results(report, host).values() if r.get("failed")]
