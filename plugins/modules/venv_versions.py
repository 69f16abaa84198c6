#!/usr/bin/python
# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: venv_versions
short_description: Read a versioned venv - which version directory its symlink points to, and the others
version_added: 0.3.0
description:
  - Reads, in one module run, what C(inferops.vllm.python_venv)'s prune needs to know of a versioned venv - whether
    O(path) is a symlink, the directory of O(versions_dir) it points to (the one with the same device and inode as
    the link's target, so that any spelling of the target is recognised), and every directory of O(versions_dir)
    with its modification time.
  - "Why: the prune ran two M(ansible.builtin.stat) and one M(ansible.builtin.find) for this on every deploy, a
    module run each (about 0.25 s of a host's CPU on our 2-core test machines)."
  - With O(marker), it also reads that file (the marker C(inferops.vllm.python_venv) writes into a version directory
    once its install is finished), so that the role's main entry point learns in the same run whether the install
    it wants is finished and already live, and skips its switch when it is.
  - With O(packages), it also runs C(dpkg-query --show) for them (RV(dpkg)), so that the role learns which of its
    system packages apt must install in the same run.
  - It changes nothing.
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
  path:
    description:
      - The venv path, a symlink to one of the directories of O(versions_dir) once the venv is versioned.
    type: path
    required: true
  versions_dir:
    description:
      - The directory of the venv's version directories. Its entries that are directories (not symlinks) are listed.
    type: path
    required: true
  marker:
    description:
      - A file to read as text, usually the marker of the version directory wanted. Missing, RV(marker) is null;
        any other error (a directory, no permission) fails the module.
    type: path
  packages:
    description:
      - Debian package names for RV(dpkg). A name dpkg does not know is left out of it (so it counts as missing for
        the filter C(inferops.vllm.dpkg_missing)); a failing C(dpkg-query) fails the module.
    type: list
    elements: str
    default: []
"""

EXAMPLES = r"""
- name: Read the venv's link and its version directories
  inferops.vllm.venv_versions:
    path: /opt/vllm/venv
    versions_dir: /opt/vllm/venv.d
  register: versions
"""

RETURN = r"""
islnk:
  description: Whether O(path) is a symlink.
  returned: always
  type: bool
  sample: true
live:
  description:
    - The directory of RV(dirs) that O(path) points to, or null (O(path) is no symlink, its target does not exist, or
      is not one of the directories of O(versions_dir)).
  returned: always
  type: str
  sample: /opt/vllm/venv.d/3f2a9c0d1e4b
owner:
  description:
    - The user and the group that own the symlink O(path) (the link itself, not its target), or null when it is no
      symlink.
  returned: always
  type: dict
  sample: {user: root, group: root}
marker:
  description: The text of O(marker), or null when it does not exist or O(marker) was not given.
  returned: always
  type: str
  sample: '{"packages": ["vllm==0.32.0"]}'
dirs:
  description: The directories of O(versions_dir), most recently modified first; none when it does not exist.
  returned: always
  type: list
  elements: dict
  contains:
    path:
      description: The directory's path.
      type: str
    mtime:
      description: Its modification time (seconds since the epoch).
      type: float
  sample:
    - {path: /opt/vllm/venv.d/3f2a9c0d1e4b, mtime: 1796490538.0}
dpkg:
  description:
    - The output of C(dpkg-query --show --showformat='${Package}\t${db:Status-Abbrev}\n' -- PACKAGES), a line per
      package of O(packages) dpkg knows; empty without O(packages).
  returned: always
  type: str
  sample: "python3-venv\tii \n"
"""

import grp  # noqa: E402 (imports follow the documentation, as Ansible modules do)
import os  # noqa: E402
import pwd  # noqa: E402
import stat  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402
from ansible_collections.inferops.vllm.plugins.module_utils._dpkg import dpkg_show  # noqa: E402


def name_of(lookup, number):
    """The name pwd or grp give a uid or gid, or the number as a string when there is none."""
    try:
        return lookup(number)[0]
    except KeyError:
        return str(number)


def link_owner(path):
    """{user, group} of the symlink ``path`` itself, or None when it is no symlink (or missing)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISLNK(info.st_mode):
        return None
    return {"user": name_of(pwd.getpwuid, info.st_uid), "group": name_of(grp.getgrgid, info.st_gid)}


def read_marker(path):
    """The text of the file ``path``, or None when it does not exist (other errors are raised)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return None


def read_versions(path, versions_dir):
    """(islnk, live, dirs) of the venv at ``path`` and its ``versions_dir``, as RETURN says."""
    try:
        islnk = stat.S_ISLNK(os.lstat(path).st_mode)
    except FileNotFoundError:
        islnk = False
    target = None
    if islnk:
        try:
            found = os.stat(path)
            target = (found.st_dev, found.st_ino)
        except FileNotFoundError:
            pass
    dirs, live = [], None
    try:
        entries = list(os.scandir(versions_dir))
    except (FileNotFoundError, NotADirectoryError):
        entries = []
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False):
            continue
        info = entry.stat(follow_symlinks=False)
        dirs.append({"path": entry.path, "mtime": info.st_mtime})
        if target == (info.st_dev, info.st_ino):
            live = entry.path
    dirs.sort(key=lambda d: d["mtime"], reverse=True)
    return islnk, live, dirs


def main():
    module = AnsibleModule(
        argument_spec={
            "path": {"type": "path", "required": True},
            "versions_dir": {"type": "path", "required": True},
            "marker": {"type": "path"},
            "packages": {"type": "list", "elements": "str", "default": []},
        },
        supports_check_mode=True,
    )
    islnk, live, dirs = read_versions(module.params["path"], module.params["versions_dir"])
    marker = None
    if module.params["marker"]:
        try:
            marker = read_marker(module.params["marker"])
        except (OSError, UnicodeDecodeError) as e:
            module.fail_json(msg=f"cannot read {module.params['marker']}: {e}")
    module.exit_json(changed=False, islnk=islnk, live=live, owner=link_owner(module.params["path"]), marker=marker,
                     dirs=dirs, dpkg=dpkg_show(module, module.params["packages"]))


if __name__ == "__main__":
    main()
