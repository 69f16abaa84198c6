# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The GPU fabric of a host, from sysfs: RDMA ports, their PCIe place, and which NICs are nearest each GPU.

PRIVATE to the inferops.vllm collection: no compatibility promise. Used by the rdma_fabric_facts module on the
host (which reads the files) and by the fabric filters on the controller (which read its facts).

Everything here works on plain data, so that the choice can be unit tested without a GPU or an RDMA NIC:

* :func:`normalise_bus_id` makes nvidia-smi's ``00000000:1B:00.0`` and sysfs's ``0000:1b:00.0`` comparable;
* :func:`pci_place` reads a device's resolved sysfs path (``/sys/devices/pci0000:15/0000:15:01.0/.../0000:18:00.0``)
  into its host bridge and the chain of PCI functions above it;
* :func:`affinity` says how far a GPU is from a NIC, as ``nvidia-smi topo -m`` does in fewer words;
* :func:`nearest_ports` picks each GPU's nearest active RDMA ports (same PCIe switch, else same host bridge, else
  same NUMA node, else every active port);
* :func:`roce_v2_gid_index` picks the GID index UCX needs on a RoCE port (``UCX_IB_GID_INDEX``).
"""

from __future__ import annotations

import re

# A PCI function as sysfs names it: domain:bus:device.function.
_BDF = re.compile(r"^([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")
# A PCI host bridge (root complex) directory under /sys/devices: pci<domain>:<bus>.
_HOST_BRIDGE = re.compile(r"^pci[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}$")

# How near a GPU and a NIC are, nearest first. nvidia-smi topo -m's legend, for comparison:
#   pcie_switch  PIX or PXB: they meet below a PCIe bridge (a switch), the traffic never reaches the CPU;
#   host_bridge  PHB: they meet at the same PCIe host bridge (the CPU's root complex);
#   numa_node    NODE: different host bridges of one NUMA node;
#   system       SYS: across the CPUs' interconnect (another NUMA node).
AFFINITIES = ("pcie_switch", "host_bridge", "numa_node", "system")

# Port states of /sys/class/infiniband/*/ports/*/state ("4: ACTIVE").
ACTIVE = "ACTIVE"
# Link layers of /sys/class/infiniband/*/ports/*/link_layer.
INFINIBAND = "InfiniBand"
ETHERNET = "Ethernet"
# GID types of /sys/class/infiniband/*/ports/*/gid_attrs/types/N.
ROCE_V2 = "RoCE v2"

_ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
_IPV4_MAPPED_GID = re.compile(r"^0000:0000:0000:0000:0000:ffff:[0-9a-f]{4}:[0-9a-f]{4}$")
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*Gb/sec")


def normalise_bus_id(bus_id):
    """``00000000:1B:00.0`` (nvidia-smi) or ``0000:1b:00.0`` (sysfs) -> ``0000:1b:00.0``; None if it is not one."""
    match = _BDF.match(str(bus_id or "").strip())
    if not match:
        return None
    domain, bus, device, function = match.groups()
    return f"{int(domain, 16):04x}:{bus.lower()}:{device.lower()}.{function}"


def pci_place(real_path):
    """``(host_bridge, chain)`` of a device from its resolved sysfs path.

    ``chain`` lists the PCI functions from the root port down to the device itself (normalised bus ids);
    ``host_bridge`` is the ``pciDDDD:BB`` directory above them. Both None/empty for a path that is not under a
    PCI host bridge (a virtual device).
    """
    host_bridge, chain = None, []
    for part in str(real_path or "").split("/"):
        if _HOST_BRIDGE.match(part):
            host_bridge, chain = part.lower(), []
        elif host_bridge is not None:
            bus_id = normalise_bus_id(part)
            if bus_id is None:
                break  # below the device: net/, infiniband/ ...
            chain.append(bus_id)
    return (host_bridge, chain) if chain else (None, [])


def _same_numa(a, b):
    # -1 (no NUMA information, as on one-socket hosts and many VMs) counts as the same node.
    return a is None or b is None or a < 0 or b < 0 or a == b


def affinity(gpu, nic):
    """How near a GPU and a NIC are (one of AFFINITIES). Each is a dict with ``host_bridge``, ``pci_chain`` and
    ``numa_node``, as the rdma_fabric_facts module returns them."""
    gpu_up, nic_up = list(gpu.get("pci_chain") or [])[:-1], list(nic.get("pci_chain") or [])[:-1]
    if gpu.get("host_bridge") and gpu.get("host_bridge") == nic.get("host_bridge"):
        # Any bridge above both (a root port has one link, so a shared one means a switch below it).
        if gpu_up and nic_up and gpu_up[0] == nic_up[0]:
            return "pcie_switch"
        return "host_bridge"
    if _same_numa(gpu.get("numa_node"), nic.get("numa_node")):
        return "numa_node"
    return "system"


def port_state(text):
    """``4: ACTIVE`` -> ``ACTIVE``; ``5: LinkUp`` -> ``LinkUp``; None for nothing."""
    text = str(text or "").strip()
    if not text:
        return None
    return text.split(":", 1)[1].strip() if ":" in text else text


def rate_gbps(text):
    """``200 Gb/sec (4X HDR)`` -> 200.0; None when not shown."""
    match = _RATE.match(str(text or ""))
    return float(match.group(1)) if match else None


def roce_v2_gid_index(gids):
    """The GID index for UCX_IB_GID_INDEX on a RoCE port, or None when the port has no RoCE v2 GID.

    ``gids`` lists ``{"index": int, "gid": str, "type": str, "netdev": str}`` (gids/N, gid_attrs/types/N and
    gid_attrs/ndevs/N). Preferred, as NVIDIA's show_gids points at: the lowest RoCE v2 entry holding an IPv4
    address (``::ffff:a.b.c.d``, routable across subnets), else the lowest RoCE v2 entry that is not link-local,
    else the lowest RoCE v2 entry at all. Empty entries (all zeros) are never chosen.
    """
    v2 = sorted(
        (g for g in gids if g.get("type") == ROCE_V2 and (g.get("gid") or _ZERO_GID).lower() != _ZERO_GID),
        key=lambda g: g["index"],
    )
    for accept in (
        lambda g: _IPV4_MAPPED_GID.match(g["gid"].lower()),
        lambda g: not g["gid"].lower().startswith("fe80:"),
        lambda g: True,
    ):
        for gid in v2:
            if accept(gid):
                return gid["index"]
    return None


def nearest_ports(gpus, devices):
    """Each GPU's nearest active RDMA ports.

    ``gpus``: dicts with ``pci_bus_id``, ``host_bridge``, ``pci_chain`` and ``numa_node``; ``devices``: the RDMA
    devices, each with the same place keys and ``ports`` (dicts with ``ucx_device`` and ``active``). Returns
    ``{gpu bus id: {"ports": [ucx device, ...], "affinity": one of AFFINITIES or None}}``: the active ports of the
    nearest class (all of them on a tie: two ports of one switch, or the two NICs of a NUMA node), in device and
    port order; no ports and affinity None when the host has no active RDMA port.
    """
    active = [(dev, port) for dev in devices for port in dev.get("ports", []) if port.get("active")]
    chosen = {}
    for gpu in gpus:
        best, ports = None, []
        for dev, port in active:
            rank = AFFINITIES.index(affinity(gpu, dev))
            if best is None or rank < best:
                best, ports = rank, [port["ucx_device"]]
            elif rank == best:
                ports.append(port["ucx_device"])
        chosen[gpu["pci_bus_id"]] = {"ports": ports, "affinity": AFFINITIES[best] if best is not None else None}
    return chosen


def fabric_kind(ports):
    """``infiniband``, ``roce``, ``mixed`` (both link layers active) or ``none`` for a set of RDMA ports."""
    layers = {p.get("link_layer") for p in ports if p.get("active")}
    if not layers:
        return "none"
    if layers == {INFINIBAND}:
        return "infiniband"
    if layers == {ETHERNET}:
        return "roce"
    return "mixed"
