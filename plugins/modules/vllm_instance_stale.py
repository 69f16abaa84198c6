#!/usr/bin/python
# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: vllm_instance_stale
short_description: Find the running vLLM instances that started before their files last changed, and mark them
version_added: 0.1.0
description:
  - "Runs on the vLLM host. For each instance in O(instances) whose unit is active, it compares the time its main
    process started (systemd's C(ExecMainStartTimestampMonotonic)) with the modification time of the files it read
    when it started (O(instances[].files) and O(common_files)). An instance that started before one of them last
    changed runs with files it no longer has on disk: it is B(stale)."
  - With O(pending_dir), each stale instance gets a restart mark there (a file named after the instance, as the
    C(inferops.vllm.vllm_instance) role's handler writes it), unless it has one already.
    C(playbooks/rolling_restart.yml) rolls the marked instances.
  - Why it exists. The role's handler marks an instance when a task of the same run changed one of its files. A run
    stopped between that task and the handler (an interrupt, a lost connection, a failed host) leaves the new files
    and no mark, and the next run sees nothing to change. This module derives the mark from what each instance started
    with, so a later run still finds it.
  - An instance whose file was rewritten and then set back to its old content (an inventory change undone) counts as
    stale too, and is rolled once more. A restart too many is safe; one too few leaves an instance on old settings.
  - It also returns the instances whose unit is not both enabled and active (RV(not_started)), from the same
    C(systemctl show), so that the role enables and starts only those (a module run per instance otherwise), and
    with O(marks_dir) the restart marks there once its own are written (RV(pending)), so that the role says which
    instances wait for a rolling restart without listing the directory in another module run.
author:
  - inferops.vllm developers (@inferops)
extends_documentation_fragment:
  - inferops.vllm.attributes
attributes:
  check_mode:
    support: full
    details:
      - In check mode the stale instances are found and returned, and no mark is written.
  diff_mode:
    support: none
options:
  instances:
    description:
      - The vLLM instances of this host.
    type: list
    elements: dict
    required: true
    suboptions:
      name:
        description:
          - Name of the instance; its restart mark is O(pending_dir)/NAME.
        type: str
        required: true
      files:
        description:
          - The files of this instance only that its process reads when it starts (its config.toml and environment
            file, say). A file that does not exist is left out.
        type: list
        elements: path
        default: []
      unit:
        description:
          - The systemd unit that runs the instance.
          - Defaults to C(vllm@NAME.service), with NAME from O(instances[].name).
        type: str
  common_files:
    description:
      - Files every instance reads when it starts (the unit file, the launcher and what it imports).
    type: list
    elements: path
    default: []
  pending_dir:
    description:
      - Directory of the restart marks. Empty finds the stale instances and writes nothing.
      - Needed only when a mark is written; the module fails then when the directory does not exist.
    type: path
    default: ""
  marks_dir:
    description:
      - Directory whose restart marks are returned in RV(pending), read after the marks of O(pending_dir) are
        written (usually the same directory; given also when O(pending_dir) is empty, to list the marks an earlier
        run left). Empty lists nothing; a directory that does not exist holds no mark.
    type: path
    default: ""
notes:
  - Both times are read on the host's clocks. The start is systemd's C(CLOCK_MONOTONIC) time, turned into the
    wall clock of the files' modification times with the offset between the two clocks now. A step of the wall clock
    between the start and now (a large NTP correction) shifts the comparison by that step.
seealso:
  - module: inferops.vllm.vllm_instance_wait
"""

EXAMPLES = r"""
- name: Mark the running instances that started before their files last changed
  inferops.vllm.vllm_instance_stale:
    instances:
      - name: decode-0
        files: [/etc/vllm/decode-0.toml, /etc/vllm/decode-0.env]
    common_files: [/etc/systemd/system/vllm@.service, /opt/inferops-vllm/bin/inferops_vllm_launch.py]
    pending_dir: /var/lib/inferops-vllm/restart-pending
"""

RETURN = r"""
stale:
  description: The active instances that started before one of their files last changed, in O(instances) order.
  returned: always
  type: list
  elements: str
  sample: [decode-0]
marked:
  description: The stale instances this run gave a restart mark (those that had none).
  returned: always
  type: list
  elements: str
  sample: [decode-0]
not_started:
  description:
    - The instances whose unit systemd does not show as both enabled (C(UnitFileState=enabled)) and active
      (C(ActiveState=active)), in O(instances) order. An unknown unit, or a C(systemctl show) that fails, counts as
      not started.
  returned: always
  type: list
  elements: str
  sample: [decode-1]
pending:
  description:
    - The restart marks in O(marks_dir) (file names, that is instance names, sorted), including those this run wrote;
      in check mode those it would write are not among them. Empty without O(marks_dir).
  returned: always
  type: list
  elements: str
  sample: [decode-0]
instances:
  description: Per active instance, when it started and which of its files changed after that.
  returned: always
  type: list
  elements: dict
  sample:
    - name: decode-0
      started: "2026-12-02T07:10:03Z"
      newer: [/etc/vllm/decode-0.toml]
"""

import datetime  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402


def _unit_state(module: AnsibleModule, unit: str) -> tuple[float | None, bool]:
    """(the wall-clock time the unit's main process started, or None when the unit is not active; whether the unit
    is both enabled and active)."""
    rc, out, _err = module.run_command(["systemctl", "show", "-p", "ActiveState", "-p", "UnitFileState", "-p",
                                        "ExecMainStartTimestampMonotonic", unit])
    if rc != 0:
        return None, False
    values = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    running = values.get("ActiveState") == "active" and values.get("UnitFileState") == "enabled"
    monotonic_us = int(values.get("ExecMainStartTimestampMonotonic") or 0)
    if values.get("ActiveState") != "active" or not monotonic_us:
        return None, running
    return time.time() - time.monotonic() + monotonic_us / 1e6, running


def _newer(paths: list[str], started: float) -> list[str]:
    out = []
    for path in paths:
        try:
            if os.stat(path).st_mtime > started:
                out.append(path)
        except FileNotFoundError:
            continue
    return out


def argument_spec() -> dict:
    return dict(
        instances=dict(type="list", elements="dict", required=True, options=dict(
            name=dict(type="str", required=True),
            files=dict(type="list", elements="path", default=[]),
            unit=dict(type="str"),
        )),
        common_files=dict(type="list", elements="path", default=[]),
        pending_dir=dict(type="path", default=""),
        marks_dir=dict(type="path", default=""),
    )


def _marks(marks_dir: str) -> list[str]:
    """The names of the restart marks in ``marks_dir`` (regular files, not a mark being written), sorted."""
    if not marks_dir:
        return []
    try:
        entries = list(os.scandir(marks_dir))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(e.name for e in entries if e.is_file(follow_symlinks=False) and not e.name.endswith(".tmp"))


def main():
    module = AnsibleModule(argument_spec=argument_spec(), supports_check_mode=True)
    pending_dir = module.params["pending_dir"]
    stale, marked, report, not_started = [], [], [], []
    for instance in module.params["instances"]:
        name = instance["name"]
        started, running = _unit_state(module, instance["unit"] or f"vllm@{name}.service")
        if not running:
            not_started.append(name)
        if started is None:
            continue
        newer = _newer(list(instance["files"]) + list(module.params["common_files"]), started)
        report.append({"name": name, "newer": newer,
                       "started": datetime.datetime.fromtimestamp(started, datetime.timezone.utc)
                       .strftime("%Y-%m-%dT%H:%M:%SZ")})
        if not newer:
            continue
        stale.append(name)
        mark = os.path.join(pending_dir, name) if pending_dir else ""
        if not mark or os.path.exists(mark):
            continue
        marked.append(name)
        if not module.check_mode:
            if not os.path.isdir(pending_dir):
                module.fail_json(msg=f"{name} is stale ({', '.join(newer)} changed after it started), and the "
                                     f"directory of the restart marks, {pending_dir}, does not exist",
                                 stale=stale, marked=marked[:-1], instances=report, not_started=not_started)
            tmp = f"{mark}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(f"{name}: started before {', '.join(newer)} last changed (a run that changed them ended "
                        "before it marked the instance)\n")
            os.chmod(tmp, 0o644)
            os.replace(tmp, mark)
    module.exit_json(changed=bool(marked), stale=stale, marked=marked, instances=report, not_started=not_started,
                     pending=_marks(module.params["marks_dir"]))


if __name__ == "__main__":
    main()
