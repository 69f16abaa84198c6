# Copyright (c) inferops.vllm contributors
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The PD preflight's filters: pd_preflight, kv_sizing, instance_problems and the other rule checks.

Documented in pd_preflight.yml, kv_sizing.yml and the other .yml files beside this file; the rules are in
plugins/plugin_utils/_preflight.py, imported on the first call of one of these filters.

Why this file holds no rule: to find any filter of a collection, ansible-core (2.19) loads every file in its
plugins/filter/ and their imports, in every worker process it forks for a task (it forks one per task and
host). The rules and the modules they import are ~4,000 lines, and a collection's module_utils and
plugin_utils are compiled on every import (no bytecode cache): with the filter files importing them, the
first filter lookup of a worker cost 61 ms of controller CPU, in every task that used any of the collection's
filters (dpkg_missing, url_host, ...; ~100 tasks of a no-op deploy_pd.yml). Imported on first use, it costs
15 ms, and the rules cost their import only where one runs. docs/architecture.md, "Controller time per task".
"""

from __future__ import annotations

# Filter name -> function in plugins/plugin_utils/_preflight.py.
_FILTERS = {
    "pd_preflight": "_pd_preflight_filter", "pd_preflight_warnings": "pd_preflight_warnings",
    "front_fallback_problems": "front_fallback_problems", "front_fallback_redact": "front_fallback_redact",
    "kv_sizing": "kv_sizing", "launcher_problems": "launcher_problems", "instance_problems": "instance_problems",
    "parity_change_problems": "parity_change_problems", "host_address_problems": "host_address_problems",
    "router_problems": "router_problems", "valid_api_key": "valid_api_key", "install_problems": "install_problems",
    "driver_problems": "driver_problems", "monitoring_problems": "monitoring_problems",
    "client_timeout": "client_timeout", "instance_limits": "instance_limits",
}


def _on_first_use(function_name):
    def call(*args, **kwargs):
        from ansible_collections.inferops.vllm.plugins.plugin_utils import _preflight

        return getattr(_preflight, function_name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = function_name
    return call


class FilterModule:
    def filters(self):
        return {name: _on_first_use(function_name) for name, function_name in _FILTERS.items()}
