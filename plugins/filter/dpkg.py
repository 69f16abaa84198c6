# Copyright (c) inferops.vllm contributors
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Which of some Debian packages are not installed, from ``dpkg-query --show`` output.

Documented in dpkg_missing.yml beside this file. The roles that install packages with
ansible.builtin.apt (python_venv, vllm_firewall, vllm_monitoring) ask dpkg-query first and run apt only
when a package is missing: apt costs a second or more of a re-run's time per host, even with nothing
to do, and a dpkg-query command a quarter of that.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ansible.errors import AnsibleFilterError

# What the roles pass to dpkg-query (--showformat): the package name, a tab, the status abbreviation.
SHOWFORMAT = "${Package}\\t${db:Status-Abbrev}\\n"


def dpkg_missing(output, names):
    """The entries of ``names`` that ``output`` does not show as installed ("ii"), in their order.

    A name that is no plain package name (a version pin ``name=1.2``, a pattern, a release ``name/bookworm``)
    never matches a line, so it counts as missing and apt decides about it, as it did before.
    """
    if isinstance(names, (str, bytes, Mapping)) or not isinstance(names, Iterable):
        raise AnsibleFilterError(f"dpkg_missing: the package names are {names!r}, not a list of names.")
    if not isinstance(output, str):
        raise AnsibleFilterError(f"dpkg_missing: the dpkg-query output is {output!r}, not a text.")
    installed = set()
    for line in output.splitlines():
        package, sep, status = line.partition("\t")
        if sep and status.startswith("ii"):
            # A multi-arch package may be shown as name:arch.
            installed.add(package.strip())
            installed.add(package.strip().split(":", 1)[0])
    return [str(name) for name in names if str(name) not in installed]


class FilterModule:
    def filters(self):
        return {"dpkg_missing": dpkg_missing}
