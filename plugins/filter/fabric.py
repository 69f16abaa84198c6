# Copyright (c) inferops.vllm contributors
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Filters that fit each vLLM instance's KV path to its host's fabric (rules in plugins/plugin_utils/_kv_fabric.py).

Documented in kv_fabric.yml and kv_fabric_problems.yml beside this file.
"""

from __future__ import annotations

from collections.abc import Mapping

from ansible.errors import AnsibleFilterError


def _rules():
    """plugins/plugin_utils/_kv_fabric.py, imported on first use, not with this file (see plugins/filter/preflight.py
    on why)."""
    from ansible_collections.inferops.vllm.plugins.plugin_utils import _kv_fabric

    return _kv_fabric


def _published_instances(published):
    if not isinstance(published, Mapping):
        raise AnsibleFilterError("the host's record must be a mapping (vllm_instance_published)")
    return {i.get("name"): i for i in published.get("instances") or [] if isinstance(i, Mapping)}


def _bus_ids(gpus, facts):
    """The PCI bus ids of an instance's GPUs (UUIDs or indices, as gpu_assign gives them) from nvidia_gpus facts."""
    ids = []
    for ref in gpus or []:
        for gpu in facts or []:
            if ref in (gpu.get("uuid"), gpu.get("index")) or str(ref) == str(gpu.get("index")):
                ids.append(gpu.get("pci_bus_id"))
                break
    return ids


def kv_fabric(instances, published, gpus=None, fabric=None, host=""):
    """Each instance with ``kv_fabric``: its [kv_fabric] table (transport, UCX_NET_DEVICES, UCX_TLS,
    UCX_IB_GID_INDEX), None for an instance without PD."""
    if not isinstance(instances, list):
        raise AnsibleFilterError("kv_fabric: the instances must be a list (vllm_instance_instances, placed)")
    by_name = _published_instances(published)
    variant = published.get("vllm_variant")
    pd = published.get("pd_role") != "none"
    facts = fabric if isinstance(fabric, Mapping) and "devices" in fabric else None
    out, problems = [], []
    for inst in instances:
        settings = (by_name.get(inst.get("name")) or {}).get("settings") or published.get("settings") or {}
        table, found = _rules().table(settings, variant, _bus_ids(inst.get("gpus"), gpus), facts)
        problems += [f"instance {inst.get('name')}: {p}" for p in found]
        out.append({**inst, "kv_fabric": table if pd else None})
    if problems:
        raise AnsibleFilterError(f"kv_fabric: {host + ': ' if host else ''}" + "; ".join(problems))
    return out


def kv_fabric_problems(fabric, published, require_nvidia_peermem=True):
    """What the host's fabric facts refuse for its PD instances (a list of messages, empty when none)."""
    by_name = _published_instances(published)
    if published.get("pd_role") == "none" or not isinstance(fabric, Mapping):
        return []
    instances = []
    for name, inst in by_name.items():
        source = (f"vllm_instance_instances[{name}].overrides.kv_transport"
                  if "kv_transport" in (inst.get("overrides") or {}) else "vllm_instance_kv_transport")
        instances.append((name, inst.get("settings") or published.get("settings") or {}, source))
    return _rules().host_problems(fabric, published.get("vllm_variant"), instances, bool(require_nvidia_peermem))


def kv_transport(published):
    """How a host's PD instances carry KV, ``rdma`` or ``tcp`` (its first instance's setting, ``auto`` resolved by
    the build; the PD preflight makes every instance agree)."""
    instances = list(_published_instances(published).values())
    settings = (instances[0].get("settings") if instances else None) or published.get("settings") or {}
    return _rules().transport(settings.get("kv_transport"), published.get("vllm_variant"))


class FilterModule:
    def filters(self):
        return {"kv_fabric": kv_fabric, "kv_fabric_problems": kv_fabric_problems, "kv_transport": kv_transport}
