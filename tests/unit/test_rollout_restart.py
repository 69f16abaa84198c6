"""The rollout's restart of an instance (roles/vllm_rollout/tasks/instance.yml): it asks systemd to re-read the unit
only when systemd says the unit changed on disk, and tries a failed call again before the rollout stops there (a
busy host's systemd once answered a needless daemon-reload after D-Bus' 25 s, and the roll stopped; issue #24)."""

from __future__ import annotations

from pathlib import Path

import jinja2
import yaml
from ansible_collections.inferops.vllm.tests.unit.test_instance_templates import flat

TASKS = Path(__file__).resolve().parents[2] / "roles" / "vllm_rollout" / "tasks" / "instance.yml"


def _tasks() -> dict[str, dict]:
    return {t["name"].split(" {{")[0]: t for t in flat(yaml.safe_load(TASKS.read_text(encoding="utf-8")))}


def test_the_unit_is_re_read_only_when_systemd_says_it_changed():
    tasks = _tasks()
    check = tasks["Find whether systemd must re-read the unit of"]
    argv = check["ansible.builtin.command"]["argv"]
    assert argv[:2] == ["systemctl", "show"] and "--property=NeedDaemonReload" in argv and "--value" in argv
    assert argv[-1] == "vllm@{{ __inst.name }}.service"
    assert check["changed_when"] is False and check["check_mode"] is False
    restart = tasks["Restart the instance"]["ansible.builtin.systemd_service"]
    assert restart["name"] == argv[-1] and restart["state"] == "restarted"
    reload = jinja2.Environment().from_string(restart["daemon_reload"])
    register = check["register"]
    assert reload.render({register: {"stdout": "yes\n"}}) == "True"
    assert reload.render({register: {"stdout": "no\n"}}) == "False"


def test_a_failed_restart_is_tried_again_before_the_rollout_stops():
    restart = _tasks()["Restart the instance"]
    assert restart["retries"] >= 1 and restart["delay"] > 0
    assert restart["until"] == f"{restart['register']} is succeeded"
    # The order: the question, then the restart.
    names = list(_tasks())
    assert names.index("Find whether systemd must re-read the unit of") == names.index("Restart the instance") - 1
