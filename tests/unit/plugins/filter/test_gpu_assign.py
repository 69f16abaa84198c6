"""Unit tests for the inferops.vllm.gpu_assign filter.

The GPU facts are those the nvidia_gpu_facts module makes of the published nvidia-smi samples under
tests/unit/fixtures/nvidia-smi/ (parsed with the module's own parser).
"""

from __future__ import annotations

import copy
import inspect
from pathlib import Path

import pytest
from ansible.errors import AnsibleFilterError
from ansible_collections.inferops.vllm.plugins.filter.gpu_assign import FilterModule, gpu_assign
from ansible_collections.inferops.vllm.plugins.module_utils.nvidia_smi import parse_query_gpu

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "nvidia-smi"
DOC = Path(__file__).resolve().parents[4] / "plugins" / "filter" / "gpu_assign.yml"


def facts(name):
    lines = (FIXTURES / name).read_text().splitlines(keepends=True)
    return parse_query_gpu("".join(line for line in lines if not line.startswith("# ")))


H100 = facts("h100-sxm-80gb-x8.query.csv")  # 8 GPUs, MIG disabled
UUID = [gpu["uuid"] for gpu in H100]
A100_MIG = facts("a100-80gb-pcie-mig.query.csv")  # 1 GPU, MIG enabled
A100 = facts("a100-sxm4-80gb-x4.query.csv")  # 4 GPUs, MIG disabled


def assign(instances, gpus=None, tp=1, pp=1, **kwargs):
    gpus = H100 if gpus is None else gpus
    return gpu_assign(instances, gpus, tp, pp, **kwargs)


def error(instances, gpus=None, tp=1, pp=1, **kwargs):
    gpus = H100 if gpus is None else gpus
    with pytest.raises(AnsibleFilterError) as info:
        gpu_assign(instances, gpus, tp, pp, **kwargs)
    return str(info.value)


# --------------------------------------------------------------------------- automatic


def test_automatic_in_instance_order_as_uuids():
    out = assign([{"name": "prefill-0"}, {"name": "prefill-1"}, {"name": "decode-0"}], tp=2)
    assert [inst["gpus"] for inst in out] == [UUID[0:2], UUID[2:4], UUID[4:6]]


def test_automatic_as_indices():
    out = assign([{"name": "prefill-0"}, {"name": "decode-0", "gpus": []}], tp=4, identify_by="index")
    assert [inst["gpus"] for inst in out] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_pipeline_parallel_and_overrides():
    instances = [
        {"name": "prefill-0", "overrides": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}},
        {"name": "decode-0", "overrides": {"tensor_parallel_size": "2"}},  # inventory strings are fine
        {"name": "decode-1"},
    ]
    out = assign(instances, tp=1, pp=1, identify_by="index")
    assert [inst["gpus"] for inst in out] == [[0, 1, 2, 3], [4, 5], [6]]


# --------------------------------------------------------------------------- explicit


def test_explicit_and_automatic_as_in_the_documentation():
    instances = [
        {"name": "prefill-0", "gpus": [6, 7], "port": 8100},
        {"name": "prefill-1"},
        {"name": "decode-0", "overrides": {"tensor_parallel_size": 4}},
    ]
    before = copy.deepcopy(instances)
    out = assign(instances, tp=2, identify_by="index")
    assert [inst["gpus"] for inst in out] == [[6, 7], [0, 1], [2, 3, 4, 5]]
    assert out[0]["port"] == 8100 and out[2]["overrides"] == {"tensor_parallel_size": 4}
    assert instances == before  # the input is not changed


def test_explicit_by_uuid_index_and_index_string():
    instances = [
        {"name": "prefill-0", "gpus": [UUID[5].upper()]},  # UUIDs match whatever their case
        {"name": "decode-0", "gpus": ["3"]},
        {"name": "decode-1"},
    ]
    out = assign(instances)
    assert [inst["gpus"] for inst in out] == [[UUID[5]], [UUID[3]], [UUID[0]]]
    out = assign(instances, identify_by="index")
    assert [inst["gpus"] for inst in out] == [[5], [3], [0]]


def test_uuid_and_index_of_the_same_gpu_conflict():
    msg = error([{"name": "prefill-0", "gpus": [2]}, {"name": "decode-0", "gpus": [UUID[2]]}])
    assert msg == (
        f"gpu_assign: GPU 2 ({UUID[2]}) is given to both instance prefill-0 and instance decode-0 "
        f"(as 2 and as {UUID[2]}): give every GPU to one instance only"
    )


def test_duplicate_across_instances():
    msg = error([{"name": "prefill-0", "gpus": [1]}, {"name": "decode-0", "gpus": ["1"]}])
    assert "GPU 1 (" in msg and "both instance prefill-0 and instance decode-0 (as 1)" in msg


def test_duplicate_within_an_instance():
    msg = error([{"name": "prefill-0", "gpus": [1, UUID[1]]}], tp=2)
    assert f"instance prefill-0 lists GPU 1 ({UUID[1]}) twice (as 1 and as {UUID[1]}): list every GPU once" in msg


def test_tp_pp_mismatch():
    msg = error([{"name": "prefill-1", "gpus": [0, 1, 2]}], tp=2)
    assert msg == (
        "gpu_assign: instance prefill-1 lists 3 GPUs [0, 1, 2] but tensor_parallel_size 2 × "
        "pipeline_parallel_size 1 = 2: list 2 GPUs or change the parallel sizes"
    )


def test_gpu_the_host_does_not_have():
    msg = error([{"name": "decode-0", "gpus": [8]}])
    assert "instance decode-0 lists GPU 8, which this host does not have (its GPUs are 0, 1, 2, 3, 4, 5, 6, 7)" in msg
    msg = error([{"name": "decode-0", "gpus": ["GPU-00000000-dead-beef-0000-000000000000"]}], gpus=A100)
    assert "lists GPU GPU-00000000-dead-beef-0000-000000000000, which this host does not have" in msg


@pytest.mark.parametrize("entry", [True, -1, {"index": 0}, " ", 1.5])
def test_entries_that_are_no_gpu(entry):
    msg = error([{"name": "decode-0", "gpus": [entry]}])
    assert f"instance decode-0 lists GPU {entry!r}, which is neither a GPU index" in msg


def test_gpus_that_is_no_list():
    msg = error([{"name": "decode-0", "gpus": "0,1"}])
    assert "instance decode-0: gpus must be a list of GPU indices or UUIDs, got '0,1'" in msg


def test_mig_enabled_gpu_cannot_be_listed():
    msg = error([{"name": "decode-0", "gpus": [0]}], gpus=A100_MIG)
    assert "instance decode-0 lists GPU 0 (GPU-" in msg
    assert "which has MIG enabled" in msg and "nvidia-smi -i 0 -mig 0" in msg


def test_all_problems_at_once():
    msg = error(
        [
            {"name": "prefill-0", "gpus": [0, 9]},
            {"name": "prefill-1", "gpus": [0]},
            {"name": "decode-0", "overrides": {"tensor_parallel_size": 0}},
        ],
        tp=2,
    )
    assert "GPU 9, which this host does not have" in msg
    assert "both instance prefill-0 and instance prefill-1" in msg
    assert "instance prefill-1 lists 1 GPUs [0] but tensor_parallel_size 2" in msg
    assert "instance decode-0: tensor_parallel_size must be a whole number of 1 or more, got 0" in msg


# --------------------------------------------------------------------------- not enough GPUs


def test_not_enough_gpus():
    instances = [{"name": "prefill-0", "gpus": [0, 1, 2, 3]}, {"name": "decode-0"}, {"name": "decode-1"}]
    msg = error(instances, tp=4, gpus=H100)
    assert msg == (
        "gpu_assign: instance decode-1 needs 4 GPUs (tensor_parallel_size 4 × pipeline_parallel_size 1) but only 0 "
        "of the host's 8 GPUs are left [none] (4 listed explicitly by instances, 4 given to the instances before it): "
        "lower the parallel sizes, run fewer instances on this host or add GPUs"
    )


def test_mig_enabled_gpus_are_skipped():
    msg = error([{"name": "decode-0"}], gpus=A100_MIG)
    assert "instance decode-0 needs 1 GPUs" in msg
    assert "only 0 of the host's 1 GPUs are left [none]" in msg and "1 with MIG enabled (0)" in msg
    # A host with MIG on its first GPU: automatic assignment starts at the next one.
    mixed = [dict(gpu, mig_mode="enabled") if gpu["index"] == 0 else gpu for gpu in A100]
    out = assign([{"name": "decode-0"}, {"name": "decode-1"}], gpus=mixed, identify_by="index")
    assert [inst["gpus"] for inst in out] == [[1], [2]]


# --------------------------------------------------------------------------- hosts without GPU facts


@pytest.mark.parametrize("gpus", [[], None])
def test_cpu_host_is_unchanged(gpus):
    instances = [{"name": "prefill-0", "cpus": "0-3"}, {"name": "decode-0", "gpus": []}]
    out = gpu_assign(instances, gpus)
    assert out == [{"name": "prefill-0", "cpus": "0-3", "gpus": []}, {"name": "decode-0", "gpus": []}]


def test_without_facts_listed_gpus_are_kept_and_checked():
    out = assign([{"name": "prefill-0", "gpus": ["1", "GPU-abc"]}, {"name": "decode-0"}], gpus=[], tp=2)
    assert [inst["gpus"] for inst in out] == [[1, "GPU-abc"], []]
    assert "both instance prefill-0 and instance decode-0 (as 1)" in error(
        [{"name": "prefill-0", "gpus": [1]}, {"name": "decode-0", "gpus": ["1"]}], gpus=[]
    )
    assert "lists 1 GPUs [3] but tensor_parallel_size 2" in error([{"name": "decode-0", "gpus": [3]}], gpus=[], tp=2)


# --------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("value", [0, -2, "two", None, True, 1.5])
def test_bad_parallel_sizes(value):
    msg = error([{"name": "decode-0"}], tp=value)
    assert f"instance decode-0: tensor_parallel_size must be a whole number of 1 or more, got {value!r}" in msg


def test_bad_arguments():
    assert "expects the host's list of instances, got dict" in error({"name": "x"})
    assert "instance #2 has no name" in error([{"name": "a"}, {"gpus": [1]}])
    assert "identify_by must be one of uuid, index, got 'serial'" in error([{"name": "a"}], identify_by="serial")


def test_filter_is_registered():
    assert FilterModule().filters() == {"gpu_assign": gpu_assign}


def test_kv_cache_larger_than_the_gpu_is_refused():
    # vLLM's kv_cache_memory_bytes is per GPU; an 80 GB H100 cannot hold 90 GiB of KV, it can hold 60 GiB.
    gpu = H100[1]
    instances = [{"name": "prefill-0"}, {"name": "decode-0", "overrides": {"kv_cache_memory_bytes": 90 * 2**30}}]
    with pytest.raises(AnsibleFilterError) as err:
        gpu_assign(instances, H100[:2], 1, 1, "uuid", 60 * 2**30)
    message = str(err.value)
    assert "instance decode-0 asks for a KV cache of 90.0 GiB per GPU" in message
    assert f"GPU 1 ({gpu['uuid']}) {gpu['name']} has {gpu['memory_total_mib'] / 1024:.1f} GiB in all" in message
    assert "prefill-0" not in message
    assert gpu_assign(instances[:1], H100[:2], 1, 1, "uuid", 60 * 2**30) == [{"name": "prefill-0", "gpus": [UUID[0]]}]


def test_kv_cache_not_checked_without_size_or_facts():
    gpus = [{"index": 0, "uuid": "GPU-a", "memory_total_mib": 1024}]
    assert gpu_assign([{"name": "p"}], gpus, kv_cache_memory_bytes=0) == [{"name": "p", "gpus": ["GPU-a"]}]
    assert gpu_assign([{"name": "p", "gpus": [0]}], [], kv_cache_memory_bytes=2**40) == [{"name": "p", "gpus": [0]}]


def test_documentation_matches_the_signature():
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load(DOC.read_text())
    parameters = list(inspect.signature(gpu_assign).parameters)
    options = doc["DOCUMENTATION"]["options"]
    assert parameters == ["instances", *[name.strip() for name in doc["DOCUMENTATION"]["positional"].split(",")]]
    assert set(options) == {"_input", *parameters[1:]}
    defaults = {name: p.default for name, p in inspect.signature(gpu_assign).parameters.items() if name != "instances"}
    assert {name: options[name].get("default") for name in defaults} == {**defaults, "gpus": []}
    assert options["identify_by"]["choices"] == ["uuid", "index"]
