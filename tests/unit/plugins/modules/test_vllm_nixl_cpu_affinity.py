"""Unit tests for plugins/modules/vllm_nixl_cpu_affinity.py, on a stand-in of vLLM's NIXL worker file in a temporary
venv layout, and the changed line run for real in a child process (the pinned vLLM's checksum and the instances'
thread affinity are checked on real hosts by the molecule scenario)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap

import pytest
from ansible.module_utils import basic
from ansible_collections.inferops.vllm.plugins.modules import vllm_nixl_cpu_affinity as mod
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import (
    assert_no_globals_besides_documentation,
    run_module,
)
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import exit_json as _exit_json
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import fail_json as _fail_json

# A stand-in with the shape of the NixlConnector worker's __init__ (not vLLM's code).
STAND_IN = """\
class NixlConnectorWorker:
    def __init__(self, vllm_config):
        if self.device_type == "cpu":
            numa_core_list = current_platform.discover_numa_topology()
            rsv_cores_for_kv = [max(cores) for cores in numa_core_list]
            if rsv_cores_for_kv:
                os.sched_setaffinity(0, rsv_cores_for_kv)
        self.nixl_memory_type = "DRAM"
"""
PRISTINE_SHA = hashlib.sha256(STAND_IN.encode()).hexdigest()


def run(args=None, **kwargs):
    return run_module(mod.main, args, **kwargs)


@pytest.fixture(autouse=True)
def module_harness(monkeypatch):
    monkeypatch.setattr(basic.AnsibleModule, "exit_json", _exit_json)
    monkeypatch.setattr(basic.AnsibleModule, "fail_json", _fail_json)


def worker_file(venv):
    return venv / "lib" / "python3.11" / "site-packages" / mod.relative()


@pytest.fixture()
def venv(tmp_path):
    path = worker_file(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(STAND_IN)
    path.chmod(0o644)
    return tmp_path


def test_no_module_level_state():
    assert_no_globals_besides_documentation(mod)


def test_changes_the_one_line_then_nothing(venv):
    args = {"venv": str(venv), "honour_binding": True, "expected_sha256": [PRISTINE_SHA]}
    result = run(args, diff=True)
    assert result["changed"] is True
    text = worker_file(venv).read_text()
    changed = [(a, b) for a, b in zip(STAND_IN.splitlines(), text.splitlines(), strict=True) if a != b]
    indent = " " * 16
    assert changed == [(indent + "os.sched_setaffinity(0, rsv_cores_for_kv)", indent + mod.our_line())]
    assert worker_file(venv).stat().st_mode & 0o777 == 0o644
    assert result["files"] == [{"path": str(worker_file(venv)), "changed": True}]
    assert result["diff"][0]["before"] == STAND_IN and result["diff"][0]["after"] == text
    again = run(args, diff=True)
    assert again["changed"] is False and "diff" not in again and worker_file(venv).read_text() == text


def test_false_puts_vllms_line_back_without_a_checksum(venv):
    run({"venv": str(venv), "honour_binding": True, "expected_sha256": [PRISTINE_SHA]})
    restored = run({"venv": str(venv), "honour_binding": False})
    assert restored["changed"] is True and worker_file(venv).read_text() == STAND_IN
    assert run({"venv": str(venv), "honour_binding": False})["changed"] is False


def test_check_mode_reports_and_changes_nothing(venv):
    result = run({"venv": str(venv), "honour_binding": True, "expected_sha256": [PRISTINE_SHA]},
                 check_mode=True, diff=True)
    assert result["changed"] is True and "inferops.vllm" in result["diff"][0]["after"]
    assert worker_file(venv).read_text() == STAND_IN


def test_refuses_another_release(venv):
    other = STAND_IN.replace('"DRAM"', '"VRAM"')
    worker_file(venv).write_text(other)
    result = run({"venv": str(venv), "honour_binding": True, "expected_sha256": [PRISTINE_SHA]}, expect="fail")
    assert str(worker_file(venv)) in result["msg"] and PRISTINE_SHA in result["msg"]
    assert hashlib.sha256(other.encode()).hexdigest() in result["msg"]
    assert "vllm_install_nixl_honour_cpu_binding: false" in result["msg"]
    assert worker_file(venv).read_text() == other


@pytest.mark.parametrize("lines", [0, 2])
def test_refuses_a_file_without_exactly_one_line(venv, lines):
    line = "                os.sched_setaffinity(0, rsv_cores_for_kv)\n"
    text = STAND_IN.replace(line, line * lines)
    worker_file(venv).write_text(text)
    result = run({"venv": str(venv), "honour_binding": True, "expected_sha256": [PRISTINE_SHA]}, expect="fail")
    assert "expected exactly one line" in result["msg"] and worker_file(venv).read_text() == text


def test_no_vllm_in_the_venv(tmp_path):
    assert run({"venv": str(tmp_path), "honour_binding": False})["changed"] is False
    failed = run({"venv": str(tmp_path), "honour_binding": True, "expected_sha256": [PRISTINE_SHA]}, expect="fail")
    assert "is vLLM installed" in failed["msg"]
    checked = run({"venv": str(tmp_path), "honour_binding": True, "expected_sha256": [PRISTINE_SHA]},
                  check_mode=True)
    assert checked["changed"] is True and "after the install" in checked["msg"]


def _affinity_after(line, bound, reserved):
    """The affinity a child process's thread has after ``line`` ran with it bound to ``bound`` (as vLLM's OMP
    binding leaves the worker thread) and NIXL reserving ``reserved``."""
    code = textwrap.dedent(f"""
        import os
        os.sched_setaffinity(0, {sorted(bound)!r})
        rsv_cores_for_kv = {sorted(reserved)!r}
        {line.strip()}
        print(sorted(os.sched_getaffinity(0)))
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to bind a thread away from another")
def test_the_changed_line_keeps_an_instance_on_its_own_cores():
    first, last = min(os.sched_getaffinity(0)), max(os.sched_getaffinity(0))
    # vLLM's own line moves an instance bound to the first core onto the reserved (last) one: the reproduction.
    assert _affinity_after(mod.upstream_line(), {first}, {last}) == str([last])
    # Ours leaves it on its core, and keeps the reservation for an instance that owns the reserved core.
    assert _affinity_after(mod.our_line(), {first}, {last}) == str([first])
    assert _affinity_after(mod.our_line(), {first, last}, {last}) == str([last])
