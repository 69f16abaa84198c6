"""The instances' keys file through the role's own tasks (tasks/keys.yml, which configure.yml runs, and the
retire_keys entry point, which deploy_pd.yml runs last), with the real ansible-playbook on localhost and a
temporary config directory: a rotation accepts both keys, then the new one alone; a failed run's re-run finishes
it; the same rotation twice changes nothing; the file is private and no key reaches the output."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest
from test_preflight_inventories import ANSIBLE_PLAYBOOK, REPO, playbook_env

pytestmark = pytest.mark.skipif(ANSIBLE_PLAYBOOK is None, reason="ansible-playbook is not installed")

INCLUDE = """\
    - name: Run {entry}
      ansible.builtin.include_role:
        name: inferops.vllm.vllm_instance
        tasks_from: {entry}
"""
OLD = "oldKey0123456789abcdefghijklmnopqrstuvw"
NEW = "newKey0123456789abcdefghijklmnopqrstuvw"


def run(tmp_path, entry: str | tuple[str, ...], key: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """The role's entry point ``entry`` (or several, in order, in one run: as deploy_pd.yml runs keys, then
    retire_keys) on localhost with ``key``; what ansible-playbook printed, and the keys in the file."""
    entries = (entry,) if isinstance(entry, str) else entry
    playbook = tmp_path / "keys.yml"
    playbook.write_text("- name: The vllm_instance keys tasks on the controller\n  hosts: localhost\n"
                        "  connection: local\n  gather_facts: false\n  tasks:\n"
                        + "".join(INCLUDE.format(entry=name) for name in entries))
    extra = {"ansible_python_interpreter": sys.executable, "vllm_instance_api_key": key,
             "vllm_instance_config_dir": str(tmp_path), "vllm_install_group": str(os.getgid())}
    done = subprocess.run([ANSIBLE_PLAYBOOK, "-i", "localhost,", str(playbook), "-e", json.dumps(extra)],
                          cwd=REPO, env=playbook_env(ANSIBLE_LOCALHOST_WARNING="0"), capture_output=True, text=True,
                          timeout=180, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    for secret in (OLD, NEW):
        assert secret not in done.stdout + done.stderr
    keys_file = tmp_path / "api-keys"
    assert stat.S_IMODE(keys_file.stat().st_mode) == 0o640
    keys = [line for line in keys_file.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return done, keys


def changed(done: subprocess.CompletedProcess[str]) -> int:
    return int(done.stdout.split("changed=", 1)[1].split()[0])


def test_a_rotation_accepts_both_then_the_new_key_alone_and_a_rerun_finishes_it(tmp_path):
    done, keys = run(tmp_path, "keys", OLD)
    assert keys == [OLD] and changed(done) == 1
    # A new key: accepted first, the old one still (the routers present it until their play).
    done, keys = run(tmp_path, "keys", NEW)
    assert keys == [NEW, OLD] and changed(done) == 1
    # The run failed before its last play: the re-run's instance play keeps both, changes nothing...
    done, keys = run(tmp_path, "keys", NEW)
    assert keys == [NEW, OLD] and changed(done) == 0
    # ...and its last play drops the old key, saying so.
    done, keys = run(tmp_path, "retire_keys", NEW)
    assert keys == [NEW] and changed(done) == 1
    said = " ".join(done.stdout.split())  # the YAML callback folds long messages
    assert "the instances accept vllm_instance_api_key only (the 1 key(s) of before the rotation are no longer " \
           "accepted)" in said, done.stdout
    # The same rotation run again changes nothing.
    for entry in ("keys", "retire_keys"):
        done, keys = run(tmp_path, entry, NEW)
        assert keys == [NEW] and changed(done) == 0, entry


def test_repeated_failed_rotations_keep_at_most_three_old_keys(tmp_path):
    for n in range(6):
        _done, keys = run(tmp_path, "keys", f"key{n}-0123456789abcdefghijklmnopqrstuvwxyz")
    assert keys[0].startswith("key5-") and len(keys) == 4, keys


def test_in_one_run_the_retirement_reads_and_writes_only_while_a_rotation_is_under_way(tmp_path):
    """deploy_pd.yml's last play re-reads and rewrites the keys file only when its instance play found a rotation
    under way: with the key alone in the file (every run but a rotation's), it makes no module run."""

    def one_run(key):
        done, keys = run(tmp_path, ("keys", "retire_keys"), key)
        return keys, done.stdout[done.stdout.index("TASK [Run retire_keys]"):]

    def result(retire, task):
        """What the retirement's task ``task`` reported (its block of the output up to the next task)."""
        return retire.split(f"TASK [inferops.vllm.vllm_instance : {task}]", 1)[1].split("TASK [", 1)[0]

    keys, retire = one_run(OLD)
    assert keys == [OLD]
    # No rotation: the retirement neither read nor wrote the file.
    assert "skipping: [localhost]" in result(retire, "Read the keys the instances accept now")
    assert "skipping: [localhost]" in result(retire, "Accept vllm_instance_api_key alone")
    # A rotation: the instance play accepts both, and the same run's retirement reads the file and drops the old key.
    keys, retire = one_run(NEW)
    assert keys == [NEW]
    assert "ok: [localhost]" in result(retire, "Read the keys the instances accept now")
    assert "changed: [localhost]" in result(retire, "Accept vllm_instance_api_key alone")
