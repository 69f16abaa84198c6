"""Unit tests for plugins/modules/rdma_fabric_facts.py and its choice of each GPU's nearest NICs
(plugins/module_utils/_rdma_fabric.py).

No GPU and no RDMA NIC here: the module reads recorded sysfs trees (tests/unit/fixtures/sysfs/*.tree, written by
make_trees.py there), built into a temporary directory with their symbolic links, through O(sysfs_root).
"""

from __future__ import annotations

import pytest
from ansible.module_utils import basic
from ansible_collections.inferops.vllm.plugins.module_utils import _rdma_fabric as rf
from ansible_collections.inferops.vllm.plugins.modules import rdma_fabric_facts
from ansible_collections.inferops.vllm.tests.unit.fabric_support import layouts, materialise
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import (
    assert_documented_as_specified,
    assert_no_globals_besides_documentation,
    captured_module_arguments,
    run_module,
)
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import exit_json as _exit_json
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import fail_json as _fail_json


@pytest.fixture(autouse=True)
def _patch_exits(monkeypatch):
    monkeypatch.setattr(basic.AnsibleModule, "exit_json", _exit_json)
    monkeypatch.setattr(basic.AnsibleModule, "fail_json", _fail_json)


def facts(name, tmp_path):
    return run_module(rdma_fabric_facts.main, {"sysfs_root": str(materialise(name, tmp_path))})


def nearest(result):
    return {g["pci_bus_id"]: (g["nearest_ports"], g["affinity"]) for g in result["gpus"]}


def test_the_recorded_layouts_are_there_and_are_what_make_trees_writes():
    import importlib.util

    from ansible_collections.inferops.vllm.tests.unit.fabric_support import TREES

    assert layouts() == ["8gpu_2nic_roce", "no_rdma", "roce_bond", "switched_8gpu_8nic_ib"]
    spec = importlib.util.spec_from_file_location("make_trees", TREES / "make_trees.py")
    make_trees = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_trees)
    for name, make in make_trees.LAYOUTS.items():
        assert (TREES / f"{name}.tree").read_text(encoding="utf-8") == make().text(), f"run {TREES}/make_trees.py"


def test_8_gpus_8_nics_one_per_pcie_switch_each_gpu_gets_the_nic_of_its_switch(tmp_path):
    result = facts("switched_8gpu_8nic_ib", tmp_path)
    gpus = ["0000:18:00.0", "0000:1c:00.0", "0000:3a:00.0", "0000:3e:00.0",
            "0000:9d:00.0", "0000:a1:00.0", "0000:bf:00.0", "0000:c3:00.0"]
    # Not the NIC of the neighbouring switch on the same host bridge, never the storage NIC mlx5_8.
    assert nearest(result) == {gpu: ([f"mlx5_{i}:1"], "pcie_switch") for i, gpu in enumerate(gpus)}
    assert result["fabric"] == "mixed"  # the storage NIC is RoCE
    assert result["nvidia_peermem_loaded"] is True
    assert result["reason"] is None
    ib = [p for d in result["devices"] for p in d["ports"] if p["link_layer"] == "InfiniBand"]
    assert len(ib) == 8 and all(p["rate_gbps"] == 400.0 and p["roce_v2_gid_index"] is None for p in ib)
    assert result["ansible_facts"]["rdma_fabric"]["gpus"] == result["gpus"]
    assert "changed" not in result["ansible_facts"]["rdma_fabric"] and result["changed"] is False


def test_8_gpus_2_nics_each_gpu_gets_the_nic_of_its_numa_node(tmp_path):
    result = facts("8gpu_2nic_roce", tmp_path)
    assert nearest(result) == {
        "0000:01:00.0": (["mlx5_0:1"], "numa_node"), "0000:02:00.0": (["mlx5_0:1"], "numa_node"),
        "0000:41:00.0": (["mlx5_0:1"], "host_bridge"), "0000:42:00.0": (["mlx5_0:1"], "host_bridge"),
        "0000:81:00.0": (["mlx5_1:1"], "numa_node"), "0000:82:00.0": (["mlx5_1:1"], "numa_node"),
        "0000:c1:00.0": (["mlx5_1:1"], "host_bridge"), "0000:c2:00.0": (["mlx5_1:1"], "host_bridge"),
    }
    assert result["fabric"] == "roce"
    ports = {p["ucx_device"]: p for d in result["devices"] for p in d["ports"]}
    # GIDs 0/1 are link-local (v1/v2), 2/3 the IPv4 address (v1/v2): RoCE v2 with an IPv4 address is 3.
    assert {n: (p["roce_v2_gid_index"], p["netdev"]) for n, p in ports.items()} == {
        "mlx5_0:1": (3, "ens1f0np0"), "mlx5_1:1": (3, "ens2f0np0")}
    assert result["nvidia_peermem_loaded"] is False


def test_roce_over_a_bond_the_bond_is_the_netdev_and_a_down_port_is_never_chosen(tmp_path):
    result = facts("roce_bond", tmp_path)
    assert nearest(result) == {
        "0000:19:00.0": (["mlx5_bond_0:1"], "pcie_switch"), "0000:1a:00.0": (["mlx5_bond_0:1"], "pcie_switch"),
        # mlx5_2 is on their socket, but its port is DOWN: the bond across the sockets is all there is.
        "0000:99:00.0": (["mlx5_bond_0:1"], "system"), "0000:9a:00.0": (["mlx5_bond_0:1"], "system"),
    }
    (bond,) = [d for d in result["devices"] if d["name"] == "mlx5_bond_0"]
    assert bond["pci_bus_id"] == "0000:1b:00.0" and bond["netdevs"] == ["ens1f0np0"]
    (port,) = bond["ports"]
    assert port["netdev"] == "bond0" and port["roce_v2_gid_index"] == 3
    assert port["bond"] == {"name": "bond0", "mode": "802.3ad", "slaves": ["ens1f0np0", "ens1f1np1"]}
    assert result["bonds"] == {"bond0": {"mode": "802.3ad", "slaves": ["ens1f0np0", "ens1f1np1"]}}
    (down,) = [p for d in result["devices"] if d["name"] == "mlx5_2" for p in d["ports"]]
    assert (down["state"], down["phys_state"], down["active"]) == ("DOWN", "Disabled", False)
    assert result["active_ports"] == ["mlx5_bond_0:1"] and result["fabric"] == "roce"


def test_no_rdma_the_gpus_have_no_nearest_nic_and_the_reason_says_why(tmp_path):
    result = facts("no_rdma", tmp_path)
    assert nearest(result) == {"0000:01:00.0": ([], None), "0000:02:00.0": ([], None)}
    assert result["devices"] == [] and result["active_ports"] == [] and result["fabric"] == "none"
    assert "no RDMA device in /sys/class/infiniband" in result["reason"]
    assert result["gpus"][0]["numa_node"] == -1


def test_ports_that_are_all_down_are_a_reason(tmp_path):
    root = materialise("roce_bond", tmp_path)
    (root / "class/infiniband/mlx5_bond_0/ports/1/state").write_text("1: DOWN\n")
    result = run_module(rdma_fabric_facts.main, {"sysfs_root": str(root)})
    assert result["active_ports"] == [] and result["fabric"] == "none"
    assert result["reason"].startswith("no RDMA port is ACTIVE (mlx5_2:1 DOWN/Disabled, mlx5_bond_0:1 DOWN/LinkUp)")
    assert nearest(result)["0000:19:00.0"] == ([], None)


def test_a_missing_sysfs_root_fails(tmp_path):
    result = run_module(rdma_fabric_facts.main, {"sysfs_root": str(tmp_path / "nope")}, expect="fail")
    assert result["msg"] == f"sysfs_root {tmp_path / 'nope'} is not a directory"


def test_check_mode_reads_the_same(tmp_path):
    root = str(materialise("8gpu_2nic_roce", tmp_path))
    assert run_module(rdma_fabric_facts.main, {"sysfs_root": root}, check_mode=True) == \
        run_module(rdma_fabric_facts.main, {"sysfs_root": root})


def test_documentation_matches_argument_spec(monkeypatch):
    yaml = pytest.importorskip("yaml")
    captured = captured_module_arguments(monkeypatch, rdma_fabric_facts)
    doc = yaml.safe_load(rdma_fabric_facts.DOCUMENTATION)
    assert_documented_as_specified(doc["options"], captured["argument_spec"])
    assert captured["supports_check_mode"] is True
    returned = set(yaml.safe_load(rdma_fabric_facts.RETURN))
    assert returned == set(rdma_fabric_facts.gather("/nonexistent")) | {"ansible_facts"}


def test_no_module_level_state():
    assert_no_globals_besides_documentation(rdma_fabric_facts)


# --------------------------------------------------------------------------- the pure choice


@pytest.mark.parametrize(("given", "expected"), [
    ("00000000:1B:00.0", "0000:1b:00.0"), ("0000:1b:00.0", "0000:1b:00.0"), ("0001:c1:00.1", "0001:c1:00.1"),
    ("pci0000:15", None), ("", None), (None, None), ("0000:1b:00.8", None),
])
def test_bus_ids_from_nvidia_smi_and_sysfs_compare_equal(given, expected):
    assert rf.normalise_bus_id(given) == expected


def test_pci_place_reads_the_host_bridge_and_the_chain_and_stops_below_the_device():
    assert rf.pci_place("devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:01.0/0000:19:00.0/net/ib0") == (
        "pci0000:15", ["0000:15:01.0", "0000:16:00.0", "0000:17:01.0", "0000:19:00.0"])
    assert rf.pci_place("devices/virtual/net/bond0") == (None, [])


def place(chain, numa=0):
    return {"host_bridge": "pci" + chain[0][:7], "pci_chain": chain, "numa_node": numa}


def test_affinity_classes_from_nearest_to_farthest():
    gpu = place(["0000:15:01.0", "0000:16:00.0", "0000:17:00.0", "0000:18:00.0"])
    assert rf.affinity(gpu, place(["0000:15:01.0", "0000:16:00.0", "0000:17:01.0", "0000:19:00.0"])) == "pcie_switch"
    assert rf.affinity(gpu, place(["0000:15:02.0", "0000:1a:00.0"])) == "host_bridge"
    assert rf.affinity(gpu, place(["0000:37:01.0", "0000:38:00.0"])) == "numa_node"
    assert rf.affinity(gpu, place(["0000:9a:01.0", "0000:9b:00.0"], numa=1)) == "system"
    # numa_node -1 (no NUMA information) is the same node as any.
    assert rf.affinity(gpu, place(["0000:9a:01.0", "0000:9b:00.0"], numa=-1)) == "numa_node"


def test_a_tie_keeps_every_nearest_port_in_device_and_port_order():
    gpu = {"pci_bus_id": "0000:18:00.0", **place(["0000:15:01.0", "0000:16:00.0", "0000:17:00.0", "0000:18:00.0"])}
    nic = place(["0000:15:01.0", "0000:16:00.0", "0000:17:01.0", "0000:19:00.0"])
    far = place(["0000:9a:01.0", "0000:9b:00.0"], numa=1)
    devices = [
        {**nic, "ports": [{"ucx_device": "mlx5_0:1", "active": True}, {"ucx_device": "mlx5_0:2", "active": True}]},
        {**far, "ports": [{"ucx_device": "mlx5_1:1", "active": True}]},
        {**nic, "ports": [{"ucx_device": "mlx5_2:1", "active": False}]},
    ]
    assert rf.nearest_ports([gpu], devices) == {"0000:18:00.0": {"ports": ["mlx5_0:1", "mlx5_0:2"],
                                                                 "affinity": "pcie_switch"}}


def test_the_roce_v2_gid_index_prefers_an_ipv4_address_then_a_routable_gid():
    ll, v4 = "fe80:0000:0000:0000:0a5c:d1ff:fe00:0001", "0000:0000:0000:0000:0000:ffff:0a00:0001"
    v6 = "fd00:0000:0000:0000:0000:0000:0000:0001"
    assert rf.roce_v2_gid_index([{"index": 1, "gid": ll, "type": "RoCE v2"}, {"index": 3, "gid": v4, "type": "RoCE v2"},
                                 {"index": 2, "gid": v4, "type": "IB/RoCE v1"}]) == 3
    assert rf.roce_v2_gid_index([{"index": 1, "gid": ll, "type": "RoCE v2"},
                                 {"index": 5, "gid": v6, "type": "RoCE v2"}]) == 5
    assert rf.roce_v2_gid_index([{"index": 1, "gid": ll, "type": "RoCE v2"}]) == 1
    assert rf.roce_v2_gid_index([{"index": 0, "gid": ll, "type": "IB/RoCE v1"}]) is None
    assert rf.roce_v2_gid_index([]) is None


def test_states_and_rates_as_sysfs_prints_them():
    assert rf.port_state("4: ACTIVE") == "ACTIVE" and rf.port_state("5: LinkUp") == "LinkUp"
    assert rf.port_state("") is None
    assert rf.rate_gbps("400 Gb/sec (4X NDR)") == 400.0 and rf.rate_gbps("2.5 Gb/sec (1X SDR)") == 2.5
    assert rf.rate_gbps("") is None
