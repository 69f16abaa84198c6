# Copyright (c) inferops.vllm contributors
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The fingerprint of a model directory on the controller (relative path, size and mtime of every file).

Documented in model_fingerprint.yml beside this file. vllm_instance computed it with an ansible.builtin.find
delegated to localhost and a set_fact over its result: a module run on the controller per host and task. This
filter reads the same files in the worker that templates the set_fact, and gives the same value, so that a
deployment upgraded to it neither copies its model again nor restarts its instances for it.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat

from ansible.errors import AnsibleFilterError


def model_fingerprint(src):
    """sha256 of the JSON list [relative path, size, int(mtime)] of every regular file under ``src``.

    The files are those ansible.builtin.find (recurse, file_type file, hidden false, follow false) returns: regular
    files, not symlinks, whose own name does not start with a dot (files inside a hidden directory count). They are
    in the order of Jinja's sort(attribute='path'), which ignores case, and the JSON is to_json's (json.dumps).
    """
    if not isinstance(src, str) or not src:
        raise AnsibleFilterError(f"model_fingerprint: the model directory is {src!r}, not a path.")
    # A path that is no directory lists no file, as find's did (the PD preflight names a missing model itself).
    found = []
    for root, dirs, files in os.walk(src):
        for name in files + dirs:
            if name.startswith("."):
                continue
            path = os.path.normpath(os.path.join(root, name))
            try:
                info = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISREG(info.st_mode):
                found.append((path, info.st_size, info.st_mtime))
    found.sort(key=lambda f: f[0].lower())
    listing = [[os.path.relpath(path, src), size, int(mtime)] for path, size, mtime in found]
    return hashlib.sha256(json.dumps(listing).encode("utf-8")).hexdigest()


class FilterModule:
    def filters(self):
        return {"model_fingerprint": model_fingerprint}
