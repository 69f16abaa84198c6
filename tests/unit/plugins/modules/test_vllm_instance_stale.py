"""Unit tests for plugins/modules/vllm_instance_stale.py: real files and their modification times in a temporary
directory, systemctl behind a patched run_command (the start time of each unit's main process, on the monotonic
clock as systemd gives it)."""

from __future__ import annotations

import os
import time

import pytest
from ansible.module_utils import basic
from ansible_collections.inferops.vllm.plugins.modules import vllm_instance_stale
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import (
    assert_documented_as_specified,
    assert_no_globals_besides_documentation,
    run_module,
)
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import exit_json as _exit_json
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import fail_json as _fail_json


class Units(dict):
    """unit -> seconds ago its main process started (None: not active); ``disabled``: the units not enabled."""

    def __init__(self):
        super().__init__()
        self.disabled: set[str] = set()


@pytest.fixture()
def units(monkeypatch):
    """What systemctl show says of each unit (Units)."""
    started = Units()
    monkeypatch.setattr(basic.AnsibleModule, "exit_json", _exit_json)
    monkeypatch.setattr(basic.AnsibleModule, "fail_json", _fail_json)

    def run_command(_module, args, **_kwargs):
        assert args[:2] == ["systemctl", "show"] and "UnitFileState" in args, args
        ago = started.get(args[-1])
        enabled = "disabled" if args[-1] in started.disabled else "enabled"
        if ago is None:
            return 0, f"ActiveState=inactive\nUnitFileState={enabled}\nExecMainStartTimestampMonotonic=0\n", ""
        return 0, (f"ActiveState=active\nUnitFileState={enabled}\n"
                   f"ExecMainStartTimestampMonotonic={int((time.monotonic() - ago) * 1e6)}\n"), ""

    monkeypatch.setattr(basic.AnsibleModule, "run_command", run_command)
    return started


def touch(path, ago: float) -> str:
    """A file last modified `ago` seconds ago."""
    path.write_text("x\n")
    when = time.time() - ago
    os.utime(path, (when, when))
    return str(path)


@pytest.fixture()
def host(tmp_path):
    pending = tmp_path / "pending"
    pending.mkdir()
    files = {name: touch(tmp_path / name, 3600) for name in ("d0.toml", "d0.env", "d1.toml", "unit", "launcher")}
    return tmp_path, pending, files


def args(files, pending, **kw):
    base = {"instances": [{"name": "d0", "files": [files["d0.toml"], files["d0.env"]]},
                          {"name": "d1", "files": [files["d1.toml"], "/nonexistent/d1.env"]}],
            "common_files": [files["unit"], files["launcher"]], "pending_dir": str(pending)}
    return {**base, **kw}


def test_instances_started_after_their_files_changed_are_not_stale(units, host):
    _tmp, pending, files = host
    units.update({"vllm@d0.service": 60, "vllm@d1.service": 60})
    out = run_module(vllm_instance_stale.main, args(files, pending))
    assert (out["changed"], out["stale"], out["marked"]) == (False, [], [])
    assert [i["newer"] for i in out["instances"]] == [[], []]
    assert os.listdir(pending) == []


def test_an_instance_whose_config_changed_after_it_started_is_marked_once(units, host):
    """The interrupted run: d0's config.toml was rewritten after d0 started, and no handler marked it."""
    tmp, pending, files = host
    units.update({"vllm@d0.service": 600, "vllm@d1.service": 600})
    touch(tmp / "d0.toml", 30)
    out = run_module(vllm_instance_stale.main, args(files, pending))
    assert (out["changed"], out["stale"], out["marked"]) == (True, ["d0"], ["d0"])
    assert out["instances"][0]["newer"] == [files["d0.toml"]]
    assert os.listdir(pending) == ["d0"] and "d0.toml" in (pending / "d0").read_text()
    again = run_module(vllm_instance_stale.main, args(files, pending))
    assert (again["changed"], again["stale"], again["marked"]) == (False, ["d0"], [])


def test_a_common_file_makes_every_running_instance_stale_and_stopped_ones_are_left_alone(units, host):
    tmp, pending, files = host
    units.update({"vllm@d0.service": 600})  # d1 is not active: it starts with the new files anyway
    touch(tmp / "launcher", 30)
    out = run_module(vllm_instance_stale.main, args(files, pending))
    assert (out["stale"], out["marked"]) == (["d0"], ["d0"])
    assert [i["name"] for i in out["instances"]] == ["d0"]


def test_check_mode_and_no_pending_dir_write_nothing(units, host):
    tmp, pending, files = host
    units.update({"vllm@d0.service": 600, "vllm@d1.service": 600})
    touch(tmp / "d1.toml", 30)
    checked = run_module(vllm_instance_stale.main, args(files, pending), check_mode=True)
    assert (checked["changed"], checked["stale"], checked["marked"]) == (True, ["d1"], ["d1"])
    found = run_module(vllm_instance_stale.main, args(files, pending, pending_dir=""))
    assert (found["changed"], found["stale"], found["marked"]) == (False, ["d1"], [])
    assert os.listdir(pending) == []


def test_a_mark_to_write_without_its_directory_fails_and_names_the_instance(units, host):
    tmp, pending, files = host
    units.update({"vllm@d0.service": 600})
    touch(tmp / "d0.env", 30)
    out = run_module(vllm_instance_stale.main, args(files, pending, pending_dir=str(tmp / "missing")),
                     expect="fail")
    assert "d0 is stale" in out["msg"] and "does not exist" in out["msg"]


def test_documentation_matches_argument_spec():
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load(vllm_instance_stale.DOCUMENTATION)
    assert_documented_as_specified(doc["options"], vllm_instance_stale.argument_spec())


def test_no_module_level_state():
    assert_no_globals_besides_documentation(vllm_instance_stale)


def test_the_instances_not_enabled_and_active_are_returned_to_start(units, host):
    """The role enables and starts only these: d1 does not run, d2 runs but is not enabled, d0 runs enabled."""
    _tmp, pending, files = host
    units.disabled.add("vllm@d2.service")
    units.update({"vllm@d0.service": 60, "vllm@d2.service": 60})
    base = args(files, pending)
    out = run_module(vllm_instance_stale.main, {**base, "instances": [*base["instances"], {"name": "d2"}]})
    assert out["not_started"] == ["d1", "d2"]
    units.update({"vllm@d1.service": 60})
    units.disabled.clear()
    out = run_module(vllm_instance_stale.main, {**base, "instances": [*base["instances"], {"name": "d2"}]})
    assert out["not_started"] == []


def test_the_marks_are_listed_after_its_own_are_written_and_only_with_a_marks_dir(units, host):
    """What the role says waits for a rolling restart: an earlier run's mark (d1, a stopped instance here), the one
    this run writes (d0), not a mark still being written; nothing in check mode beyond what is there, nothing
    without marks_dir, none in a directory that does not exist."""
    tmp, pending, files = host
    units.update({"vllm@d0.service": 600})
    (pending / "d1").write_text("an earlier run's mark\n")
    (pending / "d2.tmp").write_text("half written\n")
    touch(tmp / "d0.toml", 30)
    checked = run_module(vllm_instance_stale.main, args(files, pending, marks_dir=str(pending)), check_mode=True)
    assert checked["pending"] == ["d1"]
    assert run_module(vllm_instance_stale.main, args(files, pending, pending_dir=""))["pending"] == []
    out = run_module(vllm_instance_stale.main, args(files, pending, marks_dir=str(pending)))
    assert out["marked"] == ["d0"] and out["pending"] == ["d0", "d1"]
    # Immediate restarts write no mark, and still list what an earlier run left.
    assert run_module(vllm_instance_stale.main, args(files, pending, pending_dir="",
                                                     marks_dir=str(pending)))["pending"] == ["d0", "d1"]
    assert run_module(vllm_instance_stale.main, args(files, pending, marks_dir=str(tmp / "missing")))["pending"] == []
