# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What the modules that read which Debian packages are installed share (system_state, venv_versions): one
dpkg-query run whose output the filter inferops.vllm.dpkg_missing reads (plugins/filter/dpkg.py, SHOWFORMAT)."""

from __future__ import annotations

# The package name, a tab, the status abbreviation ("ii " when installed): as plugins/filter/dpkg.py expects.
SHOWFORMAT = "${Package}\t${db:Status-Abbrev}\n"


def dpkg_show(module, packages):
    """dpkg-query's output for ``packages`` (empty without any); fails the module when dpkg-query fails.

    rc 1 is a package dpkg does not know: it is left out of the output, so it counts as missing.
    """
    if not packages:
        return ""
    rc, out, err = module.run_command(["dpkg-query", "--show", f"--showformat={SHOWFORMAT}", "--", *packages])
    if rc not in (0, 1):
        module.fail_json(msg=f"dpkg-query --show failed (rc {rc}): {err.strip()}", rc=rc)
    return out
