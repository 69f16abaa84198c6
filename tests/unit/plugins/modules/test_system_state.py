"""Unit tests for plugins/modules/system_state.py: the module's main() with the commands it runs recorded and
answered (module args patched in, exit_json/fail_json turned into exceptions); its outputs go through the filters
the roles read them with (inferops.vllm.dpkg_missing, inferops.vllm.systemd_pending)."""

from __future__ import annotations

import pytest
import yaml
from ansible.module_utils import basic
from ansible_collections.inferops.vllm.plugins.filter.dpkg import dpkg_missing
from ansible_collections.inferops.vllm.plugins.filter.systemd import systemd_pending
from ansible_collections.inferops.vllm.plugins.modules import system_state
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import (
    assert_documented_as_specified,
    assert_no_globals_besides_documentation,
    captured_module_arguments,
    run_module,
)
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import exit_json as _exit_json
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import fail_json as _fail_json

DPKG = "nftables\tii \nprometheus\trc \n"
SYSTEMD = ("Id=inferops-vllm-firewall.service\nUnitFileState=enabled\nActiveState=active\n\n"
           "Id=prometheus.service\nUnitFileState=disabled\nActiveState=inactive\n")


@pytest.fixture(autouse=True)
def module_harness(monkeypatch):
    monkeypatch.setattr(basic.AnsibleModule, "exit_json", _exit_json)
    monkeypatch.setattr(basic.AnsibleModule, "fail_json", _fail_json)


@pytest.fixture()
def commands(monkeypatch):
    """The argv of each command the module runs; answers: {program: (rc, stdout, stderr)}."""
    ran, answers = [], {"dpkg-query": (1, DPKG, "dpkg-query: no packages found matching node-exporter"),
                        "systemctl": (0, SYSTEMD, "")}

    def run_command(self, args, **kwargs):  # pylint: disable=unused-argument
        ran.append(list(args))
        return answers[args[0]]

    monkeypatch.setattr(basic.AnsibleModule, "run_command", run_command)
    return ran, answers


def test_documentation_says_what_the_spec_does(monkeypatch):
    spec = captured_module_arguments(monkeypatch, system_state)
    assert spec["supports_check_mode"] is True
    assert_documented_as_specified(yaml.safe_load(system_state.DOCUMENTATION)["options"], spec["argument_spec"])
    assert_no_globals_besides_documentation(system_state)


def test_one_run_reads_both_for_the_roles_filters(commands):
    ran, _answers = commands
    packages = ["nftables", "prometheus", "node-exporter"]
    units = ["inferops-vllm-firewall.service", "prometheus.service"]
    result = run_module(system_state.main, {"packages": packages, "units": units}, check_mode=True)
    assert ran == [["dpkg-query", "--show", "--showformat=${Package}\t${db:Status-Abbrev}\n", "--", *packages],
                   ["systemctl", "show", "--property=Id,UnitFileState,ActiveState", "--", *units]]
    assert result["changed"] is False
    # A package removed but configured ("rc") and one dpkg does not know (rc 1) are missing.
    assert dpkg_missing(result["dpkg"], packages) == ["prometheus", "node-exporter"]
    assert systemd_pending(result["systemd"], units) == ["prometheus.service"]


def test_nothing_asked_runs_nothing(commands):
    ran, _answers = commands
    result = run_module(system_state.main, {"packages": [], "units": ["nginx.service"]})
    assert ran == [["systemctl", "show", "--property=Id,UnitFileState,ActiveState", "--", "nginx.service"]]
    assert result["dpkg"] == ""
    assert run_module(system_state.main, {}) == {"changed": False, "dpkg": "", "systemd": "", "exists": {},
                                                 "contents": {}, "matches": {}}
    assert len(ran) == 1


def test_a_failing_dpkg_fails_and_a_failing_systemctl_shows_every_unit_pending(commands):
    _ran, answers = commands
    answers["systemctl"] = (1, "", "System has not been booted with systemd")
    result = run_module(system_state.main, {"units": ["nginx.service"]})
    assert result["systemd"] == "" and systemd_pending(result["systemd"], ["nginx.service"]) == ["nginx.service"]
    answers["dpkg-query"] = (2, "", "dpkg-query: error: database locked")
    failed = run_module(system_state.main, {"packages": ["nftables"]}, expect="fail")
    assert failed["msg"] == "dpkg-query --show failed (rc 2): dpkg-query: error: database locked"


def test_paths_files_and_globs_are_read_in_the_same_run(commands, tmp_path):
    ran, _answers = commands
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "decode-0.toml").write_bytes(b"[server]\nport = 8200\n")
    (tmp_path / "conf" / "decode-1.toml").write_text("")
    (tmp_path / "conf" / ".hidden.toml").write_text("x")
    (tmp_path / "conf" / "decode-0.env").write_text("")
    (tmp_path / "link").symlink_to(tmp_path / "conf" / "decode-0.toml")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    conf = str(tmp_path / "conf")
    result = run_module(system_state.main, {
        "paths": [str(tmp_path / "link"), str(tmp_path / "dangling"), conf, str(tmp_path / "nowhere")],
        "files": [conf + "/decode-0.toml", conf + "/decode-1.toml", conf + "/missing.toml", conf],
        "globs": [conf + "/*.toml", str(tmp_path / "absent") + "/*.toml"]}, check_mode=True)
    assert ran == []
    assert result["changed"] is False
    assert result["exists"] == {str(tmp_path / "link"): True, str(tmp_path / "dangling"): False, conf: True,
                                str(tmp_path / "nowhere"): False}
    # Base64 as slurp returns it; a missing file and a directory are left out, an empty file is there.
    assert result["contents"] == {conf + "/decode-0.toml": "W3NlcnZlcl0KcG9ydCA9IDgyMDAK", conf + "/decode-1.toml": ""}
    # Sorted; the hidden file is not matched by *, a directory that does not exist matches nothing.
    assert result["matches"] == {conf + "/*.toml": [conf + "/decode-0.toml", conf + "/decode-1.toml"],
                                 str(tmp_path / "absent") + "/*.toml": []}


def test_an_unreadable_file_fails_with_its_path(commands, tmp_path, monkeypatch):
    path = tmp_path / "api-keys"
    path.write_text("k")

    def refuse(*_args, **_kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("builtins.open", refuse)
    failed = run_module(system_state.main, {"files": [str(path)]}, expect="fail")
    assert failed["msg"] == f"cannot read {path}: Permission denied"
