"""Unit tests for plugins/modules/nixl_progress_delay.py, on a stand-in NIXL file in a temporary venv
layout (the real file's checksum is checked on real hosts by the molecule scenario, where the module
runs against the pinned NIXL and the instances' idle CPU shows the delay took effect)."""

from __future__ import annotations

import hashlib

import pytest
from ansible.module_utils import basic
from ansible_collections.inferops.vllm.plugins.modules import nixl_progress_delay
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import (
    assert_no_globals_besides_documentation,
    run_module,
)
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import exit_json as _exit_json
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import fail_json as _fail_json

# A stand-in with the shape of nixl_agent.__init__ (not NIXL's code).
STAND_IN = """\
class nixl_agent:
    def __init__(self, agent_name, nixl_conf=None):
        agent_config = nixlBind.nixlAgentConfig()
        agent_config.useProgThread = nixl_conf.enable_pthread
        agent_config.pthrDelay = 0
        agent_config.lthrDelay = 100000
        self.agent = nixlBind.nixlAgent(agent_name, agent_config)
"""
PRISTINE_SHA = hashlib.sha256(STAND_IN.encode()).hexdigest()


def run(args=None, **kwargs):
    """nixl_progress_delay.main() with ``args``: what it exited (or, with expect="fail", failed) with."""
    return run_module(nixl_progress_delay.main, args, **kwargs)


@pytest.fixture(autouse=True)
def module_harness(monkeypatch):
    monkeypatch.setattr(basic.AnsibleModule, "exit_json", _exit_json)
    monkeypatch.setattr(basic.AnsibleModule, "fail_json", _fail_json)


@pytest.fixture()
def venv(tmp_path):
    api = tmp_path / "lib" / "python3.11" / "site-packages" / "nixl_cu12" / "_api.py"
    api.parent.mkdir(parents=True)
    api.write_text(STAND_IN)
    api.chmod(0o644)
    return tmp_path


def api_file(venv):
    return venv / "lib" / "python3.11" / "site-packages" / "nixl_cu12" / "_api.py"


def test_no_module_level_state():
    assert_no_globals_besides_documentation(nixl_progress_delay)


def test_sets_the_delay_then_changes_nothing(venv):
    args = {"venv": str(venv), "delay_us": 1000, "expected_sha256": [PRISTINE_SHA]}
    result = run(args, diff=True)
    assert result["changed"] is True
    text = api_file(venv).read_text()
    assert "agent_config.pthrDelay = 1000  # set by inferops.vllm" in text
    assert "agent_config.pthrDelay = 0" not in text
    # Only that line differs, and the file keeps its mode.
    assert [a for a, b in zip(text.splitlines(), STAND_IN.splitlines(), strict=True) if a != b] == [
        "        agent_config.pthrDelay = 1000  # set by inferops.vllm (vllm_install_nixl_progress_delay_us)"
    ]
    assert api_file(venv).stat().st_mode & 0o777 == 0o644
    assert result["files"] == [{"path": str(api_file(venv)), "before": "0", "after": "1000", "changed": True}]
    assert result["diff"][0]["before"] == STAND_IN and result["diff"][0]["after"] == text

    again = run(args, diff=True)
    assert again["changed"] is False and "diff" not in again
    assert api_file(venv).read_text() == text


def test_changes_a_delay_it_set_and_puts_nixls_line_back_with_zero(venv):
    run({"venv": str(venv), "delay_us": 1000, "expected_sha256": [PRISTINE_SHA]})
    result = run({"venv": str(venv), "delay_us": 250, "expected_sha256": [PRISTINE_SHA]})
    assert result["changed"] is True and result["files"][0]["before"] == "1000"
    assert "pthrDelay = 250  #" in api_file(venv).read_text()
    # 0 needs no checksum: the marked line is ours to put back.
    restored = run({"venv": str(venv), "delay_us": 0})
    assert restored["changed"] is True
    assert api_file(venv).read_text() == STAND_IN


def test_zero_leaves_nixls_own_file_alone_whatever_it_is(venv):
    api_file(venv).write_text(STAND_IN.replace("lthrDelay = 100000", "lthrDelay = 5"))
    result = run({"venv": str(venv), "delay_us": 0})
    assert result["changed"] is False
    assert "lthrDelay = 5" in api_file(venv).read_text()


def test_check_mode_changes_nothing_but_reports_the_change(venv):
    result = run({"venv": str(venv), "delay_us": 1000, "expected_sha256": [PRISTINE_SHA]},
                 check_mode=True, diff=True)
    assert result["changed"] is True and result["files"][0]["after"] == "1000"
    assert "pthrDelay = 1000" in result["diff"][0]["after"]
    assert api_file(venv).read_text() == STAND_IN


def test_refuses_a_file_that_is_not_the_pinned_release(venv):
    changed = STAND_IN.replace("lthrDelay = 100000", "lthrDelay = 200000")  # another NIXL release, say
    api_file(venv).write_text(changed)
    result = run({"venv": str(venv), "delay_us": 1000, "expected_sha256": [PRISTINE_SHA]}, expect="fail")
    assert str(api_file(venv)) in result["msg"]
    assert PRISTINE_SHA in result["msg"] and hashlib.sha256(changed.encode()).hexdigest() in result["msg"]
    assert "vllm_install_nixl_progress_delay_us: 0" in result["msg"]
    assert api_file(venv).read_text() == changed


def test_refuses_without_a_known_checksum(venv):
    result = run({"venv": str(venv), "delay_us": 1000}, expect="fail")
    assert "none given" in result["msg"]
    assert api_file(venv).read_text() == STAND_IN


@pytest.mark.parametrize("lines", [0, 2])
def test_refuses_a_file_without_exactly_one_delay_line(venv, lines):
    line = "        agent_config.pthrDelay = 0\n"
    text = STAND_IN.replace(line, line * lines)
    api_file(venv).write_text(text)
    result = run({"venv": str(venv), "delay_us": 1000, "expected_sha256": [PRISTINE_SHA]}, expect="fail")
    assert "expected exactly one line" in result["msg"]
    assert api_file(venv).read_text() == text


def test_no_nixl_in_the_venv(tmp_path):
    assert run({"venv": str(tmp_path), "delay_us": 0})["changed"] is False
    failed = run({"venv": str(tmp_path), "delay_us": 1000, "expected_sha256": [PRISTINE_SHA]}, expect="fail")
    assert "is NIXL installed" in failed["msg"]
    # A fresh host in check mode: the install has not run, the change is reported instead of failing.
    checked = run({"venv": str(tmp_path), "delay_us": 1000, "expected_sha256": [PRISTINE_SHA]}, check_mode=True)
    assert checked["changed"] is True and "after the install" in checked["msg"]


def test_refuses_a_negative_delay(venv):
    result = run({"venv": str(venv), "delay_us": -1, "expected_sha256": [PRISTINE_SHA]}, expect="fail")
    assert "0 or more" in result["msg"]
