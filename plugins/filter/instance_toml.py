# Copyright (c) inferops.vllm contributors
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The vllm_instance role's config.toml of each instance, and the per-instance settings it reads.

Documented in instance_toml.yml and instance_setting_names.yml beside this file. The renderer is
plugins/plugin_utils/_instance_toml.py (render_text), the one the preflight's launcher check runs too; the
settings are those of the launcher's schema (plugins/module_utils/_vllm_instance_schema.py SETTINGS).
"""

from __future__ import annotations

from collections.abc import Mapping

from ansible.errors import AnsibleFilterError


def instance_toml(instance, settings, host):
    """The config.toml of one instance (see render_text)."""
    # Imported on use, not with this file: see plugins/filter/preflight.py on why.
    from ansible_collections.inferops.vllm.plugins.plugin_utils._instance_toml import RenderError, render_text

    for name, value in (("the instance", instance), ("settings", settings), ("host", host)):
        if not isinstance(value, Mapping):
            raise AnsibleFilterError(f"instance_toml: {name} must be a mapping")
    try:
        return render_text(instance, settings, host)
    except RenderError as exc:
        where = f"{host.get('inventory_hostname', '')}: instance {instance.get('name')}"
        raise AnsibleFilterError(f"instance_toml: {where}: the setting {exc.variable} {exc.what}") from exc


def instance_setting_names(prefix=""):
    """The per-instance settings, each with ``prefix`` before its name."""
    from ansible_collections.inferops.vllm.plugins.module_utils import _vllm_instance_schema as schema

    return [f"{prefix}{name}" for name in schema.SETTINGS]


class FilterModule:
    def filters(self):
        return {"instance_toml": instance_toml, "instance_setting_names": instance_setting_names}
