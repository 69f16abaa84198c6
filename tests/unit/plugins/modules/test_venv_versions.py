"""Unit tests for plugins/modules/venv_versions.py: the module's main() on a temporary directory (module args
patched in, exit_json/fail_json turned into exceptions). The prune that uses it runs for real in
tests/unit/test_python_venv_versions.py and in molecule's upgrade test."""

from __future__ import annotations

import grp
import os
import pwd

import pytest
import yaml
from ansible.module_utils import basic
from ansible_collections.inferops.vllm.plugins.filter.dpkg import dpkg_missing
from ansible_collections.inferops.vllm.plugins.modules import venv_versions
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import (
    assert_documented_as_specified,
    assert_no_globals_besides_documentation,
    captured_module_arguments,
    run_module,
)
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import exit_json as _exit_json
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import fail_json as _fail_json


@pytest.fixture(autouse=True)
def module_harness(monkeypatch):
    monkeypatch.setattr(basic.AnsibleModule, "exit_json", _exit_json)
    monkeypatch.setattr(basic.AnsibleModule, "fail_json", _fail_json)


def versioned(tmp_path, names=("old", "live", "older")):
    """venv.d/<name> directories, modified in the order given (the first most recently), and a stray file."""
    versions = tmp_path / "venv.d"
    for age, name in enumerate(names):
        (versions / name).mkdir(parents=True)
        os.utime(versions / name, (1_000_000 - age * 100, 1_000_000 - age * 100))
    (versions / "stray-file").write_text("x")
    (versions / "link-to-live").symlink_to(versions / "live")
    return versions


def run(tmp_path, versions):
    return run_module(venv_versions.main, {"path": str(tmp_path / "venv"), "versions_dir": str(versions)})


def test_documentation_says_what_the_spec_does(monkeypatch):
    spec = captured_module_arguments(monkeypatch, venv_versions)
    assert spec["supports_check_mode"] is True
    assert_documented_as_specified(yaml.safe_load(venv_versions.DOCUMENTATION)["options"], spec["argument_spec"])
    assert_no_globals_besides_documentation(venv_versions)


def test_the_live_directory_is_found_by_any_spelling_and_the_directories_listed_newest_first(tmp_path):
    versions = versioned(tmp_path)
    # A relative target through a detour: the same directory all the same.
    (tmp_path / "venv").symlink_to("venv.d/../venv.d/live")
    result = run(tmp_path, versions)
    assert result["islnk"] is True and result["live"] == str(versions / "live")
    assert [d["path"] for d in result["dirs"]] == [str(versions / n) for n in ("old", "live", "older")]
    assert result["dirs"][0]["mtime"] == 1_000_000 and result["changed"] is False


@pytest.mark.parametrize("venv", ["plain directory", "link elsewhere", "dangling link", "missing"])
def test_no_live_directory_unless_the_link_points_into_the_versions(tmp_path, venv):
    versions = versioned(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if venv == "plain directory":
        (tmp_path / "venv").mkdir()
    elif venv == "link elsewhere":
        (tmp_path / "venv").symlink_to(elsewhere)
    elif venv == "dangling link":
        (tmp_path / "venv").symlink_to(versions / "gone")
    result = run(tmp_path, versions)
    assert result["islnk"] is (venv in ("link elsewhere", "dangling link"))
    assert result["live"] is None and len(result["dirs"]) == 3


def test_no_versions_directory_lists_nothing(tmp_path):
    result = run(tmp_path, tmp_path / "venv.d")
    assert (result["islnk"], result["live"], result["dirs"]) == (False, None, [])


def test_the_marker_is_read_in_the_same_run_and_missing_is_null(tmp_path):
    versions = versioned(tmp_path)
    (tmp_path / "venv").symlink_to(versions / "live")
    (versions / "live" / ".marker.json").write_text('{"packages": ["vllm==0.32.0"]}')
    args = {"path": str(tmp_path / "venv"), "versions_dir": str(versions)}
    found = run_module(venv_versions.main, {**args, "marker": str(versions / "live" / ".marker.json")})
    assert found["marker"] == '{"packages": ["vllm==0.32.0"]}' and found["live"] == str(versions / "live")
    missing = run_module(venv_versions.main, {**args, "marker": str(versions / "old" / ".marker.json")})
    assert missing["marker"] is None
    assert run(tmp_path, versions)["marker"] is None


def test_a_marker_that_cannot_be_read_fails(tmp_path):
    versions = versioned(tmp_path)
    failed = run_module(venv_versions.main, {"path": str(tmp_path / "venv"), "versions_dir": str(versions),
                                             "marker": str(versions / "live")}, expect="fail")
    assert failed["msg"].startswith(f"cannot read {versions / 'live'}: ")


def test_the_owner_is_the_links_own_and_null_without_a_link(tmp_path):
    versions = versioned(tmp_path)
    (tmp_path / "venv").symlink_to(versions / "live")
    info = os.lstat(tmp_path / "venv")
    assert run(tmp_path, versions)["owner"] == {"user": pwd.getpwuid(info.st_uid).pw_name,
                                                "group": grp.getgrgid(info.st_gid).gr_name}
    (tmp_path / "venv").unlink()
    (tmp_path / "venv").mkdir()
    assert run(tmp_path, versions)["owner"] is None


def test_the_packages_are_read_in_the_same_run_for_the_roles_filter(tmp_path, monkeypatch):
    """python_venv's system packages: dpkg-query's output for the filter dpkg_missing; nothing run without any."""
    ran = []

    def run_command(self, args, **kwargs):  # pylint: disable=unused-argument
        ran.append(list(args))
        return 1, "python3-venv\tii \nlibnuma1\trc \n", "dpkg-query: no packages found matching python3-packaging"

    monkeypatch.setattr(basic.AnsibleModule, "run_command", run_command)
    args = {"path": str(tmp_path / "venv"), "versions_dir": str(tmp_path / "venv.d")}
    assert run_module(venv_versions.main, args)["dpkg"] == "" and ran == []
    packages = ["python3-venv", "python3-packaging", "libnuma1"]
    result = run_module(venv_versions.main, {**args, "packages": packages}, check_mode=True)
    assert ran == [["dpkg-query", "--show", "--showformat=${Package}\t${db:Status-Abbrev}\n", "--", *packages]]
    # Removed but configured ("rc") and unknown to dpkg (rc 1) are both missing.
    assert dpkg_missing(result["dpkg"], packages) == ["python3-packaging", "libnuma1"]


def test_a_failing_dpkg_query_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(basic.AnsibleModule, "run_command", lambda self, args, **kw: (2, "", "database locked\n"))
    failed = run_module(venv_versions.main, {"path": str(tmp_path / "venv"), "versions_dir": str(tmp_path / "venv.d"),
                                             "packages": ["python3-venv"]}, expect="fail")
    assert failed["msg"] == "dpkg-query --show failed (rc 2): database locked"
