# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Record the part of a GPU host's sysfs that inferops.vllm.rdma_fabric_facts reads, as a .tree text file.

    python3 scripts/record_fabric_sysfs.py [--root /sys] [--title "8x H100, 8x CX-7 NDR"] > host.tree

Run it on a real GPU host (read-only, no root needed, standard library only) and copy host.tree back: put it in
tests/unit/fixtures/sysfs/ and the unit tests build it into a directory and read it with the module, so the choice
of each GPU's nearest NICs on that host is tested here, without its hardware (docs/fabric.md). The format is
tests/unit/fixtures/sysfs/make_trees.py's: ``path = content`` lines and ``path -> target`` symbolic links.

What is recorded: every RDMA device of class/infiniband (its PCI link, NUMA node, network devices, ports' state,
physical state, link layer, rate, and the non-empty GIDs with their type and network device), every NVIDIA GPU of
bus/pci/devices (its link, vendor, class, NUMA node), the bonds of class/net (mode, slaves) and whether
module/nvidia_peermem is there. GIDs hold the host's IP addresses (as ::ffff:a.b.c.d): edit them before publishing
the file if they must not be seen.
"""

from __future__ import annotations

import argparse
import os
import sys


class Recorder:
    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root)
        self.files: dict[str, str] = {}
        self.links: dict[str, str] = {}

    def read(self, rel: str) -> str | None:
        try:
            with open(os.path.join(self.root, rel), encoding="utf-8", errors="replace") as handle:
                return handle.read().strip()
        except OSError:
            return None

    def listdir(self, rel: str) -> list[str]:
        try:
            return sorted(os.listdir(os.path.join(self.root, rel)))
        except OSError:
            return []

    def file(self, rel: str, recorded_as: str | None = None) -> str | None:
        value = self.read(rel)
        if value is not None:
            self.files[recorded_as or rel] = value.splitlines()[0] if value else ""
        return value

    def link(self, rel: str) -> str | None:
        """Record the link at ``rel`` as a link to where it resolves (relative to the root); that place's path."""
        real = os.path.realpath(os.path.join(self.root, rel))
        if not real.startswith(self.root + os.sep):
            return None
        target = os.path.relpath(real, self.root)
        self.links[rel] = os.path.relpath(target, os.path.dirname(rel))
        return target

    def pci_device(self, link: str) -> str | None:
        place = self.link(link)
        if place:
            for name in ("vendor", "class", "numa_node"):
                self.file(f"{place}/{name}")
        return place

    def record(self) -> None:
        for dev in self.listdir("class/infiniband"):
            base = f"class/infiniband/{dev}"
            place = self.pci_device(f"{base}/device")
            for netdev in self.listdir(f"{base}/device/net"):
                self.files[f"{place}/net/{netdev}/ifindex"] = self.read(f"{base}/device/net/{netdev}/ifindex") or "0"
            for port in self.listdir(f"{base}/ports"):
                pbase = f"{base}/ports/{port}"
                for name in ("state", "phys_state", "link_layer", "rate"):
                    self.file(f"{pbase}/{name}")
                for index in self.listdir(f"{pbase}/gids"):
                    gid = self.file(f"{pbase}/gids/{index}")
                    if gid and set(gid.replace(":", "")) != {"0"}:
                        self.file(f"{pbase}/gid_attrs/types/{index}")
                        self.file(f"{pbase}/gid_attrs/ndevs/{index}")
        for bdf in self.listdir("bus/pci/devices"):
            vendor = self.read(f"bus/pci/devices/{bdf}/vendor")
            pci_class = self.read(f"bus/pci/devices/{bdf}/class") or ""
            if vendor == "0x10de" and pci_class.startswith("0x03"):
                self.pci_device(f"bus/pci/devices/{bdf}")
        for netdev in self.listdir("class/net"):
            if os.path.isdir(os.path.join(self.root, "class/net", netdev, "bonding")):
                place = self.link(f"class/net/{netdev}")
                if place:
                    self.file(f"class/net/{netdev}/bonding/mode", f"{place}/bonding/mode")
                    self.file(f"class/net/{netdev}/bonding/slaves", f"{place}/bonding/slaves")
        if os.path.isdir(os.path.join(self.root, "module/nvidia_peermem")):
            self.files["module/nvidia_peermem/refcnt"] = self.read("module/nvidia_peermem/refcnt") or "0"

    def text(self, title: str) -> str:
        lines = [f"# {line}".rstrip() for line in title.strip().splitlines()]
        lines.append("# Recorded by scripts/record_fabric_sysfs.py (format: tests/unit/fixtures/sysfs/make_trees.py).")
        lines += [f"{path} = {content}" for path, content in sorted(self.files.items())]
        lines += [f"{path} -> {target}" for path, target in sorted(self.links.items())]
        return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--root", default="/sys", help="where sysfs is mounted (default /sys)")
    parser.add_argument("--title", default=os.uname().nodename, help="what the host is, for the file's header")
    options = parser.parse_args(argv)
    recorder = Recorder(options.root)
    recorder.record()
    sys.stdout.write(recorder.text(options.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
