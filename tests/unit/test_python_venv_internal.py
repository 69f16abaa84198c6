"""python_venv is internal: a play that calls it itself is refused, by the real ansible-playbook on localhost.

vllm_install and vllm_router include it with the settings of what they install; a playbook that lists it
under `roles:` or includes it from its own tasks gets a failure that names those roles, before any of its
tasks ran. A role that includes it (here a stand-in for those two, written beside the playbook) gets past
that check. `stand_in_caller` is also how the tests of the switch and prune entry points run them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_preflight_inventories import ANSIBLE_PLAYBOOK, RECAP_RE, REPO, playbook_env

pytestmark = pytest.mark.skipif(ANSIBLE_PLAYBOOK is None, reason="ansible-playbook is not installed")

PLAY = """\
- name: Call python_venv
  hosts: localhost
  connection: local
  gather_facts: false
"""
# How a user's playbook could call it: the play's roles, or a task of the play.
DIRECT = {
    "roles": PLAY + "  roles:\n    - inferops.vllm.python_venv\n",
    "include_role": PLAY + """\
  tasks:
    - name: Include python_venv
      ansible.builtin.include_role:
        name: inferops.vllm.python_venv
        tasks_from: "{{ entry_point }}"
""",
    "import_role": PLAY + """\
  tasks:
    - name: Import python_venv
      ansible.builtin.import_role:
        name: inferops.vllm.python_venv
""",
}
CALLER_TASKS = """\
---
- name: Include python_venv, as vllm_install and vllm_router do
  ansible.builtin.include_role:
    name: inferops.vllm.python_venv
    tasks_from: "{{ entry_point }}"
"""
REFUSAL = (
    "inferops.vllm.python_venv is an internal role of the collection, used by the roles inferops.vllm.vllm_install "
    "(vLLM's venv) and inferops.vllm.vllm_router (vllm-router's venv)"
)


def stand_in_caller(directory: Path) -> Path:
    """A playbook in ``directory`` whose play runs a role that includes python_venv's ``entry_point``."""
    tasks = directory / "roles" / "python_venv_caller" / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    (tasks / "main.yml").write_text(CALLER_TASKS)
    playbook = directory / "caller.yml"
    playbook.write_text(PLAY + "  roles:\n    - python_venv_caller\n")
    return playbook


def run(playbook: Path, entry_point: str, *args: str, **extra) -> tuple[subprocess.CompletedProcess[str], str]:
    """ansible-playbook on localhost with ``entry_point`` and ``extra`` as extra vars: the run and its output."""
    env = playbook_env(ANSIBLE_LOCALHOST_WARNING="0", ANSIBLE_INVENTORY_UNPARSED_WARNING="0")
    result = subprocess.run(
        [ANSIBLE_PLAYBOOK, "-i", "localhost,", str(playbook), *args,
         "-e", json.dumps({"ansible_python_interpreter": sys.executable, "entry_point": entry_point,
                           "python_venv_label": "test", **extra})],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180, check=False,
    )
    return result, " ".join((result.stdout + result.stderr).split())


def recap(result: subprocess.CompletedProcess[str]) -> str:
    match = RECAP_RE.search(result.stdout)
    return match.group(0) if match else ""


@pytest.mark.parametrize(
    ("how", "entry_point"),
    [("roles", "main"), ("include_role", "main"), ("include_role", "switch"), ("include_role", "prune"),
     ("import_role", "main")],
)
def test_a_play_that_calls_python_venv_is_refused(tmp_path, how, entry_point):
    playbook = tmp_path / "play.yml"
    playbook.write_text(DIRECT[how])
    venv = tmp_path / "venv"
    # Settings that would pass the entry points' own checks: only the guard stops the play.
    result, output = run(playbook, entry_point, python_venv_path=str(venv), python_venv_keep_previous=0,
                         python_venv_fingerprint={"version": "1.0.0"})
    assert result.returncode != 0, output
    assert REFUSAL in output, output
    assert "Use one of those roles, or playbooks/deploy_pd.yml, instead." in output, output
    assert "python_venv_path must be" not in output, "the path was judged, not the call"
    assert not [line for line in result.stdout.splitlines() if line.startswith("TASK [inferops.vllm.python_venv : ")
                and "Check that a role includes python_venv" not in line
                and "Validating arguments against arg spec" not in line], "a task after the guard ran"
    assert "changed=0" in recap(result) and "failed=1" in recap(result), recap(result)
    assert not venv.exists() and not (tmp_path / "venv.d").exists()


def test_the_refusal_holds_in_a_run_limited_by_tags(tmp_path):
    playbook = tmp_path / "play.yml"
    playbook.write_text(DIRECT["roles"])
    result, output = run(playbook, "main", "--tags", "some_other_tag", python_venv_path=str(tmp_path / "venv"))
    assert result.returncode != 0 and REFUSAL in output, output


def test_a_role_that_includes_python_venv_gets_past_the_check(tmp_path):
    venv = tmp_path / "venv"
    result, output = run(stand_in_caller(tmp_path), "prune", python_venv_path=str(venv), python_venv_keep_previous=1)
    assert result.returncode == 0, output
    assert REFUSAL not in output
    assert f"{venv} is not a symlink to an install in {venv}.d, so nothing was removed" in output, output
    assert "changed=0" in recap(result), recap(result)


@pytest.mark.parametrize("path", ["opt/vllm/venv", "/opt/vllm/venv/"])
def test_a_role_that_includes_python_venv_with_a_bad_path_is_refused_before_any_change(tmp_path, path):
    result, output = run(stand_in_caller(tmp_path), "prune", python_venv_path=path, python_venv_keep_previous=1)
    assert result.returncode != 0, output
    assert REFUSAL not in output
    assert (f"python_venv_path must be an absolute path without a trailing slash (is '{path}'); its installs go "
            "into the directory beside it with .d appended.") in output, output
    assert "changed=0" in recap(result) and "failed=1" in recap(result), recap(result)
