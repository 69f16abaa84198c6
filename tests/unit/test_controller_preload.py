"""Each playbook's first play has a template in its name, so ansible-playbook's main process loads Ansible's
filter plugins before it forks a worker per task and host; each worker would load them again otherwise (~15 ms
of controller CPU per worker; docs/architecture.md, "Controller time per task").

The run below records where the loads happen (fixtures/preload/sitecustomize.py wraps the loader) and fails when
a worker loads the filters itself: a name without a template, or an ansible-core that templates play names
elsewhere, shows up here rather than as a slower deployment.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from test_preflight_inventories import ANSIBLE_PLAYBOOK, CASES_DIR, REPO, playbook_env

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "preload"
PLAYBOOKS = sorted((REPO / "playbooks").glob("*.yml"))


def _first_play(path: Path) -> dict:
    plays = yaml.safe_load(path.read_text(encoding="utf-8"))
    play = plays[0]
    if "ansible.builtin.import_playbook" in play:
        return _first_play(path.parent / play["ansible.builtin.import_playbook"])
    return play


@pytest.mark.parametrize("playbook", PLAYBOOKS, ids=lambda p: p.name)
def test_the_first_play_name_has_a_filter_the_main_process_templates(playbook):
    name = _first_play(playbook)["name"]
    assert "{{" in name and "|" in name and name.rstrip().endswith("}}"), name


@pytest.mark.skipif(ANSIBLE_PLAYBOOK is None, reason="ansible-playbook is not installed")
def test_no_worker_loads_the_filter_plugins_again(tmp_path):
    log = tmp_path / "loads.txt"
    env = playbook_env(PYTHONPATH=str(FIXTURE), INFEROPS_PRELOAD_LOG=str(log))
    run = subprocess.run([ANSIBLE_PLAYBOOK, "-i", str(CASES_DIR / "good"), str(REPO / "playbooks" / "preflight.yml")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    loads = [line.split() for line in log.read_text(encoding="utf-8").splitlines()]
    filters = [(pid, main) for pid, main, kind in loads if kind == "filter"]
    # Loaded once, in the main process; the run's ~30 workers templated filters and loaded nothing.
    assert filters and all(pid == main for pid, main in filters), loads
