"""Which instances a change restarts (roles/vllm_instance), decided from the registered results of the tasks that
notify the handlers, by the real ansible-playbook on localhost.

tasks/configure.yml sets __vllm_instance_changed and __vllm_instance_running in the `always` of the block that
holds those tasks, and handlers/main.yml acts on them; neither reads a role var that evaluates registered results
whenever it happens to be used. Each host below is one case: its variables stand for what the tasks registered
(or did not, after a failure), and the play runs the role's own decision task and the handlers' own loops.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible_collections.inferops.vllm.tests.unit.test_instance_templates import flat

REPO = Path(__file__).resolve().parents[2]
ROLE = REPO / "roles" / "vllm_instance"
ANSIBLE_PLAYBOOK = str(Path(sys.executable).parent / "ansible-playbook")
pytestmark = pytest.mark.skipif(not Path(ANSIBLE_PLAYBOOK).is_file() and not shutil.which("ansible-playbook"),
                                reason="ansible-playbook is not installed")
INSTANCES = [{"name": "a"}, {"name": "b"}, {"name": "c"}]
ROLE_VARS = yaml.safe_load((ROLE / "vars" / "main.yml").read_text(encoding="utf-8"))


def files(*changed_keys: str) -> dict[str, Any]:
    """The registered result of the task that writes each instance's config.toml and environment file
    (inferops.vllm.config_files; an entry's key is its instance's name), in which the entries of ``changed_keys``
    changed (an instance's name: both of its files)."""
    entries = [(f"/etc/vllm/{inst['name']}.{ext}", inst["name"]) for ext in ("toml", "env") for inst in INSTANCES]
    results = [{"path": path, "key": key, "changed": key in changed_keys} for path, key in entries]
    return {"changed": bool(changed_keys), "results": results}


def units(unit: bool = False, dropins: tuple[str, ...] = ()) -> dict[str, Any]:
    """The registered result of the task that writes the unit (key unit) and each instance's stop-timeout drop-in."""
    results = [{"path": "/etc/systemd/system/vllm@.service", "key": "unit", "changed": unit}]
    for inst in INSTANCES:
        dropin = f"/etc/systemd/system/vllm@{inst['name']}.service.d"
        results += [{"path": dropin, "key": None, "changed": False},
                    {"path": f"{dropin}/inferops-stop-timeout.conf", "key": None, "changed": inst["name"] in dropins}]
    return {"changed": unit or bool(dropins), "results": results}


def launcher(*states: str) -> dict[str, Any]:
    """The launcher task's registered result (inferops.vllm.config_files) in which entries of ``states`` changed:
    its directories (the restart marks', the launcher's, the configuration's) and its four files."""
    entries = [("directory", "/var/lib/inferops-vllm/restart-pending"), ("directory", "/usr/local/lib/inferops-vllm"),
               *[("file", f"/usr/local/lib/inferops-vllm/{name}")
                 for name in ("launch.py", "schema.py", "vocab.py", "auth.py")],
               ("directory", "/etc/vllm")]
    results = [{"path": path, "state": state, "changed": state in states} for state, path in entries]
    return {"changed": bool(states), "results": results}


# host -> (registered results, instances running, (marked, restarted) with rolling, restarted with immediate)
CASES = {
    "nothing": ({"files": files()}, ["a", "b"], ([], []), []),
    "one-config": ({"files": files("b")}, ["a", "b"], (["b"], []), ["b"]),
    "two-instances": ({"files": files("a", "c")}, ["a"], (["a"], ["c"]), ["a", "c"]),
    "unit": ({"files": files(), "units": units(unit=True)}, ["a", "c"], (["a", "c"], ["b"]), ["a", "b", "c"]),
    # A stop timeout changed (a daemon-reload, handlers/main.yml): no instance restarts for it.
    "dropin": ({"files": files(), "units": units(dropins=("a",))}, ["a", "b"], ([], []), []),
    "launcher": ({"files": files(), "launcher": launcher("file")}, [], ([], ["a", "b", "c"]), ["a", "b", "c"]),
    # A directory of that task (mode or owner) changed, no file the instances run: nothing restarts.
    "launcher-directory": ({"files": files(), "launcher": launcher("directory")}, ["a"], ([], []), []),
    # The files' task failed (a config.toml the launcher refused: the module put back what it had written, and
    # registered no results; deploy_pd.yml forces the handlers): nothing restarts, the unit task never ran.
    "files-failed": ({"launcher": launcher(), "files": {"failed": True, "changed": False}, "units": None},
                     ["a", "b", "c"], ([], []), []),
    # The unit's task failed after the files changed: the config change made before it still restarts its instance.
    "failed-after-config": ({"launcher": launcher(), "files": files("c"), "units": {"failed": True, "changed": False}},
                            ["a", "b", "c"], (["c"], []), ["c"]),
}


def _host(registered: dict[str, Any], running: list[str]) -> dict[str, Any]:
    host = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
            "vllm_instance_instances": INSTANCES,
            # The role's own definition (a template over vllm_instance_instances).
            "_vllm_instance_units": ROLE_VARS["_vllm_instance_units"],
            # What tasks/host_state.yml registered: systemctl show's block per unit, in the instances' order.
            "__vllm_instance_host_state": {"systemd": "\n".join(
                f"Id=vllm@{i['name']}.service\nUnitFileState=enabled\n"
                f"ActiveState={'active' if i['name'] in running else 'inactive'}\n" for i in INSTANCES)},
            }
    names = {"launcher": "launcher_file", "files": "files", "units": "unit_files"}
    for key, name in names.items():
        value = registered.get(key, {"changed": False, "results": []} if key != "units" else units())
        if value is not None:  # None: the task did not run (a failure before it), so nothing was registered
            host[f"__vllm_instance_{name}"] = value
    return host


def playbook() -> list[dict[str, Any]]:
    tasks = flat(yaml.safe_load((ROLE / "tasks" / "configure.yml").read_text(encoding="utf-8")))
    (decide,) = [t for t in tasks if t.get("name") == "Decide which instances the changes restart"]
    handlers = yaml.safe_load((ROLE / "handlers" / "main.yml").read_text(encoding="utf-8"))
    loops = {h["name"]: h["loop"] for h in handlers if h.get("listen") == "Restart vllm instances"}
    mark = loops["Mark running instances for a rolling restart"]
    restart = loops["Restart the instances that do not run or roll"]
    mark, restart = mark.removeprefix("{{ ").removesuffix(" }}"), restart.removeprefix("{{ ").removesuffix(" }}")
    immediate = restart.replace("vllm_instance_restart_strategy", "'immediate'")
    return [{
        "name": "The role's restart decision on each case", "hosts": "all", "gather_facts": False,
        "tasks": [
            decide,
            {"name": "What the handlers would do", "ansible.builtin.set_fact": {
                "__rolling": "{{ {'mark': " + mark + ", 'restart': " + restart + "} }}",
                "__immediate": "{{ " + immediate + " }}"},
             "vars": {"vllm_instance_restart_strategy": "rolling"}},
            {"name": "Record", "ansible.builtin.copy": {
                "dest": "{{ out }}/{{ inventory_hostname }}.json", "mode": "0600",
                "content": "{{ {'rolling': __rolling, 'immediate': __immediate} | to_json }}"}},
        ],
    }]


@pytest.fixture(scope="module")
def decisions(tmp_path_factory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("restarts")
    inventory = {"all": {"hosts": {name: _host(registered, running) for name, (registered, running, _r, _i)
                                   in CASES.items()}}}
    (tmp / "hosts.yml").write_text(yaml.safe_dump(inventory), encoding="utf-8")
    (tmp / "play.yml").write_text(yaml.safe_dump(playbook(), sort_keys=False), encoding="utf-8")
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCALHOST_WARNING": "0", "ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.default"}
    playbook_bin = ANSIBLE_PLAYBOOK if Path(ANSIBLE_PLAYBOOK).is_file() else shutil.which("ansible-playbook")
    run = subprocess.run([playbook_bin, "-i", str(tmp / "hosts.yml"), "-e", json.dumps({"out": str(tmp)}),
                          str(tmp / "play.yml")], cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                         check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    return {name: json.loads((tmp / f"{name}.json").read_text(encoding="utf-8")) for name in CASES}


@pytest.mark.parametrize("case", CASES)
def test_the_handlers_restart_what_the_tasks_changed(decisions, case):
    _registered, _running, (marked, restarted), immediate = CASES[case]
    got = decisions[case]
    assert sorted(got["rolling"]["mark"]) == marked
    assert sorted(got["rolling"]["restart"]) == restarted
    assert sorted(got["immediate"]) == immediate


def test_no_role_var_reads_registered_results():
    variables = (ROLE / "vars" / "main.yml").read_text(encoding="utf-8")
    for registered in ("__vllm_instance_files", "__vllm_instance_unit_files", "__vllm_instance_launcher_file",
                       "__vllm_instance_host_state"):
        assert registered not in variables, registered
