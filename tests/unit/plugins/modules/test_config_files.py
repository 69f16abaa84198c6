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


def test_validate_checks_the_new_content_before_it_replaces_the_file(tmp_path):
    conf, log = tmp_path / "svc.conf", tmp_path / "validated"
    conf.write_text("ok old\n")
    # The command sees the temporary file (in the same directory), never the live one.
    check = f"sh -c 'grep -q ^ok \"$1\" && echo \"$1\" >> {log}' sh %s"
    result = run([{"path": str(conf), "content": "ok new\n", "validate": check}])
    assert result["changed"] is True and conf.read_text() == "ok new\n"
    (checked,) = log.read_text().splitlines()
    assert checked != str(conf) and os.path.dirname(checked) == str(tmp_path)
    # Unchanged content is not validated again; nor is anything in check mode.
    run([{"path": str(conf), "content": "ok new\n", "validate": check}])
    run([{"path": str(conf), "content": "ok newer\n", "validate": check}], check_mode=True)
    assert len(log.read_text().splitlines()) == 1


# A validate command that refuses a file whose first line does not start with "ok" (exit 3, a message on stderr).
REFUSE_WITHOUT_OK = "sh -c 'grep -q ^ok \"$1\" || { echo \"no ok in $1\" >&2; exit 3; }' sh %s"


def test_a_refused_file_fails_the_task_and_puts_back_what_it_had_changed(tmp_path):
    conf = tmp_path / "conf"
    conf.mkdir()
    changed, removed, site = conf / "changed.conf", conf / "removed.conf", conf / "site.conf"
    changed.write_text("before\n")
    os.chmod(changed, 0o640)
    removed.write_text("still here\n")
    site.write_text("ok live\n")
    files = [
        {"path": str(conf / "new-dir"), "state": "directory"},
        {"path": str(changed), "content": "after\n", "mode": "0644"},
        {"path": str(conf / "new.conf"), "secret_content": "a new secret\n"},
        {"path": str(removed), "state": "absent"},
        {"path": str(site), "content": "broken\n", "validate": REFUSE_WITHOUT_OK},
        {"path": str(conf / "after.conf"), "content": "never written\n"},
    ]
    result = run(files, expect="fail")
    assert result["rc"] == 3 and "no ok in" in result["stderr"]
    assert f"{site}: the new content failed validation" in result["msg"] and "exited 3" in result["msg"]
    assert "3 file(s) this task had changed put back" in result["msg"]
    # Each file as it was: content and mode, the new one gone, the removed one back; the new directory stays.
    assert changed.read_text() == "before\n" and mode(changed) == "0640"
    assert removed.read_text() == "still here\n" and site.read_text() == "ok live\n"
    assert sorted(p.name for p in conf.iterdir()) == ["changed.conf", "new-dir", "removed.conf", "site.conf"]


def test_a_secret_file_is_written_but_its_text_is_in_no_diff_and_masked(tmp_path, monkeypatch):
    key, conf = tmp_path / "key", tmp_path / "plain.conf"
    key.write_text("old-secret-value\n")
    masked = []

    def exit_and_record_masked(self, **kwargs):
        masked.extend(self.no_log_values)
        _exit_json(self, **kwargs)

    monkeypatch.setattr(basic.AnsibleModule, "exit_json", exit_and_record_masked)
    result = run([{"path": str(key), "secret_content": "new-secret-value\n", "secret": True, "mode": "0600"},
                  {"path": str(conf), "content": "plain\n"}], diff=True)
    assert key.read_text() == "new-secret-value\n" and mode(key) == "0600"
    secret_diff, plain_diff = result["diff"]
    assert "secret-value" not in str(secret_diff) and "not shown" in secret_diff["after"]
    assert plain_diff["after"] == "plain\n"
    assert "new-secret-value\n" in masked


@pytest.mark.parametrize("entry, message", [
    ({"path": "{tmp}/f", "content": "x", "validate": "true"}, "validate must contain %s"),
    ({"path": "{tmp}/f", "content": "x", "secret_content": "y"}, "not both"),
])
def test_refuses_a_validate_without_the_file_and_two_texts(tmp_path, entry, message):
    entry = {k: (v.format(tmp=tmp_path) if isinstance(v, str) else v) for k, v in entry.items()}
    result = run([{"path": str(tmp_path / "first"), "content": "x"}, entry], expect="fail")
    assert message in result["msg"]
    # Refused before anything is written.
    assert not (tmp_path / "first").exists()
