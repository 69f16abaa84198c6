#!/usr/bin/python
# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: system_state
short_description: Read installed packages, systemd units and files of a host in one module run
version_added: 0.3.0
description:
  - Runs C(dpkg-query --show) for O(packages) and C(systemctl show --property=Id,UnitFileState,ActiveState) for
    O(units) on the host, and returns both outputs as they are, for the collection's filters
    C(inferops.vllm.dpkg_missing) (the packages apt must install), C(inferops.vllm.systemd_pending) (the units
    to enable and start) and C(inferops.vllm.systemd_active) (each unit's state).
  - Also tells which of O(paths) exist, returns the content of O(files) and the paths each of O(globs) matches.
  - "Why it exists: a role that installs packages and then makes sure their units run read each with a
    M(ansible.builtin.command) task, two module runs on every re-run (about 0.25 s of a host's CPU each on our
    2-core test machines) where one does; the roles' M(ansible.builtin.stat), M(ansible.builtin.find) and
    M(ansible.builtin.slurp) reads before their changes join the same run."
  - It changes nothing. A task that reads a file that may hold a secret sets C(no_log).
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
  packages:
    description:
      - Debian package names. A name dpkg does not know is left out of RV(dpkg) (so it counts as missing).
    type: list
    elements: str
    default: []
  units:
    description:
      - systemd unit names. A unit that does not exist is shown as not found, and so as neither enabled nor active.
    type: list
    elements: str
    default: []
  paths:
    description:
      - Paths whose existence RV(exists) tells (a symbolic link counts when it points to something).
    type: list
    elements: path
    default: []
  files:
    description:
      - Files whose content RV(contents) returns; one that is missing or not a regular file is left out.
      - The content is returned in Base64, as M(ansible.builtin.slurp) returns it. A task reading a file that may
        hold a secret sets C(no_log).
    type: list
    elements: path
    default: []
  globs:
    description:
      - Shell patterns (Python's C(glob), no C(**)) whose matching paths RV(matches) lists; names starting with a dot
        match only a pattern that starts them with a dot.
    type: list
    elements: path
    default: []
notes:
  - The units' state is read when the module runs. A caller that installs the packages afterwards (their maintainer
    scripts may start units) or restarts units still starts those RV(systemd) showed not running; starting a unit that
    runs by then changes nothing.
"""

EXAMPLES = r"""
- name: Find whether nftables is installed and the firewall unit enabled and active
  inferops.vllm.system_state:
    packages: [nftables]
    units: [inferops-vllm-firewall.service]
  register: state

- name: Install nftables when it is missing
  ansible.builtin.apt:
    name: nftables
  when: state.dpkg | inferops.vllm.dpkg_missing(['nftables']) | length > 0
"""

RETURN = r"""
dpkg:
  description:
    - The output of C(dpkg-query --show --showformat='${Package}\t${db:Status-Abbrev}\n' -- PACKAGES), a line per
      package dpkg knows; empty without O(packages).
  returned: always
  type: str
  sample: "nftables\tii \n"
systemd:
  description:
    - The output of C(systemctl show --property=Id,UnitFileState,ActiveState -- UNITS), a block per unit; empty
      without O(units) or when systemctl fails (no systemd).
  returned: always
  type: str
  sample: "Id=inferops-vllm-firewall.service\nUnitFileState=enabled\nActiveState=active\n"
exists:
  description: For each of O(paths), whether it exists.
  returned: always
  type: dict
  sample: {"/etc/systemd/system/vllm-router.service": false}
contents:
  description: For each of O(files) that is a regular file, its content in Base64.
  returned: always
  type: dict
  sample: {"/etc/inferops-vllm/decode-0.toml": "W3NlcnZlcl0K"}
matches:
  description: For each of O(globs), the paths it matches, sorted.
  returned: always
  type: dict
  sample: {"/etc/inferops-vllm/*.toml": ["/etc/inferops-vllm/decode-0.toml"]}
"""

import base64  # noqa: E402 (imports follow the documentation, as Ansible modules do)
import glob  # noqa: E402
import os  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402
from ansible_collections.inferops.vllm.plugins.module_utils._dpkg import dpkg_show  # noqa: E402


def main():
    module = AnsibleModule(
        argument_spec={
            "packages": {"type": "list", "elements": "str", "default": []},
            "units": {"type": "list", "elements": "str", "default": []},
            "paths": {"type": "list", "elements": "path", "default": []},
            "files": {"type": "list", "elements": "path", "default": []},
            "globs": {"type": "list", "elements": "path", "default": []},
        },
        supports_check_mode=True,
    )
    packages, units = module.params["packages"], module.params["units"]
    systemd = ""
    dpkg = dpkg_show(module, packages)
    if units:
        rc, systemd, _err = module.run_command(
            ["systemctl", "show", "--property=Id,UnitFileState,ActiveState", "--", *units])
        if rc != 0:
            systemd = ""
    contents = {}
    for path in module.params["files"]:
        if os.path.isfile(path):
            try:
                with open(path, "rb") as handle:
                    contents[path] = base64.b64encode(handle.read()).decode("ascii")
            except OSError as err:
                module.fail_json(msg=f"cannot read {path}: {err.strerror}")
    module.exit_json(changed=False, dpkg=dpkg, systemd=systemd,
                     exists={path: os.path.exists(path) for path in module.params["paths"]},
                     contents=contents,
                     matches={pattern: sorted(glob.glob(pattern)) for pattern in module.params["globs"]})


if __name__ == "__main__":
    main()
