"""vllm_install's preflight refuses a bad vllm_install_nixl_progress_delay_us before any host changes.

The real ansible-playbook runs the role's preflight entry point (the one deploy_pd.yml runs on every
host before its first change) against localhost, with the value given as JSON extra vars so that its
type is kept. Each bad value must fail with a message naming the host, the variable and the fix.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_preflight_inventories import ANSIBLE_PLAYBOOK, REPO, playbook_env

PLAYBOOK = """\
- name: Run vllm_install's preflight on the controller
  hosts: localhost
  connection: local
  gather_facts: true
  tasks:
    - name: Check the vLLM install settings
      ansible.builtin.include_role:
        name: inferops.vllm.vllm_install
        tasks_from: preflight
"""

RANGE = "it must be a whole number of microseconds from 0 to 100000"
CASES = {
    "word": ({"vllm_install_nixl_progress_delay_us": "1ms"}, RANGE),
    "negative": ({"vllm_install_nixl_progress_delay_us": -5}, RANGE),
    "fraction": ({"vllm_install_nixl_progress_delay_us": 2.5}, RANGE),
    "too_long": ({"vllm_install_nixl_progress_delay_us": 200000}, RANGE),
    "unknown_nixl": (
        {"vllm_install_nixl_progress_delay_us": 1000, "vllm_install_nixl_version": "1.6.0"},
        "whose content is known for NIXL 1.5.1 only, and vllm_install_nixl_version is '1.6.0'. "
        "Fix: set vllm_install_nixl_progress_delay_us: 0",
    ),
    "zero_with_unknown_nixl": ({"vllm_install_nixl_progress_delay_us": 0, "vllm_install_nixl_version": "1.6.0"}, None),
    "cpu_default": ({"vllm_install_variant": "cpu"}, None),
    "cuda_default": ({}, None),
    # The NIXL core reservation line is changed in a known vLLM file only (roles/vllm_install vars), on the cpu variant.
    "unknown_vllm_cpu": (
        {"vllm_install_variant": "cpu", "vllm_install_version": "0.33.0"},
        "[install] localhost: vllm_install_nixl_honour_cpu_binding: is true, which changes one line of vLLM's NIXL "
        "worker "
        "(base_worker.py), whose content is known for vLLM 0.32.0 only, and vllm_install_version is '0.33.0'. "
        "Fix: set vllm_install_nixl_honour_cpu_binding: false",
    ),
    "unknown_vllm_cpu_not_honoured": (
        {"vllm_install_variant": "cpu", "vllm_install_version": "0.33.0",
         "vllm_install_nixl_honour_cpu_binding": False},
        None,
    ),
    "unknown_vllm_cuda": ({"vllm_install_version": "0.33.0"}, None),
}

pytestmark = pytest.mark.skipif(ANSIBLE_PLAYBOOK is None, reason="ansible-playbook is not installed")


def _run(tmp_path, name: str, extra: dict) -> subprocess.CompletedProcess[str]:
    playbook = tmp_path / f"{name}.yml"
    playbook.write_text(PLAYBOOK)
    env = playbook_env(ANSIBLE_LOCALHOST_WARNING="0", ANSIBLE_INVENTORY_UNPARSED_WARNING="0")
    return subprocess.run(
        [ANSIBLE_PLAYBOOK, "-i", "localhost,", str(playbook),
         "-e", json.dumps({"ansible_python_interpreter": sys.executable, **extra})],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180, check=False,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("nixl-delay")
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_run, tmp_path, name, case[0]) for name, case in CASES.items()}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_delay_is_checked_before_any_change(runs, case):
    run = runs[case]
    output = " ".join((run.stdout + run.stderr).split())
    expected = CASES[case][1]
    if expected is None:
        assert run.returncode == 0, output
        assert "changed=0" in output
        return
    assert run.returncode != 0, output
    if "honour_cpu_binding" not in expected:
        assert "[install] localhost: vllm_install_nixl_progress_delay_us: is" in output, output
    assert expected in output, output
