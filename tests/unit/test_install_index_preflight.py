"""vllm_install's preflight refuses bad package index settings before any host changes.

The rules are the PD preflight's `install` rules (plugins/plugin_utils/_preflight.py), which the role runs through
inferops.vllm.install_problems on its published record; tests/preflight/install_* run them in playbooks/preflight.yml.

The real ansible-playbook runs the role's preflight entry point (the one deploy_pd.yml runs on every host
before its first change) once, on one inventory host per case, each this machine (connection local) with the
case's settings. Each bad setting fails its host with a message naming the host and the variable, and never
the password; good settings pass.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from test_preflight_inventories import ANSIBLE_PLAYBOOK, REPO, playbook_env

PLAYBOOK = """\
- name: Run vllm_install's preflight on the controller
  hosts: all
  gather_facts: true
  gather_subset:
    - min
  tasks:
    - name: Check the vLLM install settings
      ansible.builtin.include_role:
        name: inferops.vllm.vllm_install
        tasks_from: preflight
"""

SECRET = "Sup3rSecretIndexPassw0rd"  # noqa: S105 - a test credential
HTTPS = {"vllm_install_source": "index", "vllm_install_index_url": "https://pypi.internal.example/simple"}
CASES = {
    "https_with_credentials": ({**HTTPS, "vllm_install_index_username": "deploy",
                                "vllm_install_index_password": SECRET}, None),
    "pypi_default": ({"vllm_install_source": "index"}, None),
    "credentials_in_url": (
        {"vllm_install_source": "index", "vllm_install_index_url": f"https://deploy:{SECRET}@pypi.internal.example/simple"},
        "[install] credentials_in_url: vllm_install_index_url, vllm_install_extra_index_urls: must be http:// or "
        "https:// URLs of a simple API without credentials in them",
    ),
    "credentials_in_extra_url": (
        {**HTTPS, "vllm_install_extra_index_urls": [f"https://u:{SECRET}@mirror.example/simple"]},
        "not: https://<credentials>@mirror.example/simple.",
    ),
    "not_a_url": ({**HTTPS, "vllm_install_extra_index_urls": ["pypi.internal.example/simple"]},
                  "not: pypi.internal.example/simple."),
    "user_without_password": ({**HTTPS, "vllm_install_index_username": "deploy"},
                              "vllm_install_index_username, vllm_install_index_password: must be set together"),
    "password_over_http": (
        {"vllm_install_source": "index", "vllm_install_index_url": "http://10.0.0.5:3141/simple",
         "vllm_install_index_username": "deploy", "vllm_install_index_password": SECRET},
        "plain http://, so the password would cross the network in clear",
    ),
    "password_over_http_allowed": (
        {"vllm_install_source": "index", "vllm_install_index_url": "http://10.0.0.5:3141/simple",
         "vllm_install_index_username": "deploy", "vllm_install_index_password": SECRET,
         "vllm_install_index_allow_plaintext": True}, None),
    "password_for_pypi": ({"vllm_install_source": "index", "vllm_install_index_username": "deploy",
                           "vllm_install_index_password": SECRET}, "empty (PyPI, which takes no password)"),
    "not_ascii": ({**HTTPS, "vllm_install_index_username": "deploy", "vllm_install_index_password": SECRET + "é"},
                  "must be printable ASCII"),
    "missing_ca_file": ({**HTTPS, "vllm_install_index_ca_file": "/nonexistent/ca.pem"},
                        "vllm_install_index_ca_file: is '/nonexistent/ca.pem', not a PEM file of certificates"),
    "wheelhouse_ignores_index_settings": (
        {"vllm_install_source": "wheelhouse", "vllm_install_wheelhouse_dir": "/", "vllm_install_index_url": "nonsense"},
        "vllm_install_wheelhouse_dir: is '/', not a directory on the controller holding requirements.lock"),
}

pytestmark = pytest.mark.skipif(ANSIBLE_PLAYBOOK is None, reason="ansible-playbook is not installed")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One run for all cases: each case is a host (connection local) with its settings as host variables, so
    facts are gathered once in parallel and each host fails or passes on its own."""
    tmp_path = tmp_path_factory.mktemp("index-preflight")
    playbook = tmp_path / "play.yml"
    playbook.write_text(PLAYBOOK)
    inventory = tmp_path / "hosts.json"
    inventory.write_text(json.dumps({"all": {"hosts": {
        name: {"ansible_connection": "local", "ansible_python_interpreter": sys.executable, **case[0]}
        for name, case in CASES.items()}}}))
    env = playbook_env(ANSIBLE_LOCALHOST_WARNING="0", ANSIBLE_FORKS=str(len(CASES)))
    result = subprocess.run([ANSIBLE_PLAYBOOK, "-i", str(inventory), str(playbook), "-v"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    return " ".join((result.stdout + result.stderr).split())


@pytest.mark.parametrize("case", sorted(CASES))
def test_index_settings_are_checked_before_any_change(run, case):
    expected = CASES[case][1]
    assert SECRET not in run.replace(f"{SECRET}é", ""), "the password was shown"
    recap = re.search(rf"{case}\s*: ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", run)
    assert recap, run
    assert recap.group(2) == "0", run
    if expected is None:
        assert recap.group(4) == "0", run
        return
    assert recap.group(4) == "1", run
    assert re.search(rf"fatal: \[{case}\]: FAILED! => .*?{case}: [^*]*?{re.escape(expected)}", run), run
