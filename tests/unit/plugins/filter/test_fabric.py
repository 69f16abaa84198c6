"""Unit tests for the kv_fabric and kv_fabric_problems filters (plugins/filter/fabric.py, rules in
plugins/plugin_utils/_kv_fabric.py), on the facts rdma_fabric_facts reads from the recorded sysfs trees
(tests/unit/fixtures/sysfs/*.tree): no GPU and no RDMA NIC here.
"""

from __future__ import annotations

import copy

import pytest
from ansible.errors import AnsibleFilterError
from ansible_collections.inferops.vllm.plugins.filter.fabric import kv_fabric, kv_fabric_problems
from ansible_collections.inferops.vllm.plugins.modules.rdma_fabric_facts import gather
from ansible_collections.inferops.vllm.tests.unit.fabric_support import materialise
from ansible_collections.inferops.vllm.tests.unit.plugins.filter.utils import launcher


@pytest.fixture(scope="module")
def fabric(tmp_path_factory):
    """The rdma_fabric facts of each recorded layout."""
    cache = {}

    def read(name):
        if name not in cache:
            cache[name] = gather(str(materialise(name, tmp_path_factory.mktemp(name))))
        return cache[name]
    return read


def nvidia_gpus(facts):
    """nvidia_gpu_facts' GPUs for a layout: index order = PCI bus order, bus ids as nvidia-smi prints them."""
    return [{"index": i, "uuid": f"GPU-{i:04d}", "mig_mode": None,
             "pci_bus_id": "0000" + g["pci_bus_id"].upper()} for i, g in enumerate(facts["gpus"])]


def published(*instances, role="decode", variant="cuda", **settings):
    host = {"kv_transport": "auto", "kv_buffer_device": "cuda", "ucx_net_devices": "", "ucx_tls": "",
            "ucx_ib_gid_index": -1, **settings}
    return {"pd_role": role, "vllm_variant": variant, "settings": host,
            "instances": [{"name": name, "overrides": overrides, "settings": {**host, **overrides}}
                          for name, overrides in instances]}


def tables(facts, record, gpus_per_instance):
    gpus = nvidia_gpus(facts)
    placed = [{"name": inst["name"], "gpus": [f"GPU-{i:04d}" for i in gpu_indices]}
              for inst, gpu_indices in zip(record["instances"], gpus_per_instance, strict=True)]
    return {i["name"]: i["kv_fabric"] for i in kv_fabric(placed, record, gpus, facts, "d1")}


CUDA_TLS = "rc_x,rc,cuda_copy,cuda_ipc"


def test_8_gpus_8_nics_an_instance_gets_the_nics_of_its_gpus_switches(fabric):
    record = published(("decode-0", {}), ("decode-1", {}))
    assert tables(fabric("switched_8gpu_8nic_ib"), record, [[2, 3], [4, 5, 6, 7]]) == {
        "decode-0": {"transport": "rdma", "net_devices": "mlx5_2:1,mlx5_3:1", "tls": CUDA_TLS},
        "decode-1": {"transport": "rdma", "net_devices": "mlx5_4:1,mlx5_5:1,mlx5_6:1,mlx5_7:1", "tls": CUDA_TLS},
    }


def test_8_gpus_2_roce_nics_an_instance_gets_its_sockets_nic_and_the_gid_index(fabric):
    record = published(("decode-0", {}), ("decode-1", {}))
    assert tables(fabric("8gpu_2nic_roce"), record, [[0, 1, 2, 3], [3, 4]]) == {
        "decode-0": {"transport": "rdma", "net_devices": "mlx5_0:1", "tls": CUDA_TLS, "ib_gid_index": 3},
        "decode-1": {"transport": "rdma", "net_devices": "mlx5_0:1,mlx5_1:1", "tls": CUDA_TLS, "ib_gid_index": 3},
    }


def test_roce_over_a_bond_uses_the_bond_device(fabric):
    assert tables(fabric("roce_bond"), published(("decode-0", {})), [[0]]) == {
        "decode-0": {"transport": "rdma", "net_devices": "mlx5_bond_0:1", "tls": CUDA_TLS, "ib_gid_index": 3}}


def test_kv_in_host_memory_over_rdma_gets_the_host_memory_transports(fabric):
    record = published(("decode-0", {}), kv_buffer_device="cpu")
    assert tables(fabric("roce_bond"), record, [[0]])["decode-0"]["tls"] == "rc_x,rc,sm,self"


def test_per_instance_overrides_win(fabric):
    record = published(("decode-0", {"ucx_net_devices": "mlx5_1:1", "ucx_tls": "rc,cuda_copy", "ucx_ib_gid_index": 1}),
                       ("decode-1", {}))
    assert tables(fabric("8gpu_2nic_roce"), record, [[0], [7]]) == {
        "decode-0": {"transport": "rdma", "net_devices": "mlx5_1:1", "tls": "rc,cuda_copy", "ib_gid_index": 1},
        "decode-1": {"transport": "rdma", "net_devices": "mlx5_1:1", "tls": CUDA_TLS, "ib_gid_index": 3},
    }


def test_tcp_writes_only_what_is_set(fabric):
    record = published(("decode-0", {}), ("decode-1", {"ucx_tls": "tcp,sm,self", "ucx_net_devices": "eth0"}),
                       kv_transport="tcp")
    assert tables(fabric("switched_8gpu_8nic_ib"), record, [[0], [1]]) == {
        "decode-0": {"transport": "tcp"},
        "decode-1": {"transport": "tcp", "net_devices": "eth0", "tls": "tcp,sm,self"},
    }


def test_the_cpu_build_is_tcp_by_default_and_without_facts():
    record = published(("decode-0", {}), variant="cpu", kv_buffer_device="cpu")
    assert kv_fabric([{"name": "decode-0", "gpus": []}], record, [], {})[0]["kv_fabric"] == {"transport": "tcp"}


def test_an_instance_without_pd_has_no_kv_path(fabric):
    record = published(("solo-0", {}), role="none")
    assert tables(fabric("switched_8gpu_8nic_ib"), record, [[0]]) == {"solo-0": None}


def test_ports_with_different_gid_indexes_need_a_setting(fabric):
    facts = copy.deepcopy(fabric("8gpu_2nic_roce"))
    facts["devices"][1]["ports"][0]["roce_v2_gid_index"] = 5
    placed = [{"name": "decode-0", "gpus": ["GPU-0003", "GPU-0004"]}]
    with pytest.raises(AnsibleFilterError) as failed:
        kv_fabric(placed, published(("decode-0", {})), nvidia_gpus(facts), facts, "d1")
    assert str(failed.value) == (
        "kv_fabric: d1: instance decode-0: the RDMA ports mlx5_0:1, mlx5_1:1 have their RoCE v2 GIDs at different "
        "indexes (3, 5) and UCX takes one UCX_IB_GID_INDEX: set ucx_ib_gid_index, or give the instance GPUs whose "
        "NICs agree")
    record = published(("decode-0", {"ucx_ib_gid_index": 3}))
    assert kv_fabric(placed, record, nvidia_gpus(facts), facts)[0]["kv_fabric"]["ib_gid_index"] == 3


# --------------------------------------------------------------------------- the preflight with facts


def test_a_gpu_host_without_rdma_is_refused(fabric):
    (problem,) = kv_fabric_problems(fabric("no_rdma"), published(("decode-0", {})))
    assert problem.startswith(
        "instance decode-0: KV would travel over RDMA (vllm_instance_kv_transport is auto on a cuda build), but the "
        "host has no active RDMA port: no RDMA device in /sys/class/infiniband")
    assert problem.endswith("or set vllm_instance_kv_transport: tcp where TCP is meant.")


def test_a_gpu_host_without_rdma_is_accepted_when_tcp_is_said(fabric):
    assert kv_fabric_problems(fabric("no_rdma"), published(("decode-0", {}), kv_transport="tcp")) == []
    record = published(("decode-0", {"kv_transport": "tcp"}), ("decode-1", {}))
    (problem,) = kv_fabric_problems(fabric("no_rdma"), record)
    assert problem.startswith("instance decode-1: ")


def test_rdma_said_per_instance_names_the_override(fabric):
    record = published(("decode-0", {"kv_transport": "rdma"}), kv_transport="tcp", variant="cpu")
    (problem,) = kv_fabric_problems(fabric("no_rdma"), record)
    assert "(vllm_instance_instances[decode-0].overrides.kv_transport is rdma)" in problem


def test_the_cpu_sandbox_is_tcp_and_never_refused(fabric):
    assert kv_fabric_problems(fabric("no_rdma"), published(("decode-0", {}), variant="cpu")) == []
    said = published(("prefill-0", {}), role="prefill", variant="cpu", kv_transport="tcp")
    assert kv_fabric_problems(fabric("no_rdma"), said) == []


def test_all_ports_down_is_refused(fabric):
    facts = copy.deepcopy(fabric("roce_bond"))
    for device in facts["devices"]:
        for port in device["ports"]:
            port["active"] = False
    assert len(kv_fabric_problems(facts, published(("decode-0", {})))) == 1


def test_gpudirect_rdma_needs_nvidia_peermem(fabric):
    (problem,) = kv_fabric_problems(fabric("8gpu_2nic_roce"), published(("decode-0", {})))
    assert problem.startswith("instance decode-0: GPUDirect RDMA (KV staged in GPU memory, kv_buffer_device cuda, sent "
                              "over RDMA) needs the nvidia_peermem kernel module, which is not loaded.")
    assert kv_fabric_problems(fabric("8gpu_2nic_roce"), published(("decode-0", {})), False) == []
    assert kv_fabric_problems(fabric("8gpu_2nic_roce"), published(("decode-0", {}), kv_buffer_device="cpu")) == []
    assert kv_fabric_problems(fabric("switched_8gpu_8nic_ib"), published(("decode-0", {}))) == []


def test_pinned_ports_must_be_the_hosts_and_active(fabric):
    record = published(("decode-0", {"ucx_net_devices": "mlx5_2:1,mlx5_9:1"}))
    (problem,) = kv_fabric_problems(fabric("roce_bond"), record)
    assert problem == (
        "instance decode-0: ucx_net_devices pins mlx5_2:1, mlx5_9:1, but mlx5_9:1 is not an RDMA port of this host "
        "and mlx5_2:1 is not ACTIVE (active ports: mlx5_bond_0:1). Fix: name active ports, or leave ucx_net_devices "
        "empty for the ports nearest the instance's GPUs.")


def test_a_host_without_pd_is_not_checked(fabric):
    assert kv_fabric_problems(fabric("no_rdma"), published(("solo-0", {}), role="none")) == []
    # The fabric task is skipped there: its skipped result is no facts.
    assert kv_fabric_problems({"skipped": True}, published(("solo-0", {}), role="none")) == []


# --------------------------------------------------------------------------- the controller's PD preflight


def test_prefill_and_decode_must_agree_on_the_kv_transport():
    from ansible_collections.inferops.vllm.tests.unit.plugins.filter.test_preflight import instance, one, problems

    # A cuda prefill (auto = rdma) and a decode that says tcp.
    found = problems(prefill={"p1": instance("prefill", variant="cuda", kv_buffer_device="cuda", gpu_memory_bytes=0)},
                     decode={"d1": instance("decode", kv_transport="tcp")})
    one(found, "parity", "vllm_instance_kv_transport: prefill and decode must agree on the KV transport",
        "'auto' (= rdma) on p1 (prefill)", "'tcp' on d1 (decode)", "Fix: set one vllm_instance_kv_transport")
    # auto on the cpu build is tcp: the sandbox's hosts agree whether they say it or not.
    assert not [p for p in problems(decode={"d1": instance("decode", kv_transport="tcp")}) if "kv_transport" in p]


def test_the_transport_of_a_hosts_record():
    from ansible_collections.inferops.vllm.plugins.filter.fabric import kv_transport

    assert kv_transport(published(("decode-0", {}))) == "rdma"
    assert kv_transport(published(("decode-0", {}), variant="cpu")) == "tcp"
    assert kv_transport(published(("decode-0", {"kv_transport": "tcp"}))) == "tcp"
    assert kv_transport({"vllm_variant": "cpu", "settings": {"kv_transport": "rdma"}, "instances": []}) == "rdma"


def test_recorded_facts_to_the_launchers_environment(fabric):
    """The 8-GPU, 8-NIC host's facts -> kv_fabric -> the role's renderer (its [kv_fabric] table) -> the launcher's
    UCX variables (the whole role renders the file in test_instance_templates.py)."""
    from ansible_collections.inferops.vllm.plugins.filter.instance_toml import instance_toml

    host = {"inventory_hostname": "d1", "pd_role": "decode", "bind_host": "0.0.0.0", "served_model_name": "m",
            "api_key_set": False, "config_dir": "/etc/vllm", "allowed_media_domains": [], "model_path": "/m",
            "kv_transfer_backend": "nixl", "host_address": "10.0.0.21", "cpu_build": False}
    launch = launcher()
    for layout, gpus, expected in (
        ("switched_8gpu_8nic_ib", [6, 7], {"UCX_NET_DEVICES": "mlx5_6:1,mlx5_7:1", "UCX_TLS": CUDA_TLS}),
        ("roce_bond", [2], {"UCX_NET_DEVICES": "mlx5_bond_0:1", "UCX_TLS": CUDA_TLS, "UCX_IB_GID_INDEX": "3"}),
    ):
        (table,) = tables(fabric(layout), published(("decode-0", {})), [gpus]).values()
        instance = {"name": "decode-0", "port": 8200, "kv_transfer_port": 5700, "kv_fabric": table}
        config = launch.tomllib.loads(instance_toml(instance, {"kv_buffer_device": "cuda"}, host))
        assert config["kv_fabric"] == table, layout
        assert launch.validate(config) == [], layout
        assert {k: v for k, v in launch.build(config, None)[1].items() if k.startswith("UCX_")} == expected, layout
