#!/usr/bin/python
# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: nvidia_gpu_facts
short_description: Gather the NVIDIA GPUs of a host, their driver, CUDA version and NVLink/NVSwitch topology
version_added: 0.1.0
description:
  - Lists the host's NVIDIA GPUs with
    C(nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.used,driver_version,mig.mode.current,pci.bus_id
    --format=csv,noheader,nounits).
  - Reads the CUDA version that the driver supports from the header of plain C(nvidia-smi)
    (C(CUDA Version), or C(CUDA UMD Version) from driver 610 on).
  - Reads the GPU-to-GPU links from the matrix of C(nvidia-smi topo -m) when O(topology) is on. A failure of that
    command only leaves RV(topology) V(null).
  - "Detects NVSwitch from two signs: C(/dev/nvidia-nvswitch0), C(/dev/nvidia-nvswitch1), ... device nodes, which the
    driver creates on NVSwitch boards (HGX/DGX A100, H100, H200), and the topology: a GPU whose NVLink counts to its
    peers add up to more than 18 (the most NVLink links one GPU has) reaches them through a switch, as on 8-GPU
    boards (7 x C(NV12) or 7 x C(NV18)). C(lspci) and C(nvidia-smi nvlink) are not used."
  - "Also reads the PCI devices from sysfs (C(/sys/bus/pci/devices/*/vendor) and C(class)), which needs no driver:
    NVIDIA (vendor C(0x10de)) display controllers are listed in RV(pci_gpus) and NVIDIA devices of class
    C(0x0680) (bridge, as NVSwitch chips report themselves) in RV(pci_nvswitches), which is also evidence of an
    NVSwitch. This is how a host without driver is known to need fabric manager."
  - A host without C(nvidia-smi), with a driver that is installed but not loaded (or whose kernel module does not match
    the installed driver), or without usable GPU is not an error; the module then returns no GPUs and says why in
    RV(reason).
  - Sets the facts C(nvidia_gpus), C(nvidia_driver_version) and C(nvidia_cuda_version).
author:
  - inferops.vllm developers (@inferops)
extends_documentation_fragment:
  - inferops.vllm.attributes
  - inferops.vllm.attributes.facts
attributes:
  check_mode:
    support: full
    details:
      - The module only runs read-only C(nvidia-smi) queries, so it does the same in check mode.
  diff_mode:
    support: none
  facts:
    support: full
options:
  nvidia_smi_path:
    description:
      - Path of C(nvidia-smi).
      - By default it is looked up in E(PATH), C(/usr/bin), C(/usr/local/bin) and C(/usr/local/nvidia/bin)
        (where the NVIDIA container runtime mounts it); when it is not found, the host has no GPUs.
      - A path that is given but is no executable file is an error.
    type: path
  topology:
    description:
      - Whether to read the GPU-to-GPU links with C(nvidia-smi topo -m).
    type: bool
    default: true
notes:
  - The indices are those of C(nvidia-smi) (PCI bus order). CUDA numbers GPUs the same way only with
    E(CUDA_DEVICE_ORDER=PCI_BUS_ID) or on hosts with identical GPUs; the UUIDs are the same for both.
  - Only whole GPUs are listed. MIG instances of a GPU with MIG enabled are not.
  - In a container, sysfs shows the PCI devices of the whole machine, so RV(pci_gpus) can list GPUs that the
    container cannot use.
  - A host that sees only one or two GPUs of an NVSwitch board (for example a VM) and has no
    C(/dev/nvidia-nvswitch*) device nodes is not recognised as an NVSwitch host.
seealso:
  - name: nvidia-smi documentation
    description: The options and output of C(nvidia-smi).
    link: https://docs.nvidia.com/deploy/nvidia-smi/index.html
  - plugin: inferops.vllm.gpu_assign
    plugin_type: filter
"""

EXAMPLES = r"""
- name: Gather the GPUs of the vLLM hosts
  inferops.vllm.nvidia_gpu_facts:
  register: gpu_facts

- name: Stop on a host whose driver is not loaded
  ansible.builtin.assert:
    that: gpu_facts.driver_loaded or gpu_facts.nvidia_smi is none
    fail_msg: "{{ gpu_facts.reason }}"

- name: Show GPUs, driver and CUDA version
  ansible.builtin.debug:
    msg: >-
      {{ ansible_facts.nvidia_gpus | map(attribute='name') | list }} with driver
      {{ ansible_facts.nvidia_driver_version }} (CUDA {{ ansible_facts.nvidia_cuda_version }}),
      NVSwitch: {{ gpu_facts.nvswitch }}

- name: Skip the topology, use an nvidia-smi outside PATH
  inferops.vllm.nvidia_gpu_facts:
    nvidia_smi_path: /opt/nvidia/bin/nvidia-smi
    topology: false
"""

RETURN = r"""
gpus:
  description: The GPUs, in the order of their index; empty without usable NVIDIA GPU.
  returned: always
  type: list
  elements: dict
  contains:
    index:
      description: Index of the GPU in C(nvidia-smi).
      type: int
      sample: 0
    uuid:
      description: UUID of the GPU.
      type: str
      sample: GPU-b42dd28e-ffdd-8720-1df0-98bd8cdc05b1
    name:
      description: Product name.
      type: str
      sample: NVIDIA H100 80GB HBM3
    memory_total_mib:
      description: Total memory in MiB, V(null) if not reported.
      type: int
      sample: 81559
    memory_used_mib:
      description: Used memory in MiB, V(null) if not reported (some GPUs with MIG enabled).
      type: int
      sample: 1
    driver_version:
      description: Version of the NVIDIA driver.
      type: str
      sample: 565.57.01
    mig_mode:
      description: V(enabled) or V(disabled), V(null) for GPUs without MIG support.
      type: str
      sample: disabled
    pci_bus_id:
      description: PCI bus id (domain:bus:device.function).
      type: str
      sample: "00000000:18:00.0"
gpu_count:
  description: Number of GPUs in RV(gpus).
  returned: always
  type: int
  sample: 8
driver_loaded:
  description:
    - Whether C(nvidia-smi) could talk to a loaded NVIDIA driver.
    - V(false) without C(nvidia-smi) and when the driver is installed but not loaded or does not match
      the loaded kernel module; V(true) when the driver answered, even if it saw no GPU.
  returned: always
  type: bool
  sample: true
driver_version:
  description: Version of the NVIDIA driver, V(null) when no GPU was listed.
  returned: always
  type: str
  sample: 565.57.01
cuda_version:
  description: Newest CUDA version the driver supports, from the header of C(nvidia-smi); V(null) if not shown.
  returned: always
  type: str
  sample: "12.7"
nvidia_smi:
  description: Path of the C(nvidia-smi) that was used, V(null) when none was found.
  returned: always
  type: str
  sample: /usr/bin/nvidia-smi
reason:
  description: Why RV(gpus) is empty (no C(nvidia-smi), driver not loaded, no GPU); V(null) when GPUs were found.
  returned: always
  type: str
  sample: >-
    the NVIDIA driver is installed but not loaded (load the nvidia kernel module or reboot); nvidia-smi (rc=9) said:
    NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the latest NVIDIA
    driver is installed and running.
topology:
  description:
    - "The links between GPUs from C(nvidia-smi topo -m), as C({gpu index: {peer index: link}}) (indices as strings)."
    - Links are C(NV#) (# bonded NVLinks), C(PIX), C(PXB), C(PHB), C(NODE) or C(SYS) (PCIe paths, from nearest to
      farthest).
    - V(null) when O(topology=false), without GPUs, or when C(nvidia-smi topo -m) failed or printed no matrix.
  returned: always
  type: dict
  sample: {"0": {"1": "NV18"}, "1": {"0": "NV18"}}
nvlink_all_to_all:
  description: Whether every pair of GPUs is linked by NVLink (V(false) for one GPU); V(null) without RV(topology).
  returned: always
  type: bool
  sample: true
nvswitch:
  description: Whether the GPUs are connected through NVSwitch (see RV(nvswitch_evidence)).
  returned: always
  type: bool
  sample: true
nvswitch_evidence:
  description: What showed the NVSwitch, the C(/dev/nvidia-nvswitch*) device nodes found, V(topology) and/or V(pci).
  returned: always
  type: list
  elements: str
  sample: ["/dev/nvidia-nvswitch0", "/dev/nvidia-nvswitch1", "topology", "pci"]
pci_gpus:
  description: PCI bus ids of the NVIDIA GPUs found in sysfs, whether or not a driver is loaded.
  returned: always
  type: list
  elements: str
  sample: ["0000:18:00.0", "0000:2a:00.0"]
pci_nvswitches:
  description: PCI bus ids of the NVIDIA bridge devices (NVSwitch chips) found in sysfs.
  returned: always
  type: list
  elements: str
  sample: ["0000:05:00.0", "0000:06:00.0"]
ansible_facts:
  description: Facts to add to the host's facts.
  returned: always
  type: dict
  contains:
    nvidia_gpus:
      description: The same list as RV(gpus).
      type: list
      elements: dict
      sample: [{"index": 0, "uuid": "GPU-453f8851-d1a3-e72d-4d85-3ef04418205b", "name": "NVIDIA L4",
                "memory_total_mib": 23034, "memory_used_mib": 1, "driver_version": "550.90.07", "mig_mode": null,
                "pci_bus_id": "00000000:01:00.0"}]
    nvidia_driver_version:
      description: The same as RV(driver_version).
      type: str
      sample: 550.90.07
    nvidia_cuda_version:
      description: The same as RV(cuda_version).
      type: str
      sample: "12.4"
"""

import glob  # noqa: E402 (imports follow the documentation, as Ansible modules do)
import os  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402
from ansible_collections.inferops.vllm.plugins.module_utils.nvidia_smi import (  # noqa: E402
    QUERY_FIELDS,
    NvidiaSmiError,
    classify_failure,
    classify_pci_devices,
    nvlink_all_to_all,
    nvswitch_from_topology,
    parse_cuda_version,
    parse_query_gpu,
    parse_topology,
)


def argument_spec():
    return dict(
        nvidia_smi_path=dict(type="path"),
        topology=dict(type="bool", default=True),
    )


class NvidiaGpuFacts:
    # Where nvidia-smi lives besides PATH: distribution packages, .run installer, NVIDIA container runtime.
    SEARCH_DIRS = ["/usr/bin", "/usr/local/bin", "/usr/local/nvidia/bin"]
    NVSWITCH_DEVICES = "/dev/nvidia-nvswitch[0-9]*"
    PCI_DEVICES = "/sys/bus/pci/devices"

    def __init__(self, module):
        self.module = module
        self.params = module.params
        self.nvidia_smi = None
        self.pci = {"gpus": [], "nvswitches": []}

    def find_nvidia_smi(self):
        path = self.params["nvidia_smi_path"]
        if path:
            if not (os.path.isfile(path) and os.access(path, os.X_OK)):
                self.module.fail_json(msg=f"nvidia_smi_path {path} is not an executable file")
            return path
        return self.module.get_bin_path("nvidia-smi", required=False, opt_dirs=self.SEARCH_DIRS)

    def read_pci(self):
        devices = []
        for path in sorted(glob.glob(os.path.join(self.PCI_DEVICES, "*"))):
            try:
                with open(os.path.join(path, "vendor")) as vendor, open(os.path.join(path, "class")) as pci_class:
                    devices.append((os.path.basename(path), vendor.read().strip(), pci_class.read().strip()))
            except OSError:
                continue
        return classify_pci_devices(devices)

    def run(self, *args):
        return self.module.run_command([self.nvidia_smi, *args])

    def result(self, gpus, driver_loaded, reason=None, cuda_version=None, topology=None, evidence=None):
        driver_version = next((gpu["driver_version"] for gpu in gpus if gpu["driver_version"]), None)
        evidence = list(evidence or [])
        if self.pci["nvswitches"]:
            evidence.append("pci")
        return dict(
            changed=False,
            gpus=gpus,
            gpu_count=len(gpus),
            driver_loaded=driver_loaded,
            driver_version=driver_version,
            cuda_version=cuda_version,
            nvidia_smi=self.nvidia_smi,
            reason=reason,
            topology=topology,
            nvlink_all_to_all=nvlink_all_to_all(topology),
            nvswitch=bool(evidence),
            nvswitch_evidence=evidence,
            pci_gpus=self.pci["gpus"],
            pci_nvswitches=self.pci["nvswitches"],
            ansible_facts=dict(
                nvidia_gpus=gpus,
                nvidia_driver_version=driver_version,
                nvidia_cuda_version=cuda_version,
            ),
        )

    def main(self):
        self.pci = self.read_pci()
        self.nvidia_smi = self.find_nvidia_smi()
        if not self.nvidia_smi:
            reason = (
                "no nvidia-smi was found (searched PATH and " + ", ".join(self.SEARCH_DIRS) + "): "
                "the NVIDIA driver is not installed, so this host has no usable NVIDIA GPU"
            )
            self.module.exit_json(**self.result([], False, reason))

        query = ("--query-gpu=" + ",".join(QUERY_FIELDS), "--format=csv,noheader,nounits")
        rc, out, err = self.run(*query)
        no_gpu = classify_failure(rc, out, err)
        if no_gpu is not None:
            driver_loaded, reason = no_gpu
            self.module.exit_json(**self.result([], driver_loaded, reason))
        command = " ".join([self.nvidia_smi, *query])
        if rc != 0:
            self.module.fail_json(
                msg=f"{command} failed with rc={rc}: {(err or out).strip()}", rc=rc, stdout=out, stderr=err
            )
        try:
            gpus = parse_query_gpu(out)
        except NvidiaSmiError as exc:
            self.module.fail_json(msg=f"{command}: {exc}", rc=rc, stdout=out, stderr=err)
        if not gpus:
            self.module.exit_json(**self.result([], True, "nvidia-smi listed no GPU"))

        rc, out, err = self.run()
        cuda_version = parse_cuda_version(out) if rc == 0 else None

        topology = None
        if self.params["topology"]:
            rc, out, err = self.run("topo", "-m")
            topology = parse_topology(out) if rc == 0 else None

        evidence = sorted(glob.glob(self.NVSWITCH_DEVICES))
        if nvswitch_from_topology(topology):
            evidence.append("topology")
        self.module.exit_json(**self.result(gpus, True, None, cuda_version, topology, evidence))


def main():
    module = AnsibleModule(argument_spec=argument_spec(), supports_check_mode=True)
    NvidiaGpuFacts(module).main()


if __name__ == "__main__":
    main()
