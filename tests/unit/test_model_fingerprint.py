"""inferops.vllm.model_fingerprint gives the value vllm_instance computed before it, with ansible.builtin.find
(delegated to the controller) and a set_fact over its result, so that a deployment upgraded to it neither copies
its model again nor restarts its instances for it. Both run here on the same tree, the old way through the real
ansible-playbook: files of several sizes and times, names that sort differently with and without case, a hidden
file (left out), a file inside a hidden directory (counted), symlinks (left out), a non-ASCII name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ansible_collections.inferops.vllm.plugins.filter.model import model_fingerprint
from test_preflight_inventories import ANSIBLE_PLAYBOOK, REPO, playbook_env

pytestmark = pytest.mark.skipif(ANSIBLE_PLAYBOOK is None, reason="ansible-playbook is not installed")

# The tasks of roles/vllm_instance/tasks/model_fingerprint.yml before the filter replaced them.
OLD_WAY = """
- hosts: localhost
  connection: local
  gather_facts: false
  tasks:
    - ansible.builtin.find:
        paths: "{{ src }}"
        recurse: true
        file_type: file
      register: files
    - ansible.builtin.set_fact:
        fingerprint: >-
          {{ (files.files | sort(attribute='path') | map(attribute='path') | map('relpath', src) | list)
             | zip(files.files | sort(attribute='path') | map(attribute='size') | list,
                   files.files | sort(attribute='path') | map(attribute='mtime') | map('int') | list)
             | list | to_json | hash('sha256') }}
    - ansible.builtin.debug:
        msg: "FINGERPRINT={{ fingerprint }}"
"""


def tree(root: Path) -> Path:
    model = root / "SmolLM2-135M-Instruct"
    for i, (name, size) in enumerate([("config.json", 700), ("model.safetensors", 5000), ("B-tokenizer.json", 90),
                                      ("a-vocab.txt", 12), ("sub/Z.bin", 3), ("sub/y.bin", 4), ("sub/deeper/x", 1),
                                      (".hidden/inside.json", 7), ("évaluation.md", 9)]):
        path = model / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * size)
        os.utime(path, (1_700_000_000.75 + i * 3.5, 1_700_000_000.75 + i * 3.5))
    (model / ".gitattributes").write_text("hidden\n")
    (model / "link-to-config.json").symlink_to(model / "config.json")
    (model / "link-to-sub").symlink_to(model / "sub")
    return model


def old_way(tmp_path: Path, src: Path) -> str:
    playbook = tmp_path / "old.yml"
    playbook.write_text(OLD_WAY)
    result = subprocess.run(
        [ANSIBLE_PLAYBOOK, "-i", "localhost,", str(playbook),
         "-e", json.dumps({"ansible_python_interpreter": sys.executable, "src": str(src)})],
        cwd=REPO, env=playbook_env(ANSIBLE_LOCALHOST_WARNING="0"), capture_output=True, text=True, timeout=180,
        check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.split("FINGERPRINT=", 1)[1][:64]


def test_the_filter_gives_what_find_and_the_sort_gave(tmp_path):
    model = tree(tmp_path)
    assert model_fingerprint(str(model)) == old_way(tmp_path, model)
    # A trailing slash is the same directory (the role strips it; relpath does too).
    assert model_fingerprint(str(model) + "/") == model_fingerprint(str(model))


def test_a_file_that_changes_size_or_time_changes_it_a_hidden_one_does_not(tmp_path):
    model = tree(tmp_path)
    before = model_fingerprint(str(model))
    (model / ".gitattributes").write_text("changed, still hidden\n")
    assert model_fingerprint(str(model)) == before
    os.utime(model / "config.json", (1_800_000_000, 1_800_000_000))
    touched = model_fingerprint(str(model))
    assert touched != before
    (model / "sub" / "Z.bin").write_bytes(b"yy")
    os.utime(model / "sub" / "Z.bin", (1_700_000_000.75 + 4 * 3.5, 1_700_000_000.75 + 4 * 3.5))
    assert model_fingerprint(str(model)) not in (before, touched)


def test_no_directory_lists_no_file_as_find_did(tmp_path):
    assert model_fingerprint(str(tmp_path / "missing")) == old_way(tmp_path, tmp_path / "missing")
