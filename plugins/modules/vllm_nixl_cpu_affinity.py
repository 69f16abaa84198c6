#!/usr/bin/python
# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: vllm_nixl_cpu_affinity
short_description: Keep a CPU vLLM instance on its own cores when its NIXL connector starts
version_added: 0.1.0
description:
  - "On the CPU build, vLLM's NixlConnector (C(vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py))
    reserves the last core of every NUMA node for KV transfer with C(os.sched_setaffinity(0, ...)). The call
    pins the worker's own thread, the one that runs the model, and it ignores C(VLLM_CPU_OMP_THREADS_BIND): every
    prefill and decode instance of a host then computes on the same last core, whatever cores it was given."
  - "With O(honour_binding=true) this module changes that one line so that the reserved cores are kept only where
    the thread may already run (the instance's own cores): an instance bound elsewhere stays on its cores, one
    bound to the reserved core keeps it. This is the behaviour of vLLM's open fix (pull request 58036)."
  - With O(honour_binding=false) vLLM's own line is put back.
  - "The file is changed only when, with that line as vLLM ships it, its SHA-256 is one of O(expected_sha256):
    another vLLM release makes the module fail and say so, instead of editing a file it does not know."
  - Running processes keep the affinity they started with, so restart the vLLM instances after a change.
author:
  - inferops.vllm developers (@inferops)
extends_documentation_fragment:
  - inferops.vllm.attributes
attributes:
  check_mode:
    support: full
  diff_mode:
    support: full
options:
  venv:
    description:
      - The virtual environment that holds vLLM, for example V(/opt/vllm/venv).
      - Every C(lib/python3*/site-packages/vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py) in it
        is handled.
    type: path
    required: true
  honour_binding:
    description:
      - V(true) keeps NIXL's reserved cores inside the worker thread's own affinity; V(false) is vLLM's own line.
    type: bool
    required: true
  expected_sha256:
    description:
      - SHA-256 checksums of the pristine C(base_worker.py) files this module may change (the pinned vLLM's own).
      - Required when O(honour_binding) is V(true).
    type: list
    elements: str
    default: []
notes:
  - When O(honour_binding=true) and no such file is found, the module fails, except in check mode, where it reports
    the change an install would be followed by.
  - GPU builds never run this code path (it is guarded by C(device_type == "cpu")); the role uses the module on the
    CPU build only.
"""

EXAMPLES = r"""
- name: Keep each CPU instance on its own cores when NIXL reserves a KV core
  inferops.vllm.vllm_nixl_cpu_affinity:
    venv: /opt/vllm/venv
    honour_binding: true
    expected_sha256:
      - 5da22389ba154696ba19a936fdaa89305a4dd981ef4c19d5c40322b050443f9b

- name: Put vLLM's own core reservation back
  inferops.vllm.vllm_nixl_cpu_affinity:
    venv: /opt/vllm/venv
    honour_binding: false
"""

RETURN = r"""
honour_binding:
  description: Whether the files now keep (or would keep, in check mode) the reserved cores inside the thread's own.
  returned: always
  type: bool
  sample: true
files:
  description: Each file found, and whether it was (or in check mode would be) changed.
  returned: always
  type: list
  elements: dict
  contains:
    path:
      description: Path of the file.
      type: str
      sample: "/opt/vllm/venv/lib/python3.11/site-packages/vllm/distributed/\
        kv_transfer/kv_connector/v1/nixl/base_worker.py"
    changed:
      description: Whether this file was (or in check mode would be) changed.
      type: bool
      sample: true
"""

import glob  # noqa: E402 (imports follow the documentation, as Ansible modules do)
import os  # noqa: E402
import re  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402
from ansible_collections.inferops.vllm.plugins.module_utils._venv_file_patch import (  # noqa: E402
    sha256,
    write_atomically,
)


def relative():
    """The NixlConnector worker's file, below site-packages."""
    return os.path.join("vllm", "distributed", "kv_transfer", "kv_connector", "v1", "nixl", "base_worker.py")


def upstream_line():
    return "os.sched_setaffinity(0, rsv_cores_for_kv)"


def our_line():
    """vLLM's reservation kept inside the thread's own affinity; the thread's own affinity when they do not meet."""
    return (
        "os.sched_setaffinity(0, (set(rsv_cores_for_kv) & os.sched_getaffinity(0)) or os.sched_getaffinity(0))"
        "  # set by inferops.vllm (vllm_install_nixl_honour_cpu_binding)"
    )


def _line_pattern():
    return re.compile(r"^(?P<indent>[ \t]*)os\.sched_setaffinity\(0, [^\n]*$", re.M)


def pristine(text):
    """The file as vLLM ships it (its one sched_setaffinity line back to vLLM's own), or None when the file does not
    have exactly one such line."""
    matches = list(_line_pattern().finditer(text))
    if len(matches) != 1:
        return None
    m = matches[0]
    return text[: m.start()] + m.group("indent") + upstream_line() + text[m.end():]


def wanted(text, honour):
    base = pristine(text)
    if base is None or not honour:
        return base
    return _line_pattern().sub(lambda m: m.group("indent") + our_line(), base, count=1)


def plan(path, text, honour, expected):
    """(new_text, error) for one file."""
    base = pristine(text)
    if base is None:
        return None, (
            f"{path}: expected exactly one line 'os.sched_setaffinity(0, ...)' (the NixlConnector's KV core "
            "reservation), found another number: this is not a vLLM file this module knows."
        )
    if not honour:
        return base, None
    if sha256(base) not in expected:
        return None, (
            f"{path}: its content (SHA-256 {sha256(base)} with vLLM's own line) is not the pinned vLLM release's file "
            f"(expected one of: {', '.join(expected) or 'none given'}), so its KV core reservation is not changed. "
            "Fix: "
            "set vllm_install_nixl_honour_cpu_binding: false (vLLM's own reservation: every instance of the host then "
            "computes on the last core of each NUMA node), or pin the vLLM release the collection knows "
            "(vllm_install_version)."
        )
    return wanted(text, True), None


def find_files(venv):
    return sorted(glob.glob(os.path.join(venv, "lib", "python3*", "site-packages", relative())))


def main():
    module = AnsibleModule(
        argument_spec=dict(
            venv=dict(type="path", required=True),
            honour_binding=dict(type="bool", required=True),
            expected_sha256=dict(type="list", elements="str", default=[]),
        ),
        supports_check_mode=True,
    )
    venv = module.params["venv"]
    honour = module.params["honour_binding"]
    expected = [h.lower() for h in module.params["expected_sha256"]]

    paths = find_files(venv)
    if not paths:
        if not honour:
            module.exit_json(changed=False, honour_binding=False, files=[], msg=f"no vLLM NIXL worker in {venv}")
        if module.check_mode:
            module.exit_json(
                changed=True, honour_binding=True, files=[],
                msg=f"check mode: no vLLM in {venv} yet; its NIXL core reservation would be changed after the install",
            )
        module.fail_json(
            msg=f"no {relative()} under {venv}/lib/python3*/site-packages: is vLLM installed in that venv?",
            honour_binding=True, files=[],
        )

    files, errors, diffs, pending = [], [], [], {}
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        new_text, error = plan(path, text, honour, expected)
        if error:
            errors.append(error)
            continue
        files.append(dict(path=path, changed=new_text != text))
        if new_text != text:
            pending[path] = new_text
            diffs.append(dict(before=text, after=new_text, before_header=path, after_header=path))
    if errors:
        module.fail_json(msg=" ".join(errors), files=files, honour_binding=honour)
    if not module.check_mode:
        for path, new_text in pending.items():
            write_atomically(module, path, new_text)
    result = dict(changed=bool(pending), honour_binding=honour, files=files)
    if module._diff and diffs:
        result["diff"] = diffs
    module.exit_json(**result)


if __name__ == "__main__":
    main()
