#!/usr/bin/python
# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: paths_in_use
short_description: Find the running processes that still use files under some directories
version_added: 0.3.0
description:
  - Reads C(/proc) on the host and returns, for each directory of O(paths), the processes that use something under
    it. A process uses a directory when its executable, its working directory, a file it maps (a shared library, a
    Python extension), a file it holds open, or one of its command-line arguments is under it.
  - "Why it exists: C(inferops.vllm.python_venv)'s prune removes old version directories of a venv. A process that
    still runs from one (an instance marked for a restart that has not rolled yet, a process started by hand) loses
    the files it has not opened yet, and fails later, at a lazy import, far from the cause. The prune keeps a
    directory this module finds in use, and says which process holds it."
  - The executable, the maps and the open files of a process of another user can be read only with
    C(CAP_SYS_PTRACE), which root has on a host and not in a default Podman or Docker container. For such a process
    only its command line is checked (vLLM's, as the launcher starts it, names its version directory's Python); the
    module returns those processes in RV(unreadable) so that the caller can say so.
author:
  - inferops.vllm developers (@inferops)
extends_documentation_fragment:
  - inferops.vllm.attributes
attributes:
  check_mode:
    support: full
    details:
      - It only reads; check mode returns the same result.
  diff_mode:
    support: none
options:
  paths:
    description:
      - Absolute paths of the directories. A path that does not exist is in use by no process.
    type: list
    elements: path
    required: true
notes:
  - "A pure-Python process started through a symlink to the directory (C(/opt/vllm/venv/bin/python), the venv's
    link) that maps no file from it is not seen: its command line names the link, not the directory. vLLM maps
    torch's libraries from its venv, and the launcher starts it through the resolved path."
"""

EXAMPLES = r"""
- name: Find the processes that still use the version directories to remove
  inferops.vllm.paths_in_use:
    paths:
      - /opt/vllm/venv.d/5199d581fff4
      - /opt/vllm/venv.d/legacy
  register: in_use
"""

RETURN = r"""
in_use:
  description: The directories of O(paths) that some process uses, in O(paths) order, each with those processes.
  returned: always
  type: list
  elements: dict
  contains:
    path:
      description: The directory, as given.
      type: str
    processes:
      description: The processes that use it.
      type: list
      elements: dict
      contains:
        pid:
          description: Process id.
          type: int
        name:
          description: The process's command name (C(/proc/PID/comm)).
          type: str
        unit:
          description: The systemd unit whose cgroup holds the process, or empty.
          type: str
        how:
          description: What is under the directory, for example C(maps /opt/vllm/venv.d/abc/lib/.../libtorch.so).
          type: str
  sample:
    - path: /opt/vllm/venv.d/5199d581fff4
      processes:
        - pid: 1134
          name: python3
          unit: vllm@decode-0.service
          how: command line /opt/vllm/venv.d/5199d581fff4/bin/python3
unreadable:
  description:
    - The processes whose executable, maps and open files could not be read (no C(CAP_SYS_PTRACE)); only their
      command lines were checked. C(pid), C(name) and C(unit) as in RV(in_use).
  returned: always
  type: list
  elements: dict
  sample:
    - pid: 879
      name: vllm::router
      unit: vllm-router@0.service
"""

import os  # noqa: E402
import re  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402


def _under(path: str, roots: list[tuple[str, list[str]]]) -> str | None:
    """The directory (as given) that ``path`` is in or equal to, or None."""
    for given, spellings in roots:
        for root in spellings:
            if path == root or path.startswith(root + "/"):
                return given
    return None


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _unit(pid: str) -> str:
    """The systemd unit of the process: the last unit in its path of systemd's hierarchy (cgroup v2's, or v1's
    name=systemd), or empty."""
    try:
        lines = [line.split(":", 2) for line in _read(f"/proc/{pid}/cgroup").splitlines()]
    except OSError:
        return ""
    for fields in lines:
        if len(fields) == 3 and fields[1] in ("", "name=systemd"):
            found = re.findall(r"/([^/]+\.(?:service|scope))(?=/|$)", fields[2])
            return found[-1] if found else ""
    return ""


def _uses(pid: str, roots: list[tuple[str, list[str]]]) -> tuple[dict[str, str], bool]:
    """What of each directory the process uses ({directory: how}), and whether its private files could be read."""
    found: dict[str, str] = {}
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
        for arg in args:
            text = os.fsdecode(arg)
            where = _under(text, roots) if text.startswith("/") else None
            if where and where not in found:
                found[where] = f"command line {text}"
    except OSError:
        return found, True  # gone
    readable = True
    for link, how in (("exe", "executable"), ("cwd", "working directory")):
        try:
            target = os.readlink(f"/proc/{pid}/{link}")
        except PermissionError:
            readable = False
            continue
        except OSError:
            continue
        where = _under(target.removesuffix(" (deleted)"), roots)
        if where and where not in found:
            found[where] = f"{how} {target}"
    try:
        for line in _read(f"/proc/{pid}/maps").splitlines():
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].startswith("/"):
                mapped = fields[5].removesuffix(" (deleted)")
                where = _under(mapped, roots)
                if where and where not in found:
                    found[where] = f"maps {mapped}"
    except PermissionError:
        readable = False
    except OSError:
        pass
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            where = _under(target.removesuffix(" (deleted)"), roots)
            if where and where not in found:
                found[where] = f"open file {target}"
    except PermissionError:
        readable = False
    except OSError:
        pass
    return found, readable


def argument_spec() -> dict:
    return dict(paths=dict(type="list", elements="path", required=True))


def main():
    module = AnsibleModule(argument_spec=argument_spec(), supports_check_mode=True)
    paths = [p.rstrip("/") or "/" for p in module.params["paths"]]
    for path in paths:
        if not os.path.isabs(path):
            module.fail_json(msg=f"paths: {path!r} is not an absolute path")
    # Each directory as given and as its real path: /proc shows resolved paths, a command line the spelling used.
    roots = [(p, sorted({p, os.path.realpath(p)}, key=len, reverse=True)) for p in paths if os.path.lexists(p)]
    users: dict[str, list[dict]] = {p: [] for p in paths}
    unreadable = []
    me = str(os.getpid())
    for pid in sorted((d for d in os.listdir("/proc") if d.isdigit()), key=int):
        if pid == me or not roots:
            continue
        found, readable = _uses(pid, roots)
        if not (found or not readable):
            continue
        try:
            name = _read(f"/proc/{pid}/comm").strip()
        except OSError:
            continue  # gone meanwhile
        about = {"pid": int(pid), "name": name, "unit": _unit(pid)}
        if not readable:
            unreadable.append(about)
        for where, how in found.items():
            users[where].append({**about, "how": how})
    module.exit_json(changed=False, unreadable=unreadable,
                     in_use=[{"path": p, "processes": users[p]} for p in paths if users[p]])


if __name__ == "__main__":
    main()
