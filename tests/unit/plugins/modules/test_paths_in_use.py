"""Unit tests for plugins/modules/paths_in_use.py against real processes of this machine: what each kind of use
(working directory, command line, mapped file, open file) looks like in /proc, a directory given through a
symlink, a deleted file still mapped, and the unit read from /proc/PID/cgroup (cgroup v1 and v2 lines). The
prune that calls it is tested in test_python_venv_versions.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
from ansible.module_utils import basic
from ansible_collections.inferops.vllm.plugins.modules import paths_in_use
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import (
    assert_documented_as_specified,
    assert_no_globals_besides_documentation,
    run_module,
)
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import exit_json as _exit_json
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import fail_json as _fail_json

HOLD = """
import mmap, os, sys, time
kind, path = sys.argv[1], os.environ["TARGET"]
if kind == "open":
    held = open(path, "rb")
elif kind == "map":
    with open(path, "rb") as f:
        held = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    if os.environ.get("UNLINK"):
        os.unlink(path)
print("ready", flush=True)
time.sleep(120)
"""


@pytest.fixture(autouse=True)
def patched(monkeypatch):
    monkeypatch.setattr(basic.AnsibleModule, "exit_json", _exit_json)
    monkeypatch.setattr(basic.AnsibleModule, "fail_json", _fail_json)


@pytest.fixture()
def holders():
    started = []

    def start(kind, target, cwd, **env):
        process = subprocess.Popen([sys.executable, "-c", HOLD, kind], cwd=cwd, stdout=subprocess.PIPE, text=True,
                                   env={"TARGET": str(target), "PATH": "/usr/bin:/bin", **env})
        started.append(process)
        assert process.stdout.readline() == "ready\n"
        return process

    yield start
    for process in started:
        process.kill()
        process.wait()


def uses(result, path):
    return {p["pid"]: p["how"] for d in result["in_use"] if d["path"] == str(path) for p in d["processes"]}


def test_each_kind_of_use_is_found_and_unused_directories_are_not(tmp_path, holders):
    dirs = {name: tmp_path / name for name in ("cwd", "open", "map", "deleted", "unused")}
    for directory in dirs.values():
        directory.mkdir()
        (directory / "lib.so").write_bytes(b"\0" * 4096)
    by_cwd = holders("none", "-", dirs["cwd"])
    by_open = holders("open", dirs["open"] / "lib.so", tmp_path)
    by_map = holders("map", dirs["map"] / "lib.so", tmp_path)
    by_deleted = holders("map", dirs["deleted"] / "lib.so", tmp_path, UNLINK="1")
    result = run_module(paths_in_use.main, {"paths": [str(d) for d in dirs.values()]}, check_mode=True)
    assert result["changed"] is False
    assert [d["path"] for d in result["in_use"]] == [str(dirs[n]) for n in ("cwd", "open", "map", "deleted")]
    assert uses(result, dirs["cwd"]) == {by_cwd.pid: f"working directory {dirs['cwd']}"}
    assert uses(result, dirs["open"]) == {by_open.pid: f"open file {dirs['open']}/lib.so"}
    assert uses(result, dirs["map"]) == {by_map.pid: f"maps {dirs['map']}/lib.so"}
    assert uses(result, dirs["deleted"]) == {by_deleted.pid: f"maps {dirs['deleted']}/lib.so"}
    process = next(p for d in result["in_use"] for p in d["processes"] if p["pid"] == by_map.pid)
    assert process["name"] == "python3" or process["name"].startswith("python"), process


def test_a_command_line_and_a_directory_given_through_a_symlink(tmp_path, holders):
    real = tmp_path / "real" / "v1"
    (real / "bin").mkdir(parents=True)
    (real / "bin" / "python3").symlink_to(sys.executable)  # a venv's python: the executable resolves elsewhere
    (tmp_path / "link").symlink_to(tmp_path / "real")
    process = subprocess.Popen([str(real / "bin" / "python3"), "-c", "import time; time.sleep(120)"], cwd=tmp_path)
    holder = holders("none", "-", real)  # /proc shows the resolved path of its working directory
    try:
        given = tmp_path / "link" / "v1"
        result = run_module(paths_in_use.main, {"paths": [f"{given}/"]})
        assert uses(result, given) == {process.pid: f"command line {real}/bin/python3",
                                       holder.pid: f"working directory {real}"}
    finally:
        process.kill()
        process.wait()


def test_nothing_in_use_and_missing_directories(tmp_path):
    result = run_module(paths_in_use.main, {"paths": [str(tmp_path / "absent"), str(tmp_path)]})
    assert result["in_use"] == [], result  # a fresh directory no process has entered or opened
    assert run_module(paths_in_use.main, {"paths": [str(tmp_path / "absent")]})["in_use"] == []


@pytest.mark.parametrize(("cgroup", "unit"), [
    ("0::/system.slice/system-vllm.slice/vllm@decode-0.service\n", "vllm@decode-0.service"),
    ("10:hugetlb:/libpod_parent/libpod-d341\n9:name=systemd:/libpod_parent/libpod-d341/system.slice/"
     "system-vllm.slice/vllm@decode-0.service\n8:pids:/libpod_parent/libpod-d341\n", "vllm@decode-0.service"),
    ("9:name=systemd:/libpod_parent/libpod-d341\n", ""),
    ("0::/user.slice/user-0.slice/session-3.scope\n", "session-3.scope"),
    ("", ""),
])
def test_the_unit_comes_from_systemds_hierarchy(monkeypatch, cgroup, unit):
    monkeypatch.setattr(paths_in_use, "_read", lambda path: cgroup)
    assert paths_in_use._unit("1") == unit


def test_a_relative_path_is_refused():
    failed = run_module(paths_in_use.main, {"paths": ["opt/vllm/venv.d/x"]}, expect="fail")
    assert "is not an absolute path" in failed["msg"]


def test_documented_as_specified():
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load(paths_in_use.DOCUMENTATION)
    assert_documented_as_specified(doc["options"], paths_in_use.argument_spec())


def test_no_module_level_state():
    assert_no_globals_besides_documentation(paths_in_use)
