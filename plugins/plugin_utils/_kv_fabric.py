# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""How an instance's KV travels to its peers: its ``[kv_fabric]`` table and the host facts it must agree with.

PRIVATE to the inferops.vllm collection: no compatibility promise. Controller-side: the vllm_instance role's
filters (plugins/filter/fabric.py) and the renderer of the instance TOML (_instance_toml.py) call it.

* :func:`transport` resolves ``vllm_instance_kv_transport`` (``auto`` = ``rdma`` on the cuda build, ``tcp`` on
  the cpu build);
* :func:`table` is the ``[kv_fabric]`` table of one instance: the transport, ``net_devices`` (UCX_NET_DEVICES: the
  RDMA ports nearest the instance's GPUs), ``tls`` (UCX_TLS by transport and KV buffer) and ``ib_gid_index``
  (UCX_IB_GID_INDEX, RoCE v2), each taken from the instance's own setting when one is set;
* :func:`host_problems` says what the host's fabric facts (the rdma_fabric_facts module) refuse before anything is
  changed: RDMA asked for where no RDMA port is active, GPUDirect RDMA without nvidia_peermem, a pinned port the host
  does not have.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ansible_collections.inferops.vllm.plugins.module_utils._rdma_fabric import normalise_bus_id
from ansible_collections.inferops.vllm.plugins.plugin_utils._pd_values import text

TRANSPORT_SETTINGS = ("auto", "rdma", "tcp")
# UCX_TLS when the instance sets none. RDMA: RC over mlx5 (rc_x) or verbs (rc, which also brings UD for the
# connection set-up), with CUDA copies and CUDA IPC (same-host peers) for GPU buffers; shared memory for host
# buffers. No tcp: a missing RDMA path then fails loudly instead of carrying KV at TCP speed. These are the lists
# people report for NIXL over InfiniBand and RoCE; nothing here measured them (docs/fabric.md). TCP: no list,
# UCX's own choice, which is what the sandbox's verified handoff ran with.
DEFAULT_TLS = {"cuda": "rc_x,rc,cuda_copy,cuda_ipc", "cpu": "rc_x,rc,sm,self"}


def transport(setting: Any, variant: Any) -> str:
    """``rdma`` or ``tcp`` for a ``kv_transport`` setting (``auto`` or empty: by the vLLM build)."""
    value = text(setting) or "auto"
    if value == "auto":
        return "tcp" if text(variant) == "cpu" else "rdma"
    return value


def gid_index_setting(value: Any) -> int | None:
    """An instance's ``ucx_ib_gid_index`` (-1, empty or null: read from the NIC), as an int or None."""
    if value is None or isinstance(value, bool) or text(value) == "":
        return None
    try:
        index = int(value)
    except (TypeError, ValueError):
        return None
    return index if index >= 0 else None


def _ports(fabric: Mapping[str, Any] | None) -> dict[str, Mapping[str, Any]]:
    devices = (fabric or {}).get("devices") or []
    return {p["ucx_device"]: p for d in devices for p in d.get("ports", []) if isinstance(p, Mapping)}


def nearest_for(gpu_bus_ids: Sequence[Any], fabric: Mapping[str, Any] | None) -> list[str]:
    """The nearest active RDMA ports of these GPUs (bus ids as nvidia-smi or sysfs gives them), each once, in the
    GPUs' order."""
    by_bus = {g.get("pci_bus_id"): g for g in (fabric or {}).get("gpus") or []}
    ports: list[str] = []
    for bus_id in gpu_bus_ids:
        for port in (by_bus.get(normalise_bus_id(bus_id)) or {}).get("nearest_ports") or []:
            if port not in ports:
                ports.append(port)
    return ports


def table(settings: Mapping[str, Any], variant: Any, gpu_bus_ids: Sequence[Any] = (),
          fabric: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], list[str]]:
    """``([kv_fabric] table, problems)`` of one instance.

    ``settings``: the instance's resolved settings (kv_transport, kv_buffer_device, ucx_net_devices, ucx_tls,
    ucx_ib_gid_index); ``gpu_bus_ids``: its GPUs' PCI bus ids; ``fabric``: the host's rdma_fabric facts, or None
    where they are not known (the preflight's render, which then writes only what the settings say).
    """
    kind = transport(settings.get("kv_transport"), variant)
    result: dict[str, Any] = {"transport": kind}
    problems: list[str] = []
    devices, tls = text(settings.get("ucx_net_devices")), text(settings.get("ucx_tls"))
    gid_index = gid_index_setting(settings.get("ucx_ib_gid_index"))
    if kind == "rdma":
        chosen = devices.split(",") if devices else nearest_for(gpu_bus_ids, fabric)
        if not devices and chosen:
            devices = ",".join(chosen)
        if gid_index is None and fabric is not None:
            ports = _ports(fabric)
            indexes = sorted({ports[p].get("roce_v2_gid_index") for p in chosen if p in ports} - {None})
            if len(indexes) == 1:
                gid_index = indexes[0]
            elif len(indexes) > 1:
                problems.append(
                    f"the RDMA ports {', '.join(chosen)} have their RoCE v2 GIDs at different indexes "
                    f"({', '.join(map(str, indexes))}) and UCX takes one UCX_IB_GID_INDEX: set ucx_ib_gid_index, or "
                    "give the instance GPUs whose NICs agree")
        tls = tls or DEFAULT_TLS.get(text(settings.get("kv_buffer_device")) or "cuda", DEFAULT_TLS["cuda"])
    if devices:
        result["net_devices"] = devices
    if tls:
        result["tls"] = tls
    if gid_index is not None:
        result["ib_gid_index"] = gid_index
    return result, problems


def host_problems(fabric: Mapping[str, Any], variant: Any, instances: Sequence[tuple[str, Mapping[str, Any], str]],
                  require_peermem: bool = True) -> list[str]:
    """What the host's fabric facts refuse, one message per problem.

    ``instances``: ``(name, resolved settings, where the transport comes from)`` of each PD instance of the host.
    """
    problems = []
    ports = _ports(fabric)
    active = [name for name, port in ports.items() if port.get("active")]
    for name, settings, source in instances:
        kind = transport(settings.get("kv_transport"), variant)
        if kind != "rdma":
            continue
        asked = text(settings.get("kv_transport")) or "auto"
        why = f"{source} is {asked}" + (f" on a {text(variant) or 'cuda'} build" if asked == "auto" else "")
        if not active:
            problems.append(
                f"instance {name}: KV would travel over RDMA ({why}), but the host has no active RDMA port: "
                f"{fabric.get('reason') or 'none found'}. Without RDMA, UCX carries the KV over TCP, silently and "
                "about a hundred times slower. Fix: bring an RDMA port up (docs/fabric.md: ibv_devinfo, ucx_info -d), "
                "or set vllm_instance_kv_transport: tcp where TCP is meant.")
            continue
        if text(settings.get("kv_buffer_device")) in ("", "cuda") and require_peermem \
                and not fabric.get("nvidia_peermem_loaded"):
            problems.append(
                f"instance {name}: GPUDirect RDMA (KV staged in GPU memory, kv_buffer_device cuda, sent over RDMA) "
                "needs the nvidia_peermem kernel module, which is not loaded. Fix: load it at boot (the nvidia_driver "
                "role's nvidia_driver_peermem: true, or modprobe nvidia-peermem), or set "
                "vllm_instance_require_nvidia_peermem: false where GPU memory is registered through DMA-BUF instead, "
                "or vllm_instance_kv_buffer_device: cpu.")
        pinned = [d for d in text(settings.get("ucx_net_devices")).split(",") if ":" in d]
        missing = [d for d in pinned if d not in ports]
        down = [d for d in pinned if d in ports and not ports[d].get("active")]
        if missing or down:
            parts = ([f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not an RDMA port of this host"]
                     if missing else []) + ([f"{', '.join(down)} {'is' if len(down) == 1 else 'are'} not ACTIVE"]
                                            if down else [])
            problems.append(
                f"instance {name}: ucx_net_devices pins {', '.join(pinned)}, but {' and '.join(parts)} (active "
                f"ports: {', '.join(active)}). Fix: name active ports, or leave ucx_net_devices empty for the "
                "ports nearest the instance's GPUs.")
    return problems
