#!/usr/bin/python
# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: rdma_fabric_facts
short_description: Gather a host's RDMA ports, their PCIe place and the NICs nearest each NVIDIA GPU, from sysfs
version_added: 0.1.0
description:
  - Reads the RDMA devices of C(/sys/class/infiniband) and, for each port, its state, physical state, link layer
    (C(InfiniBand), or C(Ethernet) for RoCE), rate, and on RoCE ports the GID index of a RoCE v2 GID (what
    E(UCX_IB_GID_INDEX) needs) and the network device behind it, with its bonding mode and slaves when it is a bond.
  - Reads where each RDMA device and each NVIDIA GPU (PCI vendor C(0x10de), display class) sits on PCIe from the
    resolved C(/sys/bus/pci/devices) paths and their C(numa_node), and picks each GPU's nearest active RDMA ports
    (RV(gpus[].nearest_ports)), those below the same PCIe switch, else at the same PCIe host bridge, else on the
    same NUMA node, else every active port. Ties keep every port of the nearest class.
  - Tells whether the C(nvidia_peermem) kernel module (GPUDirect RDMA through the NIC) is loaded, from
    C(/sys/module/nvidia_peermem).
  - Runs no command (no C(ibv_devinfo), C(nvidia-smi) or C(lspci)), so it works where the RDMA user-space
    tools are not installed, and on a recorded copy of sysfs (O(sysfs_root)).
  - A host without RDMA device is not an error; the module then says so in RV(reason).
  - Sets the fact C(rdma_fabric), which holds everything the module returns except C(changed).
author:
  - inferops.vllm developers (@inferops)
extends_documentation_fragment:
  - inferops.vllm.attributes
  - inferops.vllm.attributes.facts
attributes:
  check_mode:
    support: full
    details:
      - The module only reads files, so it does the same in check mode.
  diff_mode:
    support: none
  facts:
    support: full
options:
  sysfs_root:
    description:
      - Where sysfs is mounted. Another directory holds a recorded copy of a host's sysfs (the unit tests use them).
    type: path
    default: /sys
notes:
  - The nearest NICs follow the same PCIe paths as C(nvidia-smi topo -m) (C(PIX)/C(PXB) = V(pcie_switch),
    C(PHB) = V(host_bridge), C(NODE) = V(numa_node), C(SYS) = V(system)); compare them on a new host.
  - A C(numa_node) of V(-1) (one-socket hosts, many VMs) counts as the same NUMA node as any other.
  - In a container sysfs shows the whole machine's devices; the RDMA devices listed may not be usable inside it.
seealso:
  - module: inferops.vllm.nvidia_gpu_facts
  - name: The kernel's InfiniBand sysfs ABI
    description: The files under C(/sys/class/infiniband) this module reads.
    link: https://www.kernel.org/doc/Documentation/ABI/stable/sysfs-class-infiniband
"""

EXAMPLES = r"""
- name: Read the GPU fabric
  inferops.vllm.rdma_fabric_facts:
  register: fabric

- name: Show each GPU's nearest RDMA ports
  ansible.builtin.debug:
    msg: "{{ fabric.gpus | items2dict(key_name='pci_bus_id', value_name='nearest_ports') }}"

- name: Read a recorded sysfs tree
  inferops.vllm.rdma_fabric_facts:
    sysfs_root: /tmp/gpu-host-sysfs
"""

RETURN = r"""
devices:
  description: The RDMA devices of C(/sys/class/infiniband), by name.
  returned: always
  type: list
  elements: dict
  contains:
    name:
      description: Device name.
      type: str
      sample: mlx5_0
    pci_bus_id:
      description: PCI bus id of the device (for a bond, of its first function); V(null) for a virtual device.
      type: str
      sample: "0000:19:00.0"
    host_bridge:
      description: The PCIe host bridge above it (C(pciDDDD:BB)), V(null) for a virtual device.
      type: str
      sample: pci0000:15
    pci_chain:
      description: The PCI functions from the root port down to the device.
      type: list
      elements: str
      sample: ["0000:15:01.0", "0000:16:00.0", "0000:17:01.0", "0000:19:00.0"]
    numa_node:
      description: NUMA node of the device, V(-1) when the platform gives none, V(null) when not shown.
      type: int
      sample: 0
    netdevs:
      description: Network devices of the device's PCI function.
      type: list
      elements: str
      sample: ["ens1f0np0"]
    ports:
      description: The device's ports.
      type: list
      elements: dict
      contains:
        port:
          description: Port number.
          type: int
          sample: 1
        ucx_device:
          description: The port as E(UCX_NET_DEVICES) names it.
          type: str
          sample: mlx5_0:1
        state:
          description: Logical state (C(ACTIVE), C(INIT), C(DOWN), ...).
          type: str
          sample: ACTIVE
        phys_state:
          description: Physical state (C(LinkUp), C(Disabled), C(Polling), ...).
          type: str
          sample: LinkUp
        active:
          description: Whether the port is C(ACTIVE) and can carry RDMA.
          type: bool
          sample: true
        link_layer:
          description: V(InfiniBand), or V(Ethernet) (RoCE).
          type: str
          sample: InfiniBand
        rate_gbps:
          description: Link rate in Gb/s, V(null) when not shown.
          type: float
          sample: 400.0
        roce_v2_gid_index:
          description:
            - On a RoCE port, the GID index to give E(UCX_IB_GID_INDEX) (the lowest RoCE v2 GID holding an IPv4
              address, else the lowest routable RoCE v2 GID); V(null) on InfiniBand or without RoCE v2 GID.
          type: int
          sample: 3
        netdev:
          description: The network device of that GID (RoCE), else the device's first network device.
          type: str
          sample: bond0
        bond:
          description: When RV(devices[].ports[].netdev) is a bond, its mode and slaves; else V(null).
          type: dict
          sample: {"name": "bond0", "mode": "802.3ad", "slaves": ["ens1f0np0", "ens1f1np1"]}
active_ports:
  description: Every active RDMA port, as E(UCX_NET_DEVICES) names it.
  returned: always
  type: list
  elements: str
  sample: ["mlx5_0:1", "mlx5_1:1"]
fabric:
  description: V(infiniband), V(roce), V(mixed) (both link layers active) or V(none) (no active RDMA port).
  returned: always
  type: str
  sample: infiniband
gpus:
  description: The NVIDIA GPUs on PCIe (whether a driver is loaded or not) and their nearest active RDMA ports.
  returned: always
  type: list
  elements: dict
  contains:
    pci_bus_id:
      description: PCI bus id of the GPU (compare C(nvidia_gpus[].pci_bus_id) after lowering it and cutting its
        domain to four digits).
      type: str
      sample: "0000:18:00.0"
    host_bridge:
      description: The PCIe host bridge above it.
      type: str
      sample: pci0000:15
    pci_chain:
      description: The PCI functions from the root port down to the GPU.
      type: list
      elements: str
      sample: ["0000:15:01.0", "0000:16:00.0", "0000:17:00.0", "0000:18:00.0"]
    numa_node:
      description: NUMA node of the GPU.
      type: int
      sample: 0
    nearest_ports:
      description: Its nearest active RDMA ports (empty when the host has none).
      type: list
      elements: str
      sample: ["mlx5_0:1"]
    affinity:
      description: How near they are, V(pcie_switch), V(host_bridge), V(numa_node) or V(system); V(null) without ports.
      type: str
      sample: pcie_switch
bonds:
  description: The host's bonding devices, their mode and slaves.
  returned: always
  type: dict
  sample: {"bond0": {"mode": "802.3ad", "slaves": ["ens1f0np0", "ens1f1np1"]}}
nvidia_peermem_loaded:
  description: Whether the C(nvidia_peermem) kernel module is loaded (GPUDirect RDMA over the NIC).
  returned: always
  type: bool
  sample: true
reason:
  description: Why no RDMA port can carry KV (no RDMA device, no active port); V(null) when one can.
  returned: always
  type: str
  sample: no RDMA device in /sys/class/infiniband (no RDMA NIC, or its driver is not loaded)
ansible_facts:
  description: Facts to add to the host's facts.
  returned: always
  type: dict
  contains:
    rdma_fabric:
      description: Everything above.
      type: dict
      sample: {"fabric": "none", "active_ports": [], "devices": [], "gpus": [], "bonds": {},
               "nvidia_peermem_loaded": false, "reason": "no RDMA device in /sys/class/infiniband"}
"""

import os  # noqa: E402 (imports follow the documentation, as Ansible modules do)

from ansible.module_utils.basic import AnsibleModule  # noqa: E402
from ansible_collections.inferops.vllm.plugins.module_utils._rdma_fabric import (  # noqa: E402
    ACTIVE,
    ETHERNET,
    fabric_kind,
    nearest_ports,
    normalise_bus_id,
    pci_place,
    port_state,
    rate_gbps,
    roce_v2_gid_index,
)


class SysfsReader:
    """Reads the files under one sysfs root; a file that is missing or unreadable reads as None."""

    def __init__(self, root):
        self.root = os.path.realpath(root)

    def path(self, *parts):
        return os.path.join(self.root, *parts)

    def read(self, *parts):
        try:
            with open(self.path(*parts), encoding="utf-8", errors="replace") as handle:
                return handle.read().strip()
        except OSError:  # EINVAL on empty GID entries' attributes, ENOENT on older kernels
            return None

    def listdir(self, *parts):
        try:
            return sorted(os.listdir(self.path(*parts)))
        except OSError:
            return []

    def place(self, *parts):
        """(host_bridge, pci_chain) of the device a sysfs link points at, its path taken relative to the root."""
        real = os.path.realpath(self.path(*parts))
        return pci_place(os.path.relpath(real, self.root))

    def integer(self, *parts):
        try:
            return int(self.read(*parts))
        except (TypeError, ValueError):
            return None


def _bond(sysfs, netdev):
    if not netdev or not os.path.isdir(sysfs.path("class", "net", netdev, "bonding")):
        return None
    mode = (sysfs.read("class", "net", netdev, "bonding", "mode") or "").split()
    slaves = (sysfs.read("class", "net", netdev, "bonding", "slaves") or "").split()
    return {"name": netdev, "mode": mode[0] if mode else None, "slaves": slaves}


def _gids(sysfs, base):
    gids = []
    for entry in sysfs.listdir(*base, "gids"):
        if not entry.isdigit():
            continue
        gid = sysfs.read(*base, "gids", entry)
        if not gid or set(gid.replace(":", "")) == {"0"}:
            continue
        gids.append({"index": int(entry), "gid": gid,
                     "type": sysfs.read(*base, "gid_attrs", "types", entry),
                     "netdev": sysfs.read(*base, "gid_attrs", "ndevs", entry)})
    return gids


def read_port(sysfs, device, port, netdevs):
    base = ("class", "infiniband", device, "ports", port)
    state = port_state(sysfs.read(*base, "state"))
    link_layer = sysfs.read(*base, "link_layer")
    gid_index, netdev = None, (netdevs[0] if netdevs else None)
    if link_layer == ETHERNET:
        gids = _gids(sysfs, base)
        gid_index = roce_v2_gid_index(gids)
        chosen = [g for g in gids if g["index"] == gid_index]
        if chosen and chosen[0]["netdev"]:
            netdev = chosen[0]["netdev"]
    return {
        "port": int(port),
        "ucx_device": f"{device}:{port}",
        "state": state,
        "phys_state": port_state(sysfs.read(*base, "phys_state")),
        "active": state == ACTIVE,
        "link_layer": link_layer,
        "rate_gbps": rate_gbps(sysfs.read(*base, "rate")),
        "roce_v2_gid_index": gid_index,
        "netdev": netdev,
        "bond": _bond(sysfs, netdev),
    }


def read_devices(sysfs):
    devices = []
    for name in sysfs.listdir("class", "infiniband"):
        host_bridge, chain = sysfs.place("class", "infiniband", name, "device")
        netdevs = sysfs.listdir("class", "infiniband", name, "device", "net")
        ports = sorted((p for p in sysfs.listdir("class", "infiniband", name, "ports") if p.isdigit()), key=int)
        devices.append({
            "name": name,
            "pci_bus_id": chain[-1] if chain else None,
            "host_bridge": host_bridge,
            "pci_chain": chain,
            "numa_node": sysfs.integer("class", "infiniband", name, "device", "numa_node"),
            "netdevs": netdevs,
            "ports": [read_port(sysfs, name, port, netdevs) for port in ports],
        })
    return devices


def read_gpus(sysfs):
    """The NVIDIA GPUs on PCIe: vendor 0x10de, class 0x0300 (VGA) or 0x0302 (3D controller, data-centre GPUs)."""
    nvidia_vendor, gpu_classes = 0x10DE, (0x0300, 0x0302)
    gpus = []
    for entry in sysfs.listdir("bus", "pci", "devices"):
        try:
            vendor = int(sysfs.read("bus", "pci", "devices", entry, "vendor") or "", 16)
            pci_class = int(sysfs.read("bus", "pci", "devices", entry, "class") or "", 16) >> 8
        except ValueError:
            continue
        if vendor != nvidia_vendor or pci_class not in gpu_classes:
            continue
        host_bridge, chain = sysfs.place("bus", "pci", "devices", entry)
        gpus.append({
            "pci_bus_id": normalise_bus_id(entry),
            "host_bridge": host_bridge,
            "pci_chain": chain or [normalise_bus_id(entry)],
            "numa_node": sysfs.integer("bus", "pci", "devices", entry, "numa_node"),
        })
    return gpus


def gather(root):
    """Everything the module returns (without ``changed``), read from the sysfs at ``root``."""
    sysfs = SysfsReader(root)
    devices = read_devices(sysfs)
    gpus = read_gpus(sysfs)
    chosen = nearest_ports(gpus, devices)
    for gpu in gpus:
        gpu["nearest_ports"] = chosen[gpu["pci_bus_id"]]["ports"]
        gpu["affinity"] = chosen[gpu["pci_bus_id"]]["affinity"]
    ports = [port for device in devices for port in device["ports"]]
    active = [port["ucx_device"] for port in ports if port["active"]]
    reason = None
    if not devices:
        reason = ("no RDMA device in /sys/class/infiniband (no RDMA NIC, or its driver (mlx5_ib, ...) is not "
                  "loaded): KV can only travel over TCP")
    elif not active:
        states = ", ".join(f"{p['ucx_device']} {p['state'] or '?'}/{p['phys_state'] or '?'}" for p in ports)
        reason = f"no RDMA port is ACTIVE ({states or 'no ports'}): check cables, the subnet manager (InfiniBand) " \
                 "or the switch port (RoCE)"
    bonds = {}
    for netdev in sysfs.listdir("class", "net"):
        bond = _bond(sysfs, netdev)
        if bond:
            bonds[netdev] = {"mode": bond["mode"], "slaves": bond["slaves"]}
    return {
        "devices": devices,
        "active_ports": active,
        "fabric": fabric_kind(ports),
        "gpus": gpus,
        "bonds": bonds,
        "nvidia_peermem_loaded": os.path.isdir(sysfs.path("module", "nvidia_peermem")),
        "reason": reason,
    }


def main():
    module = AnsibleModule(argument_spec=dict(sysfs_root=dict(type="path", default="/sys")), supports_check_mode=True)
    root = module.params["sysfs_root"]
    if not os.path.isdir(root):
        module.fail_json(msg=f"sysfs_root {root} is not a directory")
    facts = gather(root)
    module.exit_json(changed=False, ansible_facts={"rdma_fabric": facts}, **facts)


if __name__ == "__main__":
    main()
