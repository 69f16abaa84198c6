# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Pure helpers for the inferops.vllm.nvidia_gpu_facts module: parsing of nvidia-smi output.

Everything here works on text and plain data (no commands are run), so that it can be unit tested:

* :func:`parse_query_gpu` reads ``nvidia-smi --query-gpu=<QUERY_FIELDS> --format=csv,noheader,nounits``;
* :func:`parse_cuda_version` reads the CUDA version from the header of plain ``nvidia-smi``;
* :func:`parse_topology` reads the GPU-to-GPU matrix of ``nvidia-smi topo -m``;
* :func:`nvswitch_from_topology` and :func:`nvlink_all_to_all` summarise that matrix;
* :func:`classify_failure` tells a driver that is not loaded (or a host without usable GPU) from a real error;
* :func:`classify_pci_devices` finds NVIDIA GPUs and NVSwitches among the PCI devices (sysfs), driver or not.
"""

from __future__ import annotations

import csv
import re

# The --query-gpu fields, in the order parse_query_gpu expects them.
QUERY_FIELDS = (
    "index",
    "uuid",
    "name",
    "memory.total",
    "memory.used",
    "driver_version",
    "mig.mode.current",
    "pci.bus_id",
)

# The most NVLink links one NVIDIA GPU has (H100, B200: 18). Without a switch, a GPU's links are split
# among its peers, so its NV# counts add up to at most this; more means they go through NVSwitch.
MAX_GPU_NVLINKS = 18

# Values nvidia-smi prints for a field it cannot report.
_NOT_AVAILABLE = ("[N/A]", "N/A", "[Not Supported]", "Not Supported", "[Unknown Error]", "")

# "CUDA Version: 12.4" (drivers up to R580), "CUDA UMD Version: 13.3" (R610 and later), "CUDA Version : 12.4" (-q).
_CUDA_VERSION = re.compile(r"CUDA(?: UMD)? Version\s*:\s*(\d+(?:\.\d+)+)")
_GPU_LABEL = re.compile(r"^GPU(\d+)$")
_NVLINK = re.compile(r"^NV(\d+)$")

# Messages of nvidia-smi that mean "no usable NVIDIA GPU" rather than an error of the tool:
# (text in the message, driver_loaded, what it means).
_NO_USABLE_GPU = (
    (
        "couldn't communicate with the NVIDIA driver",
        False,
        "the NVIDIA driver is installed but not loaded (load the nvidia kernel module or reboot)",
    ),
    (
        "Driver/library version mismatch",
        False,
        "the loaded NVIDIA kernel module does not match the installed driver (reboot after a driver upgrade)",
    ),
    ("Failed to initialize NVML", False, "nvidia-smi cannot talk to the NVIDIA driver"),
    ("NVML Shared Library Not Found", False, "the NVIDIA driver's NVML library is missing"),
    ("No devices were found", True, "the NVIDIA driver is loaded but sees no GPU"),
)


class NvidiaSmiError(Exception):
    """Output of nvidia-smi that cannot be understood."""


def _clean(value):
    value = value.strip()
    return None if value in _NOT_AVAILABLE else value


def _int_or_none(value, what, line):
    value = _clean(value)
    if value is None:
        return None
    try:
        return int(float(value))
    except ValueError:
        raise NvidiaSmiError(f"nvidia-smi reported {what} {value!r}, not a number, in line {line!r}") from None


def normalise_mig_mode(value):
    """``Enabled``/``Disabled``/``[N/A]`` of ``mig.mode.current`` -> ``enabled``/``disabled``/None."""
    value = (_clean(value) or "").lower()
    return value if value in ("enabled", "disabled") else None


def parse_query_gpu(text):
    """Parse ``nvidia-smi --query-gpu=<QUERY_FIELDS> --format=csv,noheader,nounits``.

    Returns one dict per GPU, in the order of the output (nvidia-smi's index order).
    Raises NvidiaSmiError for a line with too few fields or a non-numeric index.
    """
    gpus = []
    lines = [line for line in text.splitlines() if line.strip()]
    for row in csv.reader(lines, skipinitialspace=True):
        line = ", ".join(row)
        if len(row) < len(QUERY_FIELDS):
            raise NvidiaSmiError(
                f"nvidia-smi --query-gpu gave {len(row)} fields instead of {len(QUERY_FIELDS)} "
                f"({','.join(QUERY_FIELDS)}) in line {line!r}"
            )
        # A name with a comma would split into more fields: everything between uuid and memory.total is the name.
        extra = len(row) - len(QUERY_FIELDS)
        index, uuid = row[0], row[1]
        name = ", ".join(row[2 : 3 + extra]).strip()
        total, used, driver, mig, bus_id = row[3 + extra :]
        gpu_index = _int_or_none(index, "index", line)
        if gpu_index is None:
            raise NvidiaSmiError(f"nvidia-smi reported no GPU index in line {line!r}")
        gpus.append(
            dict(
                index=gpu_index,
                uuid=_clean(uuid),
                name=name,
                memory_total_mib=_int_or_none(total, "memory.total", line),
                memory_used_mib=_int_or_none(used, "memory.used", line),
                driver_version=_clean(driver),
                mig_mode=normalise_mig_mode(mig),
                pci_bus_id=_clean(bus_id),
            )
        )
    return gpus


def parse_cuda_version(text):
    """The CUDA version the driver supports, from the header of plain ``nvidia-smi``; None if not shown."""
    match = _CUDA_VERSION.search(text or "")
    return match.group(1) if match else None


def parse_topology(text):
    """Parse the GPU matrix of ``nvidia-smi topo -m``.

    Returns ``{gpu index (str): {peer index (str): link}}`` with links such as ``NV18``, ``SYS``, ``NODE``,
    ``PHB``, ``PXB`` or ``PIX`` (the GPU itself is left out), or None when the text holds no matrix.
    Columns and rows of NICs, the CPU/NUMA affinity columns and the legends are ignored. Works on the
    tab-separated output of nvidia-smi and on pastes where the tabs became spaces.
    """
    columns = None
    topology = {}
    for line in (text or "").splitlines():
        tokens = line.split()
        if not tokens:
            continue
        if columns is None:
            # The header: device labels (GPU0, NIC0, mlx5_0, ...) up to "CPU Affinity" / "NUMA Affinity".
            # Every row of the matrix has an "X" (the device itself), the header has none.
            if "X" not in tokens and any(_GPU_LABEL.match(token) for token in tokens):
                columns = []
                for token in tokens:
                    if token in ("CPU", "NUMA", "GPU", "Affinity"):
                        break
                    columns.append(token)
            continue
        match = _GPU_LABEL.match(tokens[0])
        if not match:
            continue  # NIC rows, legends
        cells = tokens[1 : 1 + len(columns)]
        if len(cells) < len(columns):
            continue
        peers = {}
        for column, cell in zip(columns, cells, strict=True):
            peer = _GPU_LABEL.match(column)
            if peer and cell != "X":
                peers[peer.group(1)] = cell
        topology[match.group(1)] = peers
    return topology or None


def nvlink_count(link):
    """Number of bonded NVLinks of a topo link (``NV18`` -> 18), 0 for PCIe links."""
    match = _NVLINK.match(link or "")
    return int(match.group(1)) if match else 0


def nvlink_all_to_all(topology):
    """Whether every pair of (two or more) GPUs is linked by NVLink; None without a topology."""
    if not topology:
        return None
    if len(topology) < 2:
        return False
    return all(nvlink_count(link) > 0 for peers in topology.values() for link in peers.values())


def nvswitch_from_topology(topology):
    """Whether the topology proves an NVSwitch: a GPU whose NV# counts to its peers add up to more
    than MAX_GPU_NVLINKS, the links one GPU has, can only reach them through a switch.

    Direct NVLink meshes (NVLink bridges, HGX A100 4-GPU, HGX H100 4-GPU, DGX-1) stay below that bound;
    DGX/HGX A100 8-GPU (7 x NV12) and H100/H200/B200 8-GPU (7 x NV18) are above it.
    A host that sees only one or two GPUs of a switched board cannot be told from a bridged pair.
    """
    if not topology:
        return False
    return any(sum(nvlink_count(link) for link in peers.values()) > MAX_GPU_NVLINKS for peers in topology.values())


def classify_failure(rc, stdout, stderr):
    """Read the output of an nvidia-smi run that did not list GPUs.

    Returns ``(driver_loaded, reason)`` when it says that the host has no usable NVIDIA GPU (driver
    installed but not loaded, kernel module and driver versions differ, no devices), or None when it
    is an error of some other kind.
    """
    text = " ".join(part.strip() for part in (stdout or "", stderr or "") if part and part.strip())
    message = " ".join(text.split())
    for marker, driver_loaded, meaning in _NO_USABLE_GPU:
        if marker in message:
            return driver_loaded, f"{meaning}; nvidia-smi (rc={rc}) said: {message}"
    return None


NVIDIA_PCI_VENDOR = 0x10DE
# PCI class codes (base class, subclass): display controllers are GPUs (0x0300 VGA, 0x0302 3D controller, as
# data-centre GPUs report); NVSwitch chips report 0x0680 "Bridge: other bridge device".
_PCI_GPU_CLASSES = (0x0300, 0x0302)
_PCI_NVSWITCH_CLASS = 0x0680


def classify_pci_devices(devices):
    """Split PCI devices into NVIDIA GPUs and NVSwitches.

    ``devices`` is an iterable of ``(bus_id, vendor, class)`` with vendor and class as sysfs prints them
    (``0x10de``, ``0x030200``). Returns ``{"gpus": [...], "nvswitches": [...]}``, bus ids sorted. Works without
    any NVIDIA driver, which is what tells an installer that a host needs fabric manager before the first boot
    of the driver.
    """
    found = {"gpus": [], "nvswitches": []}
    for bus_id, vendor, pci_class in devices:
        try:
            if int(vendor, 16) != NVIDIA_PCI_VENDOR:
                continue
            base_sub = int(pci_class, 16) >> 8
        except (TypeError, ValueError):
            continue
        if base_sub in _PCI_GPU_CLASSES:
            found["gpus"].append(bus_id)
        elif base_sub == _PCI_NVSWITCH_CLASS:
            found["nvswitches"].append(bus_id)
    for ids in found.values():
        ids.sort()
    return found
