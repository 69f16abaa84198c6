"""Unit tests for plugins/modules/nvidia_gpu_facts.py.

The module's main() runs as in community.general's module tests (module args patched in, exit_json/fail_json
turned into exceptions). get_bin_path and run_command are patched: a fake nvidia-smi answers from the published
outputs under tests/unit/fixtures/nvidia-smi/. Where a host's topology comes from another published host with the
same GPUs (no source had all three outputs of one machine), the test says so.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from ansible.module_utils import basic
from ansible_collections.inferops.vllm.plugins.modules import nvidia_gpu_facts
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import (
    assert_no_globals_besides_documentation,
    run_module,
)
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import exit_json as _exit_json
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import fail_json as _fail_json

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "nvidia-smi"
SMI = "/usr/bin/nvidia-smi"
QUERY = (
    "--query-gpu=index,uuid,name,memory.total,memory.used,driver_version,mig.mode.current,pci.bus_id",
    "--format=csv,noheader,nounits",
)


def run(args=None, **kwargs):
    """nvidia_gpu_facts.main() with ``args``: what it exited (or, with expect="fail", failed) with."""
    return run_module(nvidia_gpu_facts.main, args, **kwargs)


def fixture(name):
    """The sample in ``name`` without its leading ``# source:`` / ``# adapted:`` header lines."""
    lines = (FIXTURES / name).read_text().splitlines(keepends=True)
    while lines and lines[0].startswith("# "):
        lines.pop(0)
    return "".join(lines)


class FakeNvidiaSmi:
    """Answers run_command like nvidia-smi would; ``answers`` maps the arguments after the binary to
    (rc, stdout, stderr). A command without an answer fails the test."""

    def __init__(self, query=None, plain=None, topo=None, path=SMI):
        self.path = path
        self.answers = {}
        for args, answer in ((QUERY, query), ((), plain), (("topo", "-m"), topo)):
            if answer is not None:
                self.answers[args] = answer if isinstance(answer, tuple) else (0, fixture(answer), "")
        self.calls = []
        self.bin_path_calls = []

    def run_command(self, module, args, **kwargs):
        assert isinstance(args, list), "commands are run as argument lists, without a shell"
        assert args[0] == self.path
        self.calls.append(tuple(args[1:]))
        if tuple(args[1:]) not in self.answers:
            raise AssertionError(f"unexpected command {args}")
        return self.answers[tuple(args[1:])]

    def get_bin_path(self, module, arg, required=False, opt_dirs=None):
        self.bin_path_calls.append((arg, required, list(opt_dirs or [])))
        return self.path


@pytest.fixture(autouse=True)
def module_harness(monkeypatch, tmp_path):
    monkeypatch.setattr(basic.AnsibleModule, "exit_json", _exit_json)
    monkeypatch.setattr(basic.AnsibleModule, "fail_json", _fail_json)
    # No host /dev is ever looked at: NVSwitch device nodes are looked for in an empty directory by default.
    devices = str(tmp_path / "dev" / "nvidia-nvswitch[0-9]*")
    monkeypatch.setattr(nvidia_gpu_facts.NvidiaGpuFacts, "NVSWITCH_DEVICES", devices)
    # Nor the host's sysfs: PCI devices are read from an empty directory unless a test writes some.
    monkeypatch.setattr(nvidia_gpu_facts.NvidiaGpuFacts, "PCI_DEVICES", str(tmp_path / "pci"))


def install(monkeypatch, smi):
    def run_command(module, args, **kwargs):
        # A plain function (not smi's bound method), so that Python passes the module as `self`.
        return smi.run_command(module, args, **kwargs)

    monkeypatch.setattr(basic.AnsibleModule, "run_command", run_command)
    monkeypatch.setattr(
        basic.AnsibleModule,
        "get_bin_path",
        lambda module, arg, required=False, opt_dirs=None: smi.get_bin_path(module, arg, required, opt_dirs),
    )
    return smi


def assert_no_gpu(result, driver_loaded, reason_part, nvidia_smi=SMI):
    assert result["changed"] is False
    assert result["gpus"] == [] and result["gpu_count"] == 0
    assert result["driver_loaded"] is driver_loaded
    assert result["nvidia_smi"] == nvidia_smi
    assert reason_part in result["reason"]
    assert result["driver_version"] is None and result["cuda_version"] is None
    assert result["topology"] is None and result["nvlink_all_to_all"] is None
    assert result["nvswitch"] is False and result["nvswitch_evidence"] == []
    assert result["pci_gpus"] == [] and result["pci_nvswitches"] == []
    assert result["ansible_facts"] == {"nvidia_gpus": [], "nvidia_driver_version": None, "nvidia_cuda_version": None}


# --------------------------------------------------------------------------- GPU hosts


def test_h100_sxm_8_gpus_with_nvswitch(monkeypatch):
    # Query and plain output of one 8x H100 SXM host; the topology of another 8x H100 SXM (HGX) host.
    smi = install(
        monkeypatch,
        FakeNvidiaSmi("h100-sxm-80gb-x8.query.csv", "h100-sxm-80gb-x8.nvidia-smi.txt", "h100-sxm-x8.topo.txt"),
    )
    result = run()
    assert result["changed"] is False
    assert result["gpu_count"] == 8
    assert [gpu["index"] for gpu in result["gpus"]] == list(range(8))
    assert result["gpus"][0] == {
        "index": 0,
        "uuid": "GPU-b42dd28e-ffdd-8720-1df0-98bd8cdc05b1",
        "name": "NVIDIA H100 80GB HBM3",
        "memory_total_mib": 81559,
        "memory_used_mib": 1,
        "driver_version": "565.57.01",
        "mig_mode": "disabled",
        "pci_bus_id": "00000000:18:00.0",
    }
    assert result["driver_loaded"] is True
    assert result["driver_version"] == "565.57.01"
    assert result["cuda_version"] == "12.7"
    assert result["nvidia_smi"] == SMI
    assert result["reason"] is None
    assert result["topology"]["3"]["7"] == "NV18"
    assert result["nvlink_all_to_all"] is True
    assert result["nvswitch"] is True and result["nvswitch_evidence"] == ["topology"]
    assert result["ansible_facts"] == {
        "nvidia_gpus": result["gpus"],
        "nvidia_driver_version": "565.57.01",
        "nvidia_cuda_version": "12.7",
    }
    assert smi.calls == [QUERY, (), ("topo", "-m")]
    ((arg, required, opt_dirs),) = smi.bin_path_calls
    assert arg == "nvidia-smi" and required is False and "/usr/local/nvidia/bin" in opt_dirs


def test_nvswitch_device_nodes(monkeypatch, tmp_path):
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia-nvswitch1", "nvidia-nvswitch0", "nvidia-nvswitchctl", "nvidia0"):
        (dev / name).touch()
    install(monkeypatch, FakeNvidiaSmi("a100-sxm4-80gb-x4.query.csv", "a100-sxm4-80gb-x4.nvidia-smi.txt"))
    # Without topology the device nodes alone show the switch; the control node does not count.
    result = run({"topology": False})
    assert result["nvswitch"] is True
    assert result["nvswitch_evidence"] == [str(dev / "nvidia-nvswitch0"), str(dev / "nvidia-nvswitch1")]
    assert result["topology"] is None and result["nvlink_all_to_all"] is None


def write_pci(tmp_path, devices):
    """sysfs-like PCI devices: {bus_id: (vendor, class)}, as the files /sys/bus/pci/devices/<id>/{vendor,class}."""
    for bus_id, (vendor, pci_class) in devices.items():
        d = tmp_path / "pci" / bus_id
        d.mkdir(parents=True)
        (d / "vendor").write_text(vendor + "\n")
        (d / "class").write_text(pci_class + "\n")


# An HGX H100 board as sysfs shows it (classes as lspci -n prints them for these devices): GPUs are 3D
# controllers, NVSwitch chips bridges, plus an NVIDIA audio function and unrelated devices that do not count.
HGX_PCI = {
    "0000:18:00.0": ("0x10de", "0x030200"),
    "0000:2a:00.0": ("0x10de", "0x030200"),
    "0000:05:00.0": ("0x10de", "0x068000"),
    "0000:06:00.0": ("0x10de", "0x068000"),
    "0000:01:00.1": ("0x10de", "0x040300"),
    "0000:00:00.0": ("0x8086", "0x060000"),
    "0000:03:00.0": ("0x15b3", "0x020700"),
    "0000:04:00.0": ("0x1a03", "0x030000"),
}


def test_pci_without_driver_shows_gpus_and_nvswitch(monkeypatch, tmp_path):
    """Before any driver is installed (no nvidia-smi), sysfs alone shows the GPUs and the NVSwitch chips."""
    write_pci(tmp_path, HGX_PCI)
    (tmp_path / "pci" / "0000:07:00.0").mkdir()  # a device whose files cannot be read is left out
    install(monkeypatch, FakeNvidiaSmi(path=None))
    result = run()
    assert result["gpus"] == [] and result["driver_loaded"] is False
    assert result["pci_gpus"] == ["0000:18:00.0", "0000:2a:00.0"]
    assert result["pci_nvswitches"] == ["0000:05:00.0", "0000:06:00.0"]
    assert result["nvswitch"] is True and result["nvswitch_evidence"] == ["pci"]


def test_pci_evidence_adds_to_topology(monkeypatch, tmp_path):
    write_pci(tmp_path, HGX_PCI)
    install(
        monkeypatch,
        FakeNvidiaSmi("h100-sxm-80gb-x8.query.csv", "h100-sxm-80gb-x8.nvidia-smi.txt", "h100-sxm-x8.topo.txt"),
    )
    result = run()
    assert result["nvswitch_evidence"] == ["topology", "pci"]


def test_pci_gpus_without_nvswitch(monkeypatch, tmp_path):
    write_pci(tmp_path, {"0000:01:00.0": ("0x10de", "0x030000"), "0000:01:00.1": ("0x10de", "0x040300")})
    install(monkeypatch, FakeNvidiaSmi(path=None))
    result = run()
    assert result["pci_gpus"] == ["0000:01:00.0"] and result["pci_nvswitches"] == []
    assert result["nvswitch"] is False


def test_a100_mig_disabled_without_topology(monkeypatch):
    smi = install(monkeypatch, FakeNvidiaSmi("a100-sxm4-80gb-x4.query.csv", "a100-sxm4-80gb-x4.nvidia-smi.txt"))
    result = run({"topology": False})
    assert result["gpu_count"] == 4
    assert {gpu["mig_mode"] for gpu in result["gpus"]} == {"disabled"}
    assert result["driver_version"] == "555.42.02" and result["cuda_version"] == "12.5"
    assert result["topology"] is None and result["nvswitch"] is False
    assert ("topo", "-m") not in smi.calls


def test_a100_mig_enabled_and_topology_failure_is_no_failure(monkeypatch):
    smi = install(
        monkeypatch,
        FakeNvidiaSmi(
            "a100-80gb-pcie-mig.query.csv",
            "a100-80gb-pcie-mig.nvidia-smi.txt",
            topo=(3, "", "Topology is not supported on this system\n"),
        ),
    )
    result = run()
    (gpu,) = result["gpus"]
    assert gpu["mig_mode"] == "enabled" and gpu["name"] == "NVIDIA A100 80GB PCIe"
    assert result["cuda_version"] == "12.4" and result["driver_version"] == "550.163.01"
    assert result["topology"] is None and result["nvlink_all_to_all"] is None and result["nvswitch"] is False
    assert smi.calls[-1] == ("topo", "-m")


def test_rtx4090_pcie_topology(monkeypatch):
    # Query and plain output of one 8x RTX 4090 host; the topology of another 8x RTX 4090 PCIe server.
    install(
        monkeypatch,
        FakeNvidiaSmi("rtx4090-x8.query.csv", "rtx4090-x8.nvidia-smi.txt", "rtx4090-x8.topo.txt"),
    )
    result = run()
    assert result["gpu_count"] == 8
    assert all(gpu["mig_mode"] is None for gpu in result["gpus"])
    assert set(result["topology"]["0"].values()) == {"SYS"}
    assert result["nvlink_all_to_all"] is False
    assert result["nvswitch"] is False and result["nvswitch_evidence"] == []


def test_l4_when_plain_nvidia_smi_and_topology_print_nothing_useful(monkeypatch):
    install(monkeypatch, FakeNvidiaSmi("l4.query.csv", plain=(0, "", ""), topo=(0, "", "")))
    result = run()
    assert result["gpus"][0]["name"] == "NVIDIA L4"
    assert result["cuda_version"] is None
    assert result["topology"] is None


def test_cuda_version_of_a_failed_plain_run_is_unknown(monkeypatch):
    install(monkeypatch, FakeNvidiaSmi("l4.query.csv", plain=(255, "", "Unknown Error"), topo=None))
    result = run({"topology": False})
    assert result["gpu_count"] == 1 and result["cuda_version"] is None and result["driver_version"] == "550.90.07"


def test_check_mode_reads_the_same(monkeypatch):
    smi = install(
        monkeypatch,
        FakeNvidiaSmi("h100-sxm-80gb-x8.query.csv", "h100-sxm-80gb-x8.nvidia-smi.txt", "h100-sxm-x8.topo.txt"),
    )
    result = run(check_mode=True)
    assert result["changed"] is False and result["gpu_count"] == 8 and result["nvswitch"] is True
    assert len(smi.calls) == 3


# --------------------------------------------------------------------------- hosts without usable GPU


def test_no_nvidia_smi_is_a_cpu_host(monkeypatch):
    smi = install(monkeypatch, FakeNvidiaSmi(path=None))
    result = run()
    assert_no_gpu(result, False, "no nvidia-smi was found", nvidia_smi=None)
    assert "/usr/local/nvidia/bin" in result["reason"]
    assert smi.calls == []


@pytest.mark.parametrize(
    "name, rc, driver_loaded, reason_part",
    [
        ("driver-not-loaded.txt", 9, False, "installed but not loaded"),
        ("driver-not-loaded-login-node.txt", 9, False, "installed but not loaded"),
        ("driver-library-mismatch.txt", 18, False, "does not match the installed driver"),
        ("no-devices.txt", 6, True, "sees no GPU"),
    ],
)
def test_driver_not_usable_is_no_failure(monkeypatch, name, rc, driver_loaded, reason_part):
    smi = install(monkeypatch, FakeNvidiaSmi(query=(rc, fixture(name), "")))
    result = run()
    assert_no_gpu(result, driver_loaded, reason_part)
    assert fixture(name).split()[0] in result["reason"]
    assert smi.calls == [QUERY]  # nothing else is asked of a driver that does not answer


def test_no_gpu_listed(monkeypatch):
    install(monkeypatch, FakeNvidiaSmi(query=(0, "\n", "")))
    assert_no_gpu(run(), True, "listed no GPU")


# --------------------------------------------------------------------------- failures


def test_gpu_lost_fails(monkeypatch):
    lost = "Unable to determine the device handle for GPU1: 0000:34:00.0: Unknown Error\n"
    install(monkeypatch, FakeNvidiaSmi(query=(15, "", lost)))
    result = run(expect="fail")
    assert "failed with rc=15" in result["msg"]
    assert "Unable to determine the device handle for GPU1" in result["msg"]
    assert result["rc"] == 15


def test_unreadable_output_fails(monkeypatch):
    install(monkeypatch, FakeNvidiaSmi(query=(0, 'Field "mig.mode.current" is not a valid field to query.\n', "")))
    result = run(expect="fail")
    assert "fields instead of 8" in result["msg"] and "--query-gpu" in result["msg"]


def test_explicit_path(monkeypatch, tmp_path):
    binary = tmp_path / "nvidia-smi"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    smi = install(monkeypatch, FakeNvidiaSmi("l4.query.csv", "l4.nvidia-smi.txt", path=str(binary)))
    result = run({"nvidia_smi_path": str(binary), "topology": False})
    assert result["nvidia_smi"] == str(binary) and result["gpu_count"] == 1
    assert smi.bin_path_calls == []


@pytest.mark.parametrize("executable", [False, None])
def test_explicit_path_that_is_no_executable_fails(monkeypatch, tmp_path, executable):
    binary = tmp_path / "nvidia-smi"
    if executable is not None:
        binary.write_text("not executable\n")
        os.chmod(binary, 0o644)
    install(monkeypatch, FakeNvidiaSmi("l4.query.csv"))
    result = run({"nvidia_smi_path": str(binary)}, expect="fail")
    assert result["msg"] == f"nvidia_smi_path {binary} is not an executable file"


# --------------------------------------------------------------------------- documentation and structure


def test_documentation_matches_argument_spec():
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load(nvidia_gpu_facts.DOCUMENTATION)
    spec = nvidia_gpu_facts.argument_spec()
    assert set(doc["options"]) == set(spec)
    for name, option in doc["options"].items():
        assert option.get("type", "str") == spec[name].get("type", "str"), name
        assert option.get("default") == spec[name].get("default"), name
        assert option.get("required", False) == spec[name].get("required", False), name
        assert option["description"], name
    assert doc["attributes"]["check_mode"]["support"] == "full"
    assert doc["attributes"]["diff_mode"]["support"] == "none"
    assert doc["attributes"]["facts"]["support"] == "full"

    for task in yaml.safe_load(nvidia_gpu_facts.EXAMPLES):
        args = task.get("inferops.vllm.nvidia_gpu_facts", "absent")
        if args != "absent":
            assert set(args or {}) <= set(spec), args

    returned = yaml.safe_load(nvidia_gpu_facts.RETURN)
    assert set(returned) == {
        "gpus",
        "gpu_count",
        "driver_loaded",
        "driver_version",
        "cuda_version",
        "nvidia_smi",
        "reason",
        "topology",
        "nvlink_all_to_all",
        "nvswitch",
        "nvswitch_evidence",
        "pci_gpus",
        "pci_nvswitches",
        "ansible_facts",
    }
    assert set(returned["gpus"]["contains"]) == {
        "index",
        "uuid",
        "name",
        "memory_total_mib",
        "memory_used_mib",
        "driver_version",
        "mig_mode",
        "pci_bus_id",
    }

    def has_sample(entry, where):
        if "contains" in entry:
            for key, sub in entry["contains"].items():
                has_sample(sub, f"{where}.{key}")
        else:
            assert "sample" in entry, where

    for key, entry in returned.items():
        has_sample(entry, key)


def test_returned_keys_match_the_documentation(monkeypatch):
    yaml = pytest.importorskip("yaml")
    install(monkeypatch, FakeNvidiaSmi("l4.query.csv", "l4.nvidia-smi.txt", "rtx5090-x2.topo.txt"))
    result = run()
    documented = set(yaml.safe_load(nvidia_gpu_facts.RETURN))
    assert set(result) - {"changed"} == documented


def test_module_has_no_globals_besides_documentation():
    assert_no_globals_besides_documentation(nvidia_gpu_facts)
