#!/usr/bin/python
# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: nixl_progress_delay
short_description: Set the delay of NIXL's progress thread in a virtual environment
version_added: 0.1.0
description:
  - "NIXL's Python API (C(nixl_cu12/_api.py), C(nixl_agent.__init__)) creates every agent with
    C(agent_config.pthrDelay = 0), and vLLM's NixlConnector has no option to change it, so the agent's
    progress thread polls without pause and keeps a CPU core busy while the instance is idle."
  - This module sets that one line to O(delay_us) microseconds in every C(nixl_cu*/_api.py) of the virtual
    environment O(venv), or puts NIXL's own line back with O(delay_us=0).
  - "The file is changed only when, with that line put back to NIXL's own C(pthrDelay = 0), its SHA-256 is
    one of O(expected_sha256): a NIXL release whose file differs (an upgrade) makes the module fail and say
    so, instead of editing a file it does not know."
  - Running processes keep the delay they started with, so restart the vLLM instances after a change.
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
      - The virtual environment that holds NIXL, for example V(/opt/vllm/venv).
      - Every C(lib/python3*/site-packages/nixl_cu*/_api.py) in it is handled.
    type: path
    required: true
  delay_us:
    description:
      - Microseconds the progress thread yields the CPU between two rounds of progress.
      - V(0) is NIXL's own behaviour (no pause); the file is then left as NIXL ships it, and a line this module
        changed earlier is put back.
      - A larger delay frees the core of an idle instance and can add up to this much latency to each step of
        a KV transfer.
    type: int
    required: true
  expected_sha256:
    description:
      - SHA-256 checksums of the pristine C(_api.py) files this module may change (NIXL's own file of the pinned
        release).
      - Required when O(delay_us) is not V(0).
    type: list
    elements: str
    default: []
notes:
  - When O(delay_us) is not V(0) and no NIXL file is found, the module fails, except in check mode, where
    it reports the change an install would be followed by.
"""

EXAMPLES = r"""
- name: Let idle NIXL workers give their core back (1 ms between progress rounds)
  inferops.vllm.nixl_progress_delay:
    venv: /opt/vllm/venv
    delay_us: 1000
    expected_sha256:
      - 79ac70eed826672f09a21df7e71c8646654e761961c9783ecd8e145c0a7149a7

- name: Put NIXL's own busy-polling back
  inferops.vllm.nixl_progress_delay:
    venv: /opt/vllm/venv
    delay_us: 0
"""

RETURN = r"""
delay_us:
  description: The delay the NIXL files now carry (or would carry, in check mode).
  returned: always
  type: int
  sample: 1000
files:
  description: Each NIXL file found, with the delay it had before and has now.
  returned: always
  type: list
  elements: dict
  contains:
    path:
      description: Path of the file.
      type: str
      sample: /opt/vllm/venv/lib/python3.11/site-packages/nixl_cu12/_api.py
    before:
      description: The C(pthrDelay) value found in the file, as written there.
      type: str
      sample: "0"
    after:
      description: The C(pthrDelay) value the file has after the run.
      type: str
      sample: "1000"
    changed:
      description: Whether this file was (or in check mode would be) changed.
      type: bool
      sample: true
  sample:
    - path: /opt/vllm/venv/lib/python3.11/site-packages/nixl_cu12/_api.py
      before: "0"
      after: "1000"
      changed: true
"""

import glob  # noqa: E402 (imports follow the documentation, as Ansible modules do)
import os  # noqa: E402
import re  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402
from ansible_collections.inferops.vllm.plugins.module_utils._venv_file_patch import (  # noqa: E402
    sha256,
    write_atomically,
)


def _mark():
    """Marks a line this module wrote, so that delay_us=0 knows what to put back."""
    return "  # set by inferops.vllm (vllm_install_nixl_progress_delay_us)"


def _line_pattern():
    return re.compile(
        r"^(?P<indent>[ \t]*)agent_config\.pthrDelay = (?P<value>[^\n#]*?)[ \t]*(?P<mark>#[^\n]*)?$", re.M
    )


def pristine(text):
    """The file as NIXL ships it: its one pthrDelay line back to `= 0`. None when the file does not
    have exactly one such line."""
    matches = list(_line_pattern().finditer(text))
    if len(matches) != 1:
        return None
    m = matches[0]
    return text[: m.start()] + m.group("indent") + "agent_config.pthrDelay = 0" + text[m.end():]


def with_delay(text, delay_us):
    """The pristine file with the delay set (delay_us 0: the pristine file itself)."""
    base = pristine(text)
    if base is None or delay_us == 0:
        return base
    return _line_pattern().sub(
        lambda m: f"{m.group('indent')}agent_config.pthrDelay = {delay_us}{_mark()}", base, count=1
    )


def current_value(text):
    m = _line_pattern().search(text)
    return m.group("value").strip() if m else None


def find_files(venv):
    return sorted(glob.glob(os.path.join(venv, "lib", "python3*", "site-packages", "nixl_cu*", "_api.py")))


def plan(path, text, delay_us, expected):
    """(new_text, error) for one file: new_text is None when it must not be touched."""
    base = pristine(text)
    if base is None:
        return None, (
            f"{path}: expected exactly one line 'agent_config.pthrDelay = ...' (NIXL's nixl_agent.__init__), "
            "found another number: this is not a NIXL file this module knows."
        )
    ours = _mark().strip() in text
    if delay_us == 0 and not ours:
        return text, None  # NIXL's own file, left exactly as it is
    if delay_us != 0 and sha256(base) not in expected:
        return None, (
            f"{path}: its content (SHA-256 {sha256(base)} with NIXL's own pthrDelay line) is not the pinned NIXL "
            f"release's file (expected one of: {', '.join(expected) or 'none given'}), so its progress-thread "
            "delay is not changed. Fix: set vllm_install_nixl_progress_delay_us: 0 (NIXL's own busy-polling), or "
            "pin the NIXL release the collection knows (vllm_install_nixl_version)."
        )
    return with_delay(text, delay_us), None


def main():
    module = AnsibleModule(
        argument_spec=dict(
            venv=dict(type="path", required=True),
            delay_us=dict(type="int", required=True),
            expected_sha256=dict(type="list", elements="str", default=[]),
        ),
        supports_check_mode=True,
    )
    venv = module.params["venv"]
    delay_us = module.params["delay_us"]
    expected = [h.lower() for h in module.params["expected_sha256"]]
    if delay_us < 0:
        module.fail_json(msg=f"delay_us must be 0 or more microseconds, got {delay_us}.")

    paths = find_files(venv)
    if not paths:
        if delay_us == 0:
            module.exit_json(changed=False, delay_us=0, files=[], msg=f"no NIXL found in {venv}: nothing to do")
        if module.check_mode:
            module.exit_json(
                changed=True, delay_us=delay_us, files=[],
                msg=f"check mode: no NIXL in {venv} yet; its progress delay would be set after the install",
            )
        module.fail_json(
            msg=f"no nixl_cu*/_api.py under {venv}/lib/python3*/site-packages: is NIXL installed in that venv?",
            delay_us=delay_us, files=[],
        )

    files, errors, diffs, pending = [], [], [], {}
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        new_text, error = plan(path, text, delay_us, expected)
        if error:
            errors.append(error)
            continue
        file_changed = new_text != text
        files.append(dict(path=path, before=current_value(text), after=current_value(new_text), changed=file_changed))
        if file_changed:
            pending[path] = new_text
            diffs.append(dict(before=text, after=new_text, before_header=path, after_header=path))
    if errors:
        module.fail_json(msg=" ".join(errors), files=files, delay_us=delay_us)

    if not module.check_mode:
        for path, new_text in pending.items():
            write_atomically(module, path, new_text)
    result = dict(changed=bool(pending), delay_us=delay_us, files=files)
    if module._diff and diffs:
        result["diff"] = diffs
    module.exit_json(**result)


if __name__ == "__main__":
    main()
