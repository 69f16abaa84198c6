"""Unit tests for plugins/modules/config_files.py: the module's main() on a temporary directory (module args patched
in, exit_json/fail_json turned into exceptions), in normal, check and diff mode. The action plugin's rendering is
run by the real ansible-playbook in tests/unit/test_instance_templates.py and test_monitoring_config.py, and on
the sandbox and in molecule by every deploy (whose idempotence run proves the renders unchanged)."""

from __future__ import annotations

import os
import stat

import pytest
import yaml
from ansible.module_utils import basic
from ansible_collections.inferops.vllm.plugins.modules import config_files
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


def mode(path):
    return f"{stat.S_IMODE(os.stat(path).st_mode):04o}"


def run(files, **kwargs):
    return run_module(config_files.main, {"files": files}, **kwargs)


def test_documentation_says_what_the_spec_does(monkeypatch):
    spec = captured_module_arguments(monkeypatch, config_files)
    assert spec["supports_check_mode"] is True
    doc = yaml.safe_load(config_files.DOCUMENTATION)
    assert_documented_as_specified(doc["options"], spec["argument_spec"])
    assert_no_globals_besides_documentation(config_files)


def test_writes_directories_and_files_in_order_then_changes_nothing(tmp_path):
    conf = tmp_path / "etc" / "svc"
    files = [
        {"path": str(conf), "state": "directory", "mode": "0750"},
        {"path": str(conf / "a.env"), "content": "A=1\n", "mode": "0640", "key": "a"},
        {"path": str(conf / "b.env"), "content": "B=2\n", "mode": "0644", "key": "b"},
    ]
    first = run(files)
    assert first["changed"] is True
    assert first["changed_paths"] == [str(conf), str(conf / "a.env"), str(conf / "b.env")]
    assert [r["key"] for r in first["results"]] == [None, "a", "b"]
    assert (conf / "a.env").read_text() == "A=1\n" and (conf / "b.env").read_text() == "B=2\n"
    assert (mode(conf), mode(conf / "a.env"), mode(conf / "b.env")) == ("0750", "0640", "0644")
    # No temporary file is left beside them.
    assert sorted(p.name for p in conf.iterdir()) == ["a.env", "b.env"]
    second = run(files)
    assert second["changed"] is False and second["changed_paths"] == []
    assert not any(r["changed"] for r in second["results"])


def test_only_what_differs_changes_content_or_mode(tmp_path):
    a, b = tmp_path / "a.env", tmp_path / "b.env"
    a.write_text("A=1\n")
    b.write_text("B=2\n")
    os.chmod(a, 0o644)
    os.chmod(b, 0o600)
    result = run([{"path": str(a), "content": "A=1\n", "mode": "0644", "key": "a"},
                  {"path": str(b), "content": "B=2\n", "mode": "0640", "key": "b"}])
    assert [r["changed"] for r in result["results"]] == [False, True]
    assert mode(b) == "0640" and b.read_text() == "B=2\n"
    result = run([{"path": str(a), "content": "A=3\n", "mode": "0644"}])
    assert result["changed_paths"] == [str(a)] and a.read_text() == "A=3\n" and mode(a) == "0644"


def test_a_replaced_file_keeps_its_mode_when_none_is_given_and_a_new_one_is_private(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    old.write_text("x")
    os.chmod(old, 0o604)
    run([{"path": str(old), "content": "y"}, {"path": str(new), "content": "secret"}])
    assert old.read_text() == "y" and mode(old) == "0604"
    assert mode(new) == "0600"


def test_check_mode_reports_and_changes_nothing_even_where_the_directory_is_missing(tmp_path):
    present = tmp_path / "present"
    present.write_text("old\n")
    os.chmod(present, 0o644)
    files = [{"path": str(tmp_path / "d"), "state": "directory"},
             {"path": str(tmp_path / "d" / "f"), "content": "new\n"},
             {"path": str(present), "content": "new\n", "mode": "0644"}]
    result = run(files, check_mode=True)
    assert result["changed_paths"] == [str(tmp_path / "d"), str(tmp_path / "d" / "f"), str(present)]
    assert not (tmp_path / "d").exists() and present.read_text() == "old\n"


def test_diff_shows_content_and_mode_changes(tmp_path):
    f = tmp_path / "f"
    f.write_text("one\n")
    os.chmod(f, 0o600)
    result = run([{"path": str(f), "content": "two\n", "mode": "0600"}], check_mode=True, diff=True)
    (diff,) = result["diff"]
    assert (diff["before"], diff["after"], diff["after_header"]) == ("one\n", "two\n", str(f))
    result = run([{"path": str(f), "content": "one\n", "mode": "0644"}], diff=True)
    (diff,) = result["diff"]
    assert diff["before"]["mode"] == "0600" and diff["after"]["mode"] == "0644"
    assert run([{"path": str(f), "content": "one\n", "mode": "0644"}], diff=True)["diff"] == []


def test_absent_removes_files_and_links_and_is_quiet_when_gone(tmp_path):
    f, link = tmp_path / "f", tmp_path / "link"
    f.write_text("x")
    link.symlink_to(tmp_path / "nowhere")
    files = [{"path": str(f), "state": "absent"}, {"path": str(link), "state": "absent"}]
    assert run(files, check_mode=True)["changed_paths"] == [str(f), str(link)]
    assert f.exists()
    assert run(files)["changed_paths"] == [str(f), str(link)]
    assert not f.exists() and not os.path.lexists(link)
    assert run(files)["changed"] is False


@pytest.mark.parametrize("entry, message", [
    ({"path": "relative/file", "content": "x"}, "must be absolute"),
    ({"path": "{tmp}/file"}, "needs content, template or src"),
    ({"path": "{tmp}", "content": "x"}, "is a directory"),
    ({"path": "{tmp}/missing/file", "content": "x"}, "does not exist"),
    ({"path": "{tmp}", "state": "absent"}, "removes files only"),
    ({"path": "{tmp}/file-not-dir", "state": "directory"}, "is not a directory"),
])
def test_refuses_what_it_cannot_do_and_says_why(tmp_path, entry, message):
    (tmp_path / "file-not-dir").write_text("x")
    entry = {k: (v.format(tmp=tmp_path) if isinstance(v, str) else v) for k, v in entry.items()}
    result = run([entry], expect="fail")
    assert message in result["msg"]
