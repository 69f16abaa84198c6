# Copyright (c) inferops.vllm contributors
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Which systemd units are not both enabled and active, from ``systemctl show`` output.

Documented in systemd_pending.yml and systemd_active.yml beside this file. vllm_router and vllm_monitoring
enable and start three or more units each with a loop of ansible.builtin.systemd_service, one module run
per unit on every run (~0.3-0.5 s each on our 2-core machines); they ask systemctl once first and loop
only over the units that are not enabled and running yet. vllm_instance reads which instances run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ansible.errors import AnsibleFilterError


def _blocks(output):
    """One dict of Key=Value lines per unit, in the order systemctl printed them (a blank line between)."""
    blocks, current = [], {}
    for line in output.splitlines():
        if not line.strip():
            if current:
                blocks.append(current)
                current = {}
            continue
        key, sep, value = line.partition("=")
        if sep:
            current[key.strip()] = value.strip()
    if current:
        blocks.append(current)
    return blocks


def _unit_blocks(name, output, units):
    """The unit names and their blocks of ``output`` (None when they do not match one to one); bad input refused."""
    if isinstance(units, (str, bytes, Mapping)) or not isinstance(units, Iterable):
        raise AnsibleFilterError(f"{name}: the units are {units!r}, not a list of unit names.")
    if not isinstance(output, str):
        raise AnsibleFilterError(f"{name}: the systemctl output is {output!r}, not a text.")
    units = [str(unit) for unit in units]
    blocks = _blocks(output)
    return units, (blocks if len(blocks) == len(units) else None)


def systemd_pending(output, units):
    """The entries of ``units`` that ``output`` does not show as enabled and active, in their order.

    ``output`` is ``systemctl show --property=Id,UnitFileState,ActiveState -- UNIT...`` for exactly these
    units (systemctl prints one block per unit, in the order asked). When the blocks do not match the units
    one to one, every unit is returned: the caller's systemd_service loop then decides, as it did before.
    """
    units, blocks = _unit_blocks("systemd_pending", output, units)
    if blocks is None:
        return units
    return [
        unit
        for unit, block in zip(units, blocks, strict=True)
        if not (block.get("UnitFileState") == "enabled" and block.get("ActiveState") == "active")
    ]


def systemd_active(output, units):
    """The ActiveState of each entry of ``units`` (``active``, ``inactive``, ``failed``, ...), in their order.

    ``output`` is as for systemd_pending. When the blocks do not match the units one to one (systemctl failed:
    no systemd), every unit's state is ``unknown``: none counts as running.
    """
    units, blocks = _unit_blocks("systemd_active", output, units)
    if blocks is None:
        return ["unknown"] * len(units)
    return [block.get("ActiveState") or "unknown" for block in blocks]


class FilterModule:
    def filters(self):
        return {"systemd_pending": systemd_pending, "systemd_active": systemd_active}
