"""The client keys, the front's TLS certificate and key and the fallback endpoints' keys take effect by nginx's
graceful reload (docs/key-rotation.md): the tasks that write them notify `Reload nginx` and nothing that restarts
nginx or the router replicas. A restart of nginx drops every open stream; molecule's day-2 run checks the reload
under load for the client keys and the certificate (nginx's master PID unchanged, no failed request). The fallback
keys have no rotation under load in molecule (the front gets its fallbacks in that same run), so this is their
test that the same mechanism applies."""

from __future__ import annotations

import yaml
from monitoring_support import REPO

CONFIGURE = REPO / "roles" / "vllm_router" / "tasks" / "configure.yml"
HANDLERS = REPO / "roles" / "vllm_router" / "handlers" / "main.yml"
# What each rotation writes: a part of the task's destination (dest, path, or a file entry of config_files).
ROTATED = {
    "client keys": "_vllm_router_nginx_keys",
    "TLS certificate": "/cert.pem",
    "TLS key": "/key.pem",
    "fallback keys": "_vllm_router_nginx_fallback_key_prefix",
}


def _tasks(tasks: list[dict]) -> list[dict]:
    out = []
    for task in tasks:
        out.append(task)
        for section in ("block", "rescue", "always"):
            out.extend(_tasks(task.get(section, [])))
    return out


def _writes(task: dict) -> str:
    """Everything the task names as a destination, as one string to search."""
    module = next((value for key, value in task.items() if key.startswith(("ansible.builtin.", "inferops.vllm."))),
                  {})
    if not isinstance(module, dict):
        return ""
    parts = [str(module.get("dest", "")), str(module.get("path", ""))]
    files = module.get("files", [])
    if isinstance(files, str):  # config_files' entries built by a template: the paths are in its text
        parts.append(files)
    else:
        parts += [str(entry.get("path", "")) for entry in files if isinstance(entry, dict)]
    return " ".join(parts)


def test_each_rotated_file_is_written_by_a_task_that_notifies_the_reload_only():
    tasks = _tasks(yaml.safe_load(CONFIGURE.read_text()))
    for what, marker in ROTATED.items():
        writers = [task for task in tasks if marker in _writes(task)]
        assert writers, f"{what}: no task of configure.yml writes it ({marker}); update this test"
        for task in writers:
            notify = task.get("notify")
            notify = [notify] if isinstance(notify, str) else list(notify or [])
            assert notify == ["Reload nginx"], f"{what}: task '{task['name']}' notifies {notify}"


def test_the_reload_handler_reloads_nginx_and_restarts_nothing():
    handlers = {handler["name"]: handler for handler in yaml.safe_load(HANDLERS.read_text())}
    reload_nginx = handlers["Reload nginx"]
    assert reload_nginx["ansible.builtin.systemd_service"] == {"name": "nginx.service", "state": "reloaded"}
    assert "listen" not in reload_nginx and "notify" not in reload_nginx
