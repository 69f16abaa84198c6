"""Unit tests for plugins/module_utils/nvidia_smi.py, on published nvidia-smi output.

Each file under tests/unit/fixtures/nvidia-smi/ starts with ``# source: ...`` (and, when the sample had to be
adapted, ``# adapted: ...``) lines that say where it comes from; :func:`fixture` strips them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ansible_collections.inferops.vllm.plugins.module_utils import nvidia_smi as ns

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "nvidia-smi"


def fixture(name):
    """The sample in ``name`` without its leading ``# source:`` / ``# adapted:`` header lines."""
    lines = (FIXTURES / name).read_text().splitlines(keepends=True)
    while lines and lines[0].startswith("# "):
        lines.pop(0)
    return "".join(lines)


def test_every_fixture_says_where_it_comes_from():
    files = sorted(FIXTURES.iterdir())
    assert len(files) >= 15
    for path in files:
        first = path.read_text().splitlines()[0]
        assert first.startswith("# source: ") and ", " in first, path.name
        body = fixture(path.name)
        assert body.strip(), path.name
        assert not body.startswith("#"), path.name


# --------------------------------------------------------------------------- --query-gpu


def test_query_h100_sxm_8_gpus():
    gpus = ns.parse_query_gpu(fixture("h100-sxm-80gb-x8.query.csv"))
    assert [gpu["index"] for gpu in gpus] == list(range(8))
    assert gpus[0] == {
        "index": 0,
        "uuid": "GPU-b42dd28e-ffdd-8720-1df0-98bd8cdc05b1",
        "name": "NVIDIA H100 80GB HBM3",
        "memory_total_mib": 81559,
        "memory_used_mib": 1,
        "driver_version": "565.57.01",
        "mig_mode": "disabled",
        "pci_bus_id": "00000000:18:00.0",
    }
    assert gpus[7]["pci_bus_id"] == "00000000:DB:00.0"
    assert len({gpu["uuid"] for gpu in gpus}) == 8


def test_query_a100_mig_disabled():
    gpus = ns.parse_query_gpu(fixture("a100-sxm4-80gb-x4.query.csv"))
    assert [(gpu["name"], gpu["memory_total_mib"], gpu["mig_mode"]) for gpu in gpus] == [
        ("NVIDIA A100-SXM4-80GB", 81920, "disabled")
    ] * 4
    assert gpus[3]["uuid"] == "GPU-011b2cfe-2b8e-1cb0-19e1-1b764e854dfc"


def test_query_a100_mig_enabled():
    (gpu,) = ns.parse_query_gpu(fixture("a100-80gb-pcie-mig.query.csv"))
    assert gpu["name"] == "NVIDIA A100 80GB PCIe"
    assert gpu["mig_mode"] == "enabled"
    assert gpu["memory_used_mib"] == 829
    assert gpu["driver_version"] == "550.163.01"


@pytest.mark.parametrize(
    "name, count, model, total",
    [
        ("l4.query.csv", 1, "NVIDIA L4", 23034),
        ("rtx4090-x8.query.csv", 8, "NVIDIA GeForce RTX 4090", 24564),
    ],
)
def test_query_gpus_without_mig_support(name, count, model, total):
    gpus = ns.parse_query_gpu(fixture(name))
    assert len(gpus) == count
    assert all(gpu["name"] == model and gpu["memory_total_mib"] == total for gpu in gpus)
    assert all(gpu["mig_mode"] is None for gpu in gpus)  # [N/A]


def test_query_fields_not_available():
    # On some GPUs in MIG mode nvidia-smi cannot tell the used memory (the plain table shows N/A there,
    # for example https://github.com/NVIDIA/DCGM/issues/152); --query-gpu prints [N/A] for such fields.
    line = (
        "3, GPU-9a1e6c4e-0000-0000-0000-000000000003, NVIDIA A100-SXM4-80GB, 81920, [N/A], 535.104.05, Enabled, "
        "00000000:C1:00.0\n"
    )
    (gpu,) = ns.parse_query_gpu(line)
    assert gpu["memory_used_mib"] is None
    assert gpu["memory_total_mib"] == 81920
    assert gpu["mig_mode"] == "enabled"


def test_query_name_with_a_comma_stays_whole():
    line = "0, GPU-1, Some, GPU, 1024, 0, 550.1, [N/A], 00000000:01:00.0"
    (gpu,) = ns.parse_query_gpu(line)
    assert gpu["name"] == "Some, GPU"
    assert gpu["pci_bus_id"] == "00000000:01:00.0"


@pytest.mark.parametrize(
    "text, message",
    [
        ("0, GPU-1, NVIDIA L4, 23034", "4 fields instead of 8"),
        ("x, GPU-1, NVIDIA L4, 23034, 1, 550.90.07, [N/A], 00000000:01:00.0", "index 'x', not a number"),
        ("0, GPU-1, NVIDIA L4, lots, 1, 550.90.07, [N/A], 00000000:01:00.0", "memory.total 'lots'"),
        # What an old nvidia-smi says about a field it does not know.
        ('Field "mig.mode.current" is not a valid field to query.', "fields instead of 8"),
    ],
)
def test_query_garbage(text, message):
    with pytest.raises(ns.NvidiaSmiError, match=message):
        ns.parse_query_gpu(text)


def test_query_empty():
    assert ns.parse_query_gpu("") == []
    assert ns.parse_query_gpu("\n\n") == []


@pytest.mark.parametrize(
    "value, expected",
    [("Enabled", "enabled"), ("Disabled", "disabled"), ("[N/A]", None), ("N/A", None), ("[Not Supported]", None)],
)
def test_mig_mode(value, expected):
    assert ns.normalise_mig_mode(value) == expected


# --------------------------------------------------------------------------- plain nvidia-smi: CUDA version


@pytest.mark.parametrize(
    "name, expected",
    [
        ("h100-sxm-80gb-x8.nvidia-smi.txt", "12.7"),
        ("a100-sxm4-80gb-x4.nvidia-smi.txt", "12.5"),
        ("a100-80gb-pcie-mig.nvidia-smi.txt", "12.4"),
        ("l4.nvidia-smi.txt", "12.4"),
        ("rtx4090-x8.nvidia-smi.txt", "12.4"),
        ("b200-r610.nvidia-smi.txt", "13.3"),  # "CUDA UMD Version" of driver 610
    ],
)
def test_cuda_version(name, expected):
    assert ns.parse_cuda_version(fixture(name)) == expected


def test_cuda_version_absent():
    assert ns.parse_cuda_version(fixture("driver-not-loaded.txt")) is None
    assert ns.parse_cuda_version("") is None
    assert ns.parse_cuda_version(None) is None
    # FreeBSD's Linux emulation (https://github.com/verm/freebsd-stable-diffusion/issues/2) shows no version.
    header = "| NVIDIA-SMI 510.60.02    Driver Version: 510.60.02    CUDA Version: N/A      |"
    assert ns.parse_cuda_version(header) is None


# --------------------------------------------------------------------------- topo -m


def test_topology_h100_nvswitch_all_nv18():
    topology = ns.parse_topology(fixture("h100-sxm-x8.topo.txt"))
    assert sorted(topology) == [str(i) for i in range(8)]
    for gpu, peers in topology.items():
        assert sorted(peers) == sorted(str(i) for i in range(8) if str(i) != gpu)
        assert set(peers.values()) == {"NV18"}
    assert ns.nvlink_all_to_all(topology) is True
    assert ns.nvswitch_from_topology(topology) is True


def test_topology_a100_nvswitch_with_17_nics_and_nic_legend():
    topology = ns.parse_topology(fixture("a100-sxm4-x8.topo.txt"))
    assert len(topology) == 8
    assert topology["0"] == {str(i): "NV12" for i in range(1, 8)}
    assert not any(peer.startswith("NIC") for peers in topology.values() for peer in peers)
    assert ns.nvswitch_from_topology(topology) is True
    assert ns.nvlink_all_to_all(topology) is True


def test_topology_rtx4090_pcie_with_nics_tab_separated():
    topology = ns.parse_topology(fixture("rtx4090-x8.topo.txt"))
    assert len(topology) == 8
    assert set(topology["6"].values()) == {"SYS"}  # GPU6 is PHB to the NICs, not to a GPU
    assert ns.nvlink_all_to_all(topology) is False
    assert ns.nvswitch_from_topology(topology) is False


def test_topology_a10_pcie_all_sys():
    topology = ns.parse_topology(fixture("a10-x4.topo.txt"))
    assert topology == {g: {p: "SYS" for p in "0123" if p != g} for g in "0123"}
    assert ns.nvswitch_from_topology(topology) is False


def test_topology_mixed_sys_node_phb():
    topology = ns.parse_topology(fixture("pcie-5gpu.topo.txt"))
    assert topology["0"] == {"1": "SYS", "2": "SYS", "3": "SYS", "4": "SYS"}
    assert topology["1"] == {"0": "SYS", "2": "PHB", "3": "NODE", "4": "NODE"}
    assert topology["4"]["3"] == "PHB"
    # Symmetric, as nvidia-smi prints it.
    assert all(topology[p][g] == link for g, peers in topology.items() for p, link in peers.items())


def test_topology_two_gpus_phb_with_legend():
    topology = ns.parse_topology(fixture("rtx5090-x2.topo.txt"))
    assert topology == {"0": {"1": "PHB"}, "1": {"0": "PHB"}}
    assert ns.nvlink_all_to_all(topology) is False


def test_topology_single_gpu():
    # One GPU: a 1x1 matrix, written here in the layout of the published samples (none of them has one GPU).
    text = "\tGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\nGPU0\t X \t0-15\t0\t\tN/A\n"
    topology = ns.parse_topology(text)
    assert topology == {"0": {}}
    assert ns.nvlink_all_to_all(topology) is False
    assert ns.nvswitch_from_topology(topology) is False


@pytest.mark.parametrize("text", ["", None, fixture("driver-not-loaded.txt"), fixture("no-devices.txt")])
def test_topology_nothing(text):
    assert ns.parse_topology(text) is None
    assert ns.nvlink_all_to_all(None) is None
    assert ns.nvswitch_from_topology(None) is False


def test_nvswitch_bound():
    # Direct NVLink: a bridged pair, and the 4-GPU HGX boards (NV4 x 3 on A100, NV6 x 3 on H100) stay at <= 18.
    assert ns.nvswitch_from_topology({"0": {"1": "NV12"}, "1": {"0": "NV12"}}) is False
    four = {g: {p: "NV6" for p in "0123" if p != g} for g in "0123"}
    assert ns.nvswitch_from_topology(four) is False
    assert ns.nvlink_all_to_all(four) is True
    # The same board seen through a switch (NV18 to each of three peers) cannot be direct links.
    switched = {g: {p: "NV18" for p in "0123" if p != g} for g in "0123"}
    assert ns.nvswitch_from_topology(switched) is True
    assert ns.nvlink_count("NV18") == 18 and ns.nvlink_count("SYS") == 0 and ns.nvlink_count(None) == 0


# --------------------------------------------------------------------------- failures


@pytest.mark.parametrize(
    "name, driver_loaded, meaning",
    [
        ("driver-not-loaded.txt", False, "installed but not loaded"),
        ("driver-not-loaded-login-node.txt", False, "installed but not loaded"),
        ("driver-library-mismatch.txt", False, "does not match the installed driver"),
        ("no-devices.txt", True, "sees no GPU"),
    ],
)
def test_failures_that_mean_no_usable_gpu(name, driver_loaded, meaning):
    message = fixture(name).strip()
    for stdout, stderr in ((message + "\n", ""), ("", message + "\n")):
        loaded, reason = ns.classify_failure(9, stdout, stderr)
        assert loaded is driver_loaded
        assert meaning in reason
        assert " ".join(message.split()) in reason  # nvidia-smi's own words, on one line
        assert "rc=9" in reason


def test_other_failures_are_errors():
    # A GPU that fell off the bus is a fault to report, not "no GPU".
    lost = "Unable to determine the device handle for GPU1: 0000:34:00.0: Unknown Error"
    assert ns.classify_failure(15, lost, "") is None
    assert ns.classify_failure(1, "", "") is None
