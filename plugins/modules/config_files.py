#!/usr/bin/python
# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: config_files
short_description: Write a role's directories and small text files in one module run
version_added: 0.2.0
description:
  - Makes sure a list of directories and small text files are as given (content, owner, group, mode), or absent, in
    one module run on the host. The action plugin renders each O(files[].template) on the controller with the task's
    variables (as M(ansible.builtin.template) does) and reads each O(files[].src) from the role's C(files/).
  - "Why: each M(ansible.builtin.template) or M(ansible.builtin.copy) item costs two module runs on the host (a
    C(stat), then C(file) or C(copy)), about 0.25 s of CPU each on our 2-core test machines, most of it Python
    compiling C(ansible.module_utils) from the module's zip. A role that writes ten files pays five seconds per host
    on every run, even when nothing changed; this module pays one run."
  - A file is replaced through a temporary file in its directory that gets the owner, group and mode first, then is
    renamed over the old one. A reader never sees a partial file, and a key file is never readable by others, not
    even for a moment.
  - A file with O(files[].validate) is checked by that command as the temporary file, before it replaces the old one
    (the entries before it in O(files) are in place by then, so a configuration can be checked with the files it
    includes). When the command refuses it, the task fails with the command's output and changes nothing - the files
    it wrote or removed before are put back as they were (directories it created stay) - so that no change is left
    that a handler was not told about.
  - A secret file (O(files[].secret_content), or C(secret) in the task, which the action plugin turns into it) is
    written like any other, but its content is never shown - Ansible masks it in every output, and its diff says
    that it changes without showing either side. The other files of the task keep their diffs, so the task needs no
    C(no_log).
  - For a backup or binary content, use M(ansible.builtin.template) or M(ansible.builtin.copy).
author:
  - inferops.vllm developers (@inferops)
extends_documentation_fragment:
  - inferops.vllm.attributes
attributes:
  check_mode:
    support: full
    details:
      - Reports what would change and changes nothing.
  diff_mode:
    support: full
    details:
      - One diff per file or directory that changes. Set C(no_log) (or C(diff) false) on tasks that write secrets.
options:
  files:
    description:
      - The directories and files, in order (a directory before the files in it).
    type: list
    elements: dict
    required: true
    suboptions:
      path:
        description: Absolute path.
        type: path
        required: true
      state:
        description:
          - V(file) writes O(files[].content), V(directory) creates the directory (and its missing parents), V(absent)
            removes a file (never a directory).
        type: str
        choices: [file, directory, absent]
        default: file
      content:
        description:
          - The file's text, for O(files[].state=file). Filled in by the action plugin from O(files[].template) or
            O(files[].src) when one of those is given.
          - For a file that holds secrets use O(files[].secret_content) (C(secret) in the task) instead.
        type: str
      secret_content:
        description:
          - The file's text when it holds secrets, for O(files[].state=file); never shown (masked in every output,
            no diff of its text). Filled in by the action plugin when the task's entry has C(secret) set to V(true),
            from O(files[].content), O(files[].template) or O(files[].src).
        type: str
      validate:
        description:
          - A command that checks the new content before it replaces the file, with V(%s) where the path of the
            temporary file goes (as the C(validate) of M(ansible.builtin.template)); run without a shell, only
            when the content changes, and not in check mode (nothing is replaced then). A non-zero exit fails the
            task with the command's output, and the file stays as it was.
        type: str
      template:
        description:
          - A template of the role's C(templates/) (or a path), rendered on the controller with the task's variables.
        type: str
      vars:
        description:
          - Variables for this entry's O(files[].template) only, on top of the task's (for example the C(item) of
            a loop the template was written for).
        type: dict
      src:
        description:
          - A file of the role's C(files/) (or a path), copied as it is. Text only.
        type: str
      owner:
        description: Owner name. Unset leaves it as it is (root for a new file or directory of a root run).
        type: str
      group:
        description: Group name. Unset leaves it as it is.
        type: str
      mode:
        description:
          - Mode as an octal string, for example V("0640"). Unset leaves an existing file's mode; a new file
            gets C(0600), a new directory C(0755).
        type: str
      secret:
        description:
          - For the action plugin - V(true) sends the entry's text (O(files[].content), O(files[].template) or
            O(files[].src)) to the host as O(files[].secret_content). The module itself only reads
            O(files[].secret_content).
        type: bool
        default: false
      key:
        description:
          - Any string, returned with this entry's result (RV(results[].key)), for example the service a file
            belongs to, so that a handler can restart only what changed.
        type: str
"""

EXAMPLES = r"""
- name: Write the arguments of the monitoring services and their units' drop-ins
  inferops.vllm.config_files:
    files:
      - path: /etc/inferops-vllm/monitoring
        state: directory
        mode: "0755"
      - path: /etc/inferops-vllm/monitoring/node_exporter.env
        template: node_exporter.env.j2
        owner: root
        group: root
        mode: "0644"
        key: node_exporter
  notify: Restart monitoring services
"""

RETURN = r"""
results:
  description: One entry per O(files) entry, in order.
  returned: always
  type: list
  elements: dict
  contains:
    path:
      description: The path.
      type: str
      sample: /etc/inferops-vllm/monitoring/node_exporter.env
    state:
      description: The state asked for.
      type: str
      sample: file
    changed:
      description: Whether this entry changed (or would, in check mode).
      type: bool
      sample: false
    key:
      description: O(files[].key), or null.
      type: str
      sample: node_exporter
changed_paths:
  description: The paths that changed (or would, in check mode), in order.
  returned: always
  type: list
  elements: str
  sample: [/etc/inferops-vllm/monitoring/node_exporter.env]
"""

import os  # noqa: E402
import tempfile  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402
from ansible.module_utils.common.text.converters import to_bytes, to_text  # noqa: E402


def _read(path):
    """The file's bytes, or None when there is no file."""
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except FileNotFoundError:
        return None


def _set_attributes(module, path, entry, diff=None):
    """Owner, group and mode as the entry says (unset ones stay); True when one of them changes."""
    changed = module.set_owner_if_different(path, entry.get("owner"), False, diff)
    changed = module.set_group_if_different(path, entry.get("group"), changed, diff)
    return module.set_mode_if_different(path, entry.get("mode"), changed, diff)


def _attributes_changed(module, path, entry, diffs):
    """Owner, group and mode of an existing path set as the entry says; their diff added to diffs when asked."""
    diff = {} if module._diff else None
    changed = _set_attributes(module, path, entry, diff)
    if changed and diff:
        diffs.append(diff)
    return changed


class _Refused(Exception):
    """A validate command refused an entry's new content: (message, rc, stdout, stderr)."""


def _validate(module, entry, tmp):
    """Run the entry's validate command on the temporary file; raise _Refused (the caller removes it) when it
    refuses."""
    command = entry["validate"]
    rc, out, err = module.run_command(command % tmp)
    if rc != 0:
        raise _Refused(f"{entry['path']}: the new content failed validation: `{command}` exited {rc}: "
                       f"{(err or out).strip()}", rc, out, err)


def _snapshot(path):
    """What an entry's path is before the module touches it: (path, bytes, stat) of a file, (path, None, None) when
    there is none; None for a directory (a directory the module creates stays)."""
    if os.path.isdir(path) and not os.path.islink(path):
        return None
    if not os.path.lexists(path):
        return (path, None, None)
    if os.path.islink(path):
        return (path, os.readlink(path), None)
    return (path, _read(path), os.stat(path))


def _restore(snapshot):
    """Put a path back as _snapshot found it."""
    path, data, before = snapshot
    if os.path.lexists(path) and not os.path.isdir(path):
        os.unlink(path)
    if data is None:
        return
    if before is None:
        os.symlink(data, path)
        return
    handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(handle, "wb") as out:
        out.write(data)
    os.chown(path, before.st_uid, before.st_gid)
    os.chmod(path, before.st_mode & 0o7777)


def _write(module, entry, data):
    """Write data to entry's path through a temporary file that has the final owner, group and mode (and passed
    the entry's validate command) before it is renamed over the path."""
    path = entry["path"]
    directory = os.path.dirname(path) or "."
    handle, tmp = tempfile.mkstemp(prefix=".inferops-", dir=directory)
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        wanted = dict(entry)
        if os.path.exists(path):
            current = os.stat(path)
            os.chown(tmp, current.st_uid, current.st_gid)
            if entry.get("mode") is None:
                wanted["mode"] = f"{current.st_mode & 0o7777:04o}"
        _set_attributes(module, tmp, wanted)
        if entry.get("validate"):
            _validate(module, entry, tmp)
        os.rename(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _file(module, entry, diffs):
    path = entry["path"]
    secret = entry.get("secret_content") is not None
    text = entry["secret_content"] if secret else entry.get("content")
    if text is None:
        module.fail_json(msg=f"{path}: state=file needs content, template or src")
    wanted = to_bytes(text, errors="surrogate_or_strict")
    if os.path.isdir(path):
        module.fail_json(msg=f"{path} is a directory, not a file")
    current = _read(path)
    if current != wanted:
        if module._diff:
            before = to_text(current, errors="surrogate_or_replace") if current is not None else ""
            diffs.append({
                "before_header": path if current is not None else f"{path} (absent)",
                "after_header": path,
                "before": ("(secret: not shown)\n" if current is not None else "") if secret else before,
                "after": "(secret, changed: not shown)\n" if secret else text,
            })
        if not module.check_mode:
            if not os.path.isdir(os.path.dirname(path)):
                parent = os.path.dirname(path)
                module.fail_json(msg=f"{path}: its directory {parent} does not exist (list the directory first)")
            _write(module, entry, wanted)
        return True
    return _attributes_changed(module, path, entry, diffs)


def _directory(module, entry, diffs):
    path = entry["path"]
    if os.path.lexists(path) and not os.path.isdir(path):
        module.fail_json(msg=f"{path} exists and is not a directory")
    if not os.path.isdir(path):
        if module._diff:
            diffs.append({"before": {"path": path, "state": "absent"}, "after": {"path": path, "state": "directory"}})
        if not module.check_mode:
            os.makedirs(path, 0o755)
            _set_attributes(module, path, entry)
        return True
    return _attributes_changed(module, path, entry, diffs)


def _absent(module, entry, diffs):
    path = entry["path"]
    if os.path.isdir(path) and not os.path.islink(path):
        module.fail_json(msg=f"{path} is a directory; state=absent removes files only")
    if not os.path.lexists(path):
        return False
    if module._diff:
        diffs.append({"before": {"path": path, "state": "file"}, "after": {"path": path, "state": "absent"}})
    if not module.check_mode:
        os.unlink(path)
    return True


def run_module():
    module = AnsibleModule(
        argument_spec={
            "files": {
                "type": "list",
                "elements": "dict",
                "required": True,
                "options": {
                    "path": {"type": "path", "required": True},
                    "state": {"type": "str", "choices": ["file", "directory", "absent"], "default": "file"},
                    "content": {"type": "str", "no_log": False},
                    "secret_content": {"type": "str", "no_log": True},
                    "secret": {"type": "bool", "default": False},
                    "validate": {"type": "str"},
                    "template": {"type": "str"},
                    "vars": {"type": "dict"},
                    "src": {"type": "str"},
                    "owner": {"type": "str"},
                    "group": {"type": "str"},
                    "mode": {"type": "str"},
                    "key": {"type": "str", "no_log": False},
                },
            },
        },
        supports_check_mode=True,
    )
    for entry in module.params["files"]:
        if not os.path.isabs(entry["path"]):
            module.fail_json(msg=f"{entry['path']}: the path must be absolute")
        if entry.get("content") is not None and entry.get("secret_content") is not None:
            module.fail_json(msg=f"{entry['path']}: give content or secret_content, not both")
        if entry.get("validate") and "%s" not in entry["validate"]:
            module.fail_json(msg=f"{entry['path']}: validate must contain %s (where the temporary file's path goes)")
    results, diffs, changed_paths, done = [], [], [], []
    for entry in module.params["files"]:
        do = {"file": _file, "directory": _directory, "absent": _absent}[entry["state"]]
        before = None if module.check_mode or entry["state"] == "directory" else _snapshot(entry["path"])
        try:
            changed = bool(do(module, entry, diffs))
        except _Refused as refused:
            message, rc, out, err = refused.args
            for snapshot in reversed(done):
                _restore(snapshot)
            put_back = f" ({len(done)} file(s) this task had changed put back)" if done else ""
            module.fail_json(msg=f"{message}. Nothing was changed{put_back}.", rc=rc, stdout=out, stderr=err)
        if changed and before is not None:
            done.append(before)
        results.append({"path": entry["path"], "state": entry["state"], "changed": changed, "key": entry.get("key")})
        if changed:
            changed_paths.append(entry["path"])
    result = {"changed": bool(changed_paths), "results": results, "changed_paths": changed_paths}
    if module._diff:
        result["diff"] = diffs
    module.exit_json(**result)


def main():
    run_module()


if __name__ == "__main__":
    main()
