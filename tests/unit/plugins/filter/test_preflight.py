"""Unit tests for the inferops.vllm.pd_preflight and kv_sizing filters (plugins/plugin_utils/_preflight.py).

The published dicts below have the shape roles/vllm_instance/tasks/publish.yml and
playbooks/preflight.yml give them; tests/unit/test_preflight_inventories.py runs the real playbook.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from typing import Any

import pytest
from ansible_collections.inferops.vllm.plugins.filter import preflight as preflight_filters
from ansible_collections.inferops.vllm.plugins.filter.preflight import FilterModule
from ansible_collections.inferops.vllm.plugins.plugin_utils import _preflight as pf
from ansible_collections.inferops.vllm.plugins.plugin_utils._kv_sizing import kv_blocks, kv_bytes_per_token
from ansible_collections.inferops.vllm.plugins.plugin_utils._preflight import kv_sizing, pd_preflight
from ansible_collections.inferops.vllm.tests.unit.plugins.filter.utils import COMMIT, GIB, SMOL, launcher, settings

# Qwen2.5-14B-Instruct: 40 heads, 8 KV heads, 48 layers, head_dim 128.
QWEN14 = {"num_attention_heads": 40, "num_key_value_heads": 8, "num_hidden_layers": 48, "hidden_size": 5120,
          "torch_dtype": "bfloat16", "max_position_embeddings": 32768}


def instance(role: str, instances: list[dict[str, Any]] | None = None, *, address: str = "",
             source: str = "ansible_host", model: str = "HuggingFaceTB/SmolLM2-135M-Instruct",
             model_is_local: bool = False,
             facts: dict[str, Any] | None = None, revision: str = COMMIT, variant: str = "cpu", version: str = "0.32.0",
             backend: str = "nixl", api_key: bool = True, api_key_broken: bool = False,
             unsupported: dict[str, str] | None = None, booleans: dict[str, Any] | None = None,
             gpu_memory_bytes: int = 0, pd_role: str | None = None, **kw: Any) -> dict[str, Any]:
    """What publish.yml publishes for one host (defaults: a CPU host with SmolLM2, 1 GiB KV, max_model_len 512)."""
    kw.setdefault("kv_cache_memory_bytes", GIB)
    kw.setdefault("max_model_len", 512)
    host_settings = settings(**kw)
    if instances is None:
        instances = [{"name": f"{role}-0", "port": 8100 if role == "prefill" else 8200,
                      "kv_transfer_port": 5600 if role == "prefill" else 5700}]
    resolved = []
    for item in instances:
        overrides = dict(item.get("overrides") or {})
        resolved.append({**item, "overrides": overrides, "settings": {**host_settings, **overrides}})
    return {
        "pd_role": pd_role or role, "address": address, "served_model_name": "m", "instances": resolved,
        "settings": host_settings, "address_source": source,
        "model": model, "model_revision": revision, "model_is_local": model_is_local,
        "model_facts": dict(SMOL) if facts is None else facts,
        "dtype": host_settings["dtype"], "quantization": host_settings["quantization"],
        "kv_cache_dtype": host_settings["kv_cache_dtype"], "block_size": host_settings["block_size"],
        "max_model_len": host_settings["max_model_len"], "tp": host_settings["tensor_parallel_size"],
        "pp": host_settings["pipeline_parallel_size"], "kv_cache_memory_bytes": host_settings["kv_cache_memory_bytes"],
        "gpu_memory_utilization": host_settings["gpu_memory_utilization"],
        "num_gpu_blocks_override": host_settings["num_gpu_blocks_override"], "gpu_memory_bytes": gpu_memory_bytes,
        "kv_transfer_backend": backend, "vllm_version": version, "vllm_variant": variant,
        "api_key_set": api_key, "api_key_broken": api_key_broken, "unsupported": unsupported or {},
        "booleans": {"vllm_install_wheelhouse_keep": False, **(booleans or {})},
    }


def router(**kw: Any) -> dict[str, Any]:
    """What roles/vllm_router/tasks/publish.yml publishes (vllm_router_published), with the role's defaults."""
    base = {"port": 8300, "metrics_port": 29000, "front_port": 8000, "replicas": 2, "api_keys_count": 1,
            "api_keys_invalid": 0, "api_keys_not_a_list": False, "api_keys_broken": False,
            "allow_unauthenticated": False, "tls_certificate": False, "tls_key": False}
    base.update(kw)
    return base


def inventory(prefill: dict[str, dict] | None = None, decode: dict[str, dict] | None = None,
              routers: dict[str, dict] | None = None) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """(published_by_host, groups) of a PD inventory; by default p1, d1 and r1, all good."""
    prefill = {"p1": instance("prefill", address="10.0.0.11")} if prefill is None else prefill
    decode = {"d1": instance("decode", address="10.0.0.21")} if decode is None else decode
    routers = {"r1": router()} if routers is None else routers
    published: dict[str, Any] = {}
    for host, pub in [*prefill.items(), *decode.items()]:
        published.setdefault(host, {"instance": None, "router": None, "allow_shared_hosts": None})["instance"] = pub
    for host, pub in routers.items():
        published.setdefault(host, {"instance": None, "router": None, "allow_shared_hosts": None})["router"] = pub
    groups = {"all": list(published), "prefill": list(prefill), "decode": list(decode), "router": list(routers)}
    return published, groups


def problems(published=None, groups=None, options=None, **inv: Any) -> list[str]:
    if published is None:
        published, groups = inventory(**inv)
    return pd_preflight(published, groups, options or {})


def one(found: list[str], check: str, *fragments: str) -> str:
    """The single problem of a check, which must contain every fragment."""
    hits = [p for p in found if p.startswith(f"[{check}]")]
    assert len(hits) == 1, f"expected one [{check}] problem, got:\n" + "\n".join(found)
    for fragment in fragments:
        assert fragment in hits[0], f"{fragment!r} not in {hits[0]!r}"
    return hits[0]


# --- the good case and the shape of the output ---------------------------------------------------


def test_a_good_inventory_has_no_problem():
    assert problems() == []


def test_every_problem_names_check_hosts_variable_what_and_fix():
    found = problems(decode={"d1": instance("decode", kv_cache_dtype="fp8", enforce_eager="yes")})
    assert len(found) == 2
    for line in found:
        assert re.match(r"^\[(parity|booleans)\] (d1: )?vllm_instance_\w+: .+ Fix: .+", line), line


def test_one_line_for_the_same_problem_on_many_hosts():
    prefill = {f"p{i}": instance("prefill", address=f"10.0.0.{i}", enforce_eager="yes") for i in range(10)}
    line = one(problems(prefill=prefill), "booleans")
    assert line.startswith("[booleans] p0, p1, p2, p3, p4, p5 and 4 more: vllm_instance_enforce_eager: is 'yes'")


def test_problems_come_in_check_order():
    found = problems(decode={"d1": instance("decode", enforce_eager="yes", max_model_len=1024)}, routers={})
    assert [p.split("]")[0][1:] for p in found] == ["groups", "parity", "booleans"]


def test_a_crashing_check_is_reported_and_the_others_still_run(monkeypatch):
    def boom(*_args):
        raise KeyError("x")

    monkeypatch.setattr(pf, "_check_ports", boom)
    found = problems(decode={"d1": instance("decode", enforce_eager="yes")})
    one(found, "ports", "(preflight): the ports check could not run: KeyError")
    one(found, "booleans")


def test_host_variables_work_as_input():
    published, groups = inventory(decode={"d1": instance("decode", enforce_eager="yes")})
    hostvars = {h: {"vllm_instance_published": e["instance"], "vllm_router_published": e["router"]}
                for h, e in published.items()}
    one(pd_preflight(hostvars, groups), "booleans", "d1")


class Undefined:
    """Stands in for Ansible's UndefinedMarker (a jinja2 Undefined) of an unresolvable variable."""


class HostVars(dict):
    """A host's variables where some cannot be resolved, as hostvars[host] behaves."""

    def __getitem__(self, key):
        value = super().__getitem__(key)
        if value == "raise":
            raise RuntimeError("'vault_x' is undefined")
        return value


def test_router_settings_are_read_from_its_published_record():
    published, groups = inventory()
    hostvars = {h: {"vllm_instance_published": e["instance"]} for h, e in published.items() if e["instance"]}
    # A setting given only as the role publishes it: the preflight checks that value, not a copy of the defaults.
    hostvars["r1"] = {"vllm_router_published": router(front_port=8300), "vllm_router_front_port": 8000}
    line = one(pd_preflight(hostvars, groups), "ports", "r1: vllm_router_front_port, vllm_router_port: port 8300")
    assert "(default 8300)" in line and "(default 29000)" in line and "(default 8000)" in line
    hostvars["r1"] = {"vllm_router_published": router(api_keys_count=0, allow_unauthenticated=True),
                      "inferops_allow_shared_hosts": False}
    # Keys not required, so neither are the instances'.
    assert pd_preflight(hostvars, groups) == []
    hostvars["r1"] = {"vllm_router_published": router(api_keys_count=0)}
    one(pd_preflight(hostvars, groups), "secrets", "r1: vllm_router_api_keys: lists no client key")
    # A router host's inventory variables alone are not read: the record is.
    hostvars["r1"] = {"vllm_router_front_port": 8300, "vllm_router_api_keys": ["k" * 20]}
    assert "[ports]" not in "".join(pd_preflight(hostvars, groups))


def test_no_copy_of_the_router_defaults():
    assert not hasattr(pf, "ROUTER_DEFAULTS")
    assert not hasattr(pf, "ROUTER_FACT")
    assert "8300" not in pf.__file__ and "8300" not in open(pf.__file__, encoding="utf-8").read()


def test_unresolvable_router_variables_are_reported():
    published, groups = inventory()
    hostvars = {h: {"vllm_instance_published": e["instance"]} for h, e in published.items() if e["instance"]}
    # How the publish tasks publish variables that refer to something undefined.
    hostvars["r1"] = {"vllm_router_published": router(api_keys_count=0, api_keys_broken=True, tls_certificate=True)}
    found = pd_preflight(hostvars, groups)
    assert found[0].startswith("[secrets] r1: vllm_router_api_keys: refers to an undefined variable")
    assert found[1].startswith("[secrets] r1: vllm_router_tls_certificate, vllm_router_tls_key: only one of them")
    hostvars["r1"] = {"vllm_router_published": router(api_keys_count=0, api_keys_broken=True,
                                                      port="(undefined variable)")}
    found = pd_preflight(hostvars, groups)
    one(found, "ports", "r1: vllm_router_port: is '(undefined variable)', not a port")
    assert any("vllm_router_api_keys: refers to an undefined variable" in p for p in found)
    hostvars["r1"] = {"vllm_router_published": router(api_keys_count=0, api_keys_not_a_list=True)}
    one(pd_preflight(hostvars, groups), "secrets", "r1: vllm_router_api_keys: is not a list of keys.")


class LazyVars(Mapping):
    """hostvars[host] is a lazy Mapping, not a dict: its variables may be named anything."""

    def __init__(self, **variables):
        self._vars = variables

    def __getitem__(self, key):
        return self._vars[key]

    def __iter__(self):
        return iter(self._vars)

    def __len__(self):
        return len(self._vars)


def test_host_variables_named_like_the_plain_data_keys():
    published, groups = inventory()
    hostvars = {h: LazyVars(vllm_instance_published=e["instance"], router="yes", instance=1)
                for h, e in published.items() if e["instance"]}
    hostvars["r1"] = LazyVars(router="gw", vllm_router_published=router())
    assert pd_preflight(hostvars, groups) == []
    assert len(kv_sizing(hostvars, groups)) == 2


@pytest.mark.parametrize("name", sorted(preflight_filters._FILTERS))
def test_each_filter_calls_its_rule_with_the_arguments_given(monkeypatch, name):
    # The filter file imports the rules on a filter's first call (plugins/filter/preflight.py says why); each
    # name must reach its function here, with the arguments as given.
    function_name = preflight_filters._FILTERS[name]
    assert callable(getattr(pf, function_name))
    monkeypatch.setattr(pf, function_name, lambda *args, **kwargs: (function_name, args, kwargs))
    assert FilterModule().filters()[name]({"a": 1}, [2], extra=3) == (function_name, ({"a": 1}, [2]), {"extra": 3})


def test_the_filters_are_the_rules_public_names():
    assert preflight_filters._FILTERS["pd_preflight"] == "_pd_preflight_filter"  # pd_preflight, warnings shown
    assert all(function == name for name, function in preflight_filters._FILTERS.items() if name != "pd_preflight")


def test_the_filter_returns_the_problems_and_shows_the_warnings_as_ansible_warnings(monkeypatch):
    shown = []

    class FakeDisplay:
        def warning(self, msg):
            shown.append(msg)

    monkeypatch.setattr(pf, "Display", FakeDisplay)
    published, groups = inventory(prefill={"p1": instance("prefill", max_model_len=8192)},
                                  decode={"d1": instance("decode", max_model_len=8192, enforce_eager="yes")})
    lines = FilterModule().filters()["pd_preflight"](published, groups, {})
    assert lines == pd_preflight(published, groups, {}) and len(lines) == 1 and lines[0].startswith("[booleans]")
    assert shown == ["PD preflight: " + line for line in pf.pd_preflight_warnings(published, groups, {})]
    assert len(shown) == 1 and shown[0].startswith("PD preflight: [drain] d1/decode-0: vllm_instance_shutdown_timeout")
    monkeypatch.setattr(pf, "Display", None)  # outside Ansible: nothing is shown, nothing fails
    assert FilterModule().filters()["pd_preflight"](published, groups, {}) == lines


# --- groups ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("group", ["prefill", "decode"])
def test_empty_prefill_or_decode_group(group):
    one(problems(**{group: {}}), "groups", f"groups['{group}']: the {group} group is empty",
        "Fix: put at least one host")


def test_no_router():
    one(problems(routers={}), "groups", "groups['router']: the router group is empty")


def test_pd_can_be_declared_off():
    assert problems(decode={}, options={"pd_enabled": False}) == []


def test_a_host_in_two_groups():
    # A host in both groups gets the pd_role of its first group, prefill.
    line = one(problems(decode={"p1": instance("prefill", address="10.0.0.11")}), "groups",
               "p1: inferops_allow_shared_hosts: the host is in the groups prefill and decode",
               "it would run only prefill instances", "inferops_allow_shared_hosts: true")
    assert "decode" in line


def test_a_shared_host_is_allowed_by_the_option_or_per_host():
    published, groups = inventory(routers={"p1": router()})
    assert any(p.startswith("[groups] p1") for p in pd_preflight(published, groups))
    assert pd_preflight(published, groups, {"allow_shared_hosts": True}) == []
    published["p1"]["allow_shared_hosts"] = True
    assert pd_preflight(published, groups) == []


def test_a_host_that_published_nothing():
    published, groups = inventory()
    groups["decode"].append("d2")
    one(pd_preflight(published, groups), "groups", "d2: groups['decode']: the host published nothing in this run "
        "(it failed above, or --limit left it out)")
    # It was in the run (ansible_play_hosts_all), so it failed; hosts --limit left out are not checked.
    one(pd_preflight(published, groups, {"play_hosts": ["p1", "d1", "d2", "r1"]}), "groups", "(it failed above)")
    assert pd_preflight(published, groups, {"play_hosts": ["p1", "d1", "r1"]}) == []


def test_pd_role_must_follow_the_group():
    one(problems(decode={"d1": instance("decode", pd_role="prefill")}), "groups",
        "d1: vllm_instance_pd_role: is 'prefill', but the host is in the decode group")


# --- instances and ports --------------------------------------------------------------------------


def test_instance_names_unique_and_valid_and_overrides_known():
    insts = [{"name": "prefill-0", "port": 8100, "kv_transfer_port": 5600},
             {"name": "prefill-0", "port": 8101, "kv_transfer_port": 5601},
             {"name": "Bad_Name", "port": 8102, "kv_transfer_port": 5602, "overrides": {"swap_space": 4}}]
    found = [p for p in problems(prefill={"p1": instance("prefill", insts)}) if p.startswith("[instances]")]
    assert len(found) == 3
    assert any("the name 'prefill-0' is used by 2 instances" in p for p in found)
    assert any("'Bad_Name' is not [a-z0-9-]" in p for p in found)
    assert any("vllm_instance_instances[Bad_Name].overrides: sets unknown settings swap_space" in p for p in found)


def test_environment_and_extra_args_overrides_are_allowed():
    insts = [{"name": "prefill-0", "port": 8100, "kv_transfer_port": 5600,
              "overrides": {"environment": {"A": "1"}, "extra_args": []}}]
    assert problems(prefill={"p1": instance("prefill", insts)}) == []


@pytest.mark.parametrize(("ports", "variable", "users"), [
    ([(8100, 5600), (8100, 5601)], "vllm_instance_instances[*].port", "prefill-0 port and prefill-1 port"),
    ([(8100, 5600), (8101, 5600)], "vllm_instance_instances[*].kv_transfer_port",
     "prefill-0 kv_transfer_port and prefill-1 kv_transfer_port"),
    ([(8100, 5600), (5600, 5601)], "vllm_instance_instances:", "prefill-0 kv_transfer_port and prefill-1 port"),
])
def test_ports_unique_per_host(ports, variable, users):
    insts = [{"name": f"prefill-{i}", "port": p, "kv_transfer_port": k} for i, (p, k) in enumerate(ports)]
    one(problems(prefill={"p1": instance("prefill", insts)}), "ports", f"p1: {variable}", users)


def test_the_same_ports_on_different_hosts_are_fine():
    prefill = {"p1": instance("prefill", address="10.0.0.11"), "p2": instance("prefill", address="10.0.0.12")}
    assert problems(prefill=prefill) == []


def test_a_port_must_be_a_port():
    insts = [{"name": "prefill-0", "port": 70000, "kv_transfer_port": "x"}]
    found = [p for p in problems(prefill={"p1": instance("prefill", insts)}) if p.startswith("[ports]")]
    assert len(found) == 2
    assert any("vllm_instance_instances[prefill-0].port: is 70000, not a port" in p for p in found)


def test_router_ports_distinct_with_the_documented_defaults():
    one(problems(routers={"r1": router(front_port=8300)}), "ports",
        "r1: vllm_router_front_port, vllm_router_port: port 8300 is used by", "default 29000")
    one(problems(routers={"r1": router(metrics_port=8300)}), "ports", "port 8300")


def test_router_ports_against_instance_ports_on_a_shared_host():
    published, groups = inventory(routers={"p1": router(front_port=8100)})
    one(pd_preflight(published, groups, {"allow_shared_hosts": True}), "ports",
        "p1: vllm_instance_instances: port 8100 is used by prefill-0 port and vllm_router_front_port")


# --- parity ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("decode_kw", "variable", "fragment"), [
    ({"model": "Qwen/Qwen2.5-0.5B"}, "vllm_instance_model", "'Qwen/Qwen2.5-0.5B' on d1 (decode)"),
    ({"revision": "abc123"}, "vllm_instance_model_revision", "'abc123' on d1 (decode)"),
    ({"dtype": "float16"}, "vllm_instance_dtype", "'auto' (= bfloat16) on p1 (prefill)"),
    ({"kv_cache_dtype": "fp8"}, "vllm_instance_kv_cache_dtype", "'fp8' (= fp8_e4m3) on d1 (decode)"),
    ({"quantization": "fp8"}, "vllm_instance_quantization", "'none' on p1 (prefill), and 'fp8' on d1 (decode)"),
    ({"version": "0.31.1"}, "vllm_install_version", "'0.31.1' on d1 (decode)"),
    ({"max_model_len": 1024}, "vllm_instance_max_model_len", "512 on p1 (prefill), and 1024 on d1 (decode)"),
])
def test_prefill_and_decode_must_agree(decode_kw, variable, fragment):
    found = problems(decode={"d1": instance("decode", **decode_kw)})
    (line,) = [p for p in found if p.startswith(f"[parity] {variable}: prefill and decode must agree")]
    assert fragment in line and "Fix:" in line


def test_parity_compares_resolved_values():
    decode = {"d1": instance("decode", dtype="bfloat16", kv_cache_dtype="bfloat16", max_model_len=0)}
    prefill = {"p1": instance("prefill", kv_cache_dtype="auto", max_model_len=8192)}
    assert problems(prefill=prefill, decode=decode) == []
    fp8 = {"d1": instance("decode", kv_cache_dtype="fp8_e4m3")}
    assert problems(prefill={"p1": instance("prefill", kv_cache_dtype="fp8")}, decode=fp8) == []


def test_parity_sees_per_instance_overrides():
    insts = [{"name": "decode-0", "port": 8200, "kv_transfer_port": 5700, "overrides": {"kv_cache_dtype": "fp8"}}]
    one(problems(decode={"d1": instance("decode", insts)}), "parity", "'fp8' (= fp8_e4m3) on d1 (decode)")


def test_revision_only_matters_for_hub_models():
    decode = {"d1": instance("decode", model="/models/m", model_is_local=True, revision="other")}
    prefill = {"p1": instance("prefill", model="/models/m", model_is_local=True)}
    found = problems(prefill=prefill, decode=decode)
    assert not any("model_revision" in p for p in found)


def test_kv_connector_parity_and_unsupported_backend():
    found = problems(decode={"d1": instance("decode", backend="nccl")})
    one(found, "parity", "vllm_instance_kv_transfer_backend", "'nccl' on d1")
    one(found, "unsupported", "d1: vllm_instance_kv_transfer_backend: is 'nccl'", "P2pNcclConnector", "use 'nixl'")


def test_prefill_block_size_must_not_exceed_decode():
    found = problems(prefill={"p1": instance("prefill", block_size=32)},
                     decode={"d1": instance("decode", block_size=16)})
    one(found, "parity", "vllm_instance_block_size: prefill's KV block size (32 on p1) exceeds decode's (16 on d1)")
    assert problems(prefill={"p1": instance("prefill", block_size=16)},
                    decode={"d1": instance("decode", block_size=32)}) == []
    # Only when both are set.
    assert problems(prefill={"p1": instance("prefill", block_size=64)}) == []


# --- model and topology ---------------------------------------------------------------------------


def write_model(tmp_path, name="model", **config: Any):
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config), encoding="utf-8")
    (directory / "model.safetensors").write_bytes(b"\0" * 1000)
    return str(directory)


def test_config_json_of_a_controller_model_is_read(tmp_path):
    path = write_model(tmp_path, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30, hidden_size=576,
                       dtype="bfloat16", max_position_embeddings=8192)
    pub = instance("prefill", model=path, model_is_local=True, facts={})
    facts = pf.model_facts(pub)
    shape = (facts.num_attention_heads, facts.num_key_value_heads, facts.num_hidden_layers, facts.head_dim)
    assert shape == (9, 3, 30, 64)
    assert facts.dtype == "bfloat16" and facts.weights_bytes == 1000 and facts.source == f"{path}/config.json"
    # config.json wins over declared facts, which fill what it lacks.
    pub["model_facts"] = {"num_attention_heads": 8, "weights_bytes": 5}
    assert pf.model_facts(pub).num_attention_heads == 9


def test_text_config_of_multimodal_models(tmp_path):
    path = write_model(tmp_path, text_config={"num_attention_heads": 32, "num_key_value_heads": 8,
                                              "num_hidden_layers": 40, "head_dim": 128}, torch_dtype="bfloat16")
    facts = pf.model_facts(instance("prefill", model=path, model_is_local=True, facts={}))
    shape = (facts.num_attention_heads, facts.num_key_value_heads, facts.head_dim, facts.dtype)
    assert shape == (32, 8, 128, "bfloat16")


def test_a_missing_controller_model(tmp_path):
    missing = str(tmp_path / "nope")
    one(problems(prefill={"p1": instance("prefill", model=missing, model_is_local=True)},
                 decode={"d1": instance("decode", model=missing, model_is_local=True)}),
        "model", "p1, d1: vllm_instance_model: is an absolute path", "is not a directory on the controller")
    (tmp_path / "empty").mkdir()
    one(problems(prefill={"p1": instance("prefill", model=str(tmp_path / "empty"), model_is_local=True)}),
        "model", "config.json' cannot be read")


def test_an_empty_model():
    one(problems(prefill={"p1": instance("prefill", model="")}), "model", "p1: vllm_instance_model: is empty.")


def test_max_model_len_within_the_models_context(tmp_path):
    both = {"max_model_len": 16384, "kv_cache_memory_bytes": 4 * GIB}
    one(problems(prefill={"p1": instance("prefill", **both)}, decode={"d1": instance("decode", **both)}),
        "model", "p1, d1: vllm_instance_max_model_len: 16384 exceeds the model's max_position_embeddings 8192",
        "at most 8192")
    path = write_model(tmp_path, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30, head_dim=64,
                       max_position_embeddings=8192, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    scaled = {**both, "model": path, "model_is_local": True, "facts": {}}
    assert problems(prefill={"p1": instance("prefill", **scaled)}, decode={"d1": instance("decode", **scaled)}) == []


def test_tensor_parallel_size_divides_the_attention_heads():
    both = {"tensor_parallel_size": 2, "kv_cache_memory_bytes": 0, "variant": "cuda"}
    line = one(problems(prefill={"p1": instance("prefill", **both)}, decode={"d1": instance("decode", **both)}),
               "topology",
               "p1, d1: vllm_instance_tensor_parallel_size: 2 does not divide the model's 9 attention heads")
    assert line.endswith("divides 9: 1, 3, 9.")


def test_tensor_parallel_size_and_kv_heads():
    facts = {"num_attention_heads": 12, "num_key_value_heads": 3, "num_hidden_layers": 4, "head_dim": 64}
    both = {"tensor_parallel_size": 2, "facts": facts, "variant": "cuda"}
    one(problems(prefill={"p1": instance("prefill", **both)}, decode={"d1": instance("decode", **both)}),
        "topology", "2 and the model's 3 KV heads (vllm_instance_model_facts) do not divide one another")


def test_pipeline_stages_not_above_the_layers():
    facts = {**SMOL, "num_hidden_layers": 2}
    both = {"pipeline_parallel_size": 4, "facts": facts}
    one(problems(prefill={"p1": instance("prefill", **both)}, decode={"d1": instance("decode", **both)}),
        "topology", "vllm_instance_pipeline_parallel_size: 4 stages for a model with 2 layers")


def test_gpus_per_instance_equal_tp_times_pp():
    insts = [{"name": "prefill-0", "port": 8100, "kv_transfer_port": 5600, "gpus": [0]}]
    facts = QWEN14
    found = problems(prefill={"p1": instance("prefill", insts, facts=facts, tensor_parallel_size=2)},
                     decode={"d1": instance("decode", facts=facts, tensor_parallel_size=2)})
    one(found, "topology", "p1: vllm_instance_instances[prefill-0].gpus: lists 1 GPU(s), but",
        "= 2 x 1 = 2", "list exactly 2 GPUs")


def test_no_gpu_twice_on_a_host():
    insts = [{"name": "prefill-0", "port": 8100, "kv_transfer_port": 5600, "gpus": [0]},
             {"name": "prefill-1", "port": 8101, "kv_transfer_port": 5601, "gpus": ["0"]}]
    one(problems(prefill={"p1": instance("prefill", insts)}), "topology",
        "p1: vllm_instance_instances[*].gpus: GPU 0 is given 2 times (prefill-0 and prefill-1)")


def test_decode_tp_smaller_than_prefill_tp_is_refused_for_many_kv_heads():
    found = problems(prefill={"p1": instance("prefill", facts=QWEN14, tensor_parallel_size=4)},
                     decode={"d1": instance("decode", facts=QWEN14, tensor_parallel_size=2)})
    one(found, "topology", "decode's tensor parallel size 2 (d1) is smaller than prefill's 4 (p1)",
        "the model has 8 KV heads", "num_key_value_heads <= decode's TP")


def test_decode_tp_smaller_is_fine_with_few_kv_heads():
    mqa = {**QWEN14, "num_key_value_heads": 1}
    assert problems(prefill={"p1": instance("prefill", facts=mqa, tensor_parallel_size=4)},
                    decode={"d1": instance("decode", facts=mqa, tensor_parallel_size=2)}) == []
    gqa2 = {**QWEN14, "num_key_value_heads": 2}
    assert problems(prefill={"p1": instance("prefill", facts=gqa2, tensor_parallel_size=4)},
                    decode={"d1": instance("decode", facts=gqa2, tensor_parallel_size=2)}) == []


def test_decode_tp_smaller_with_unknown_kv_heads_asks_for_the_facts():
    found = problems(prefill={"p1": instance("prefill", facts={}, tensor_parallel_size=2)},
                     decode={"d1": instance("decode", facts={}, tensor_parallel_size=1)})
    one(found, "topology", "num_key_value_heads is unknown", "declare num_key_value_heads in vllm_instance_model_facts")


def test_tp_sizes_must_be_multiples():
    facts = {**QWEN14, "num_attention_heads": 48, "num_key_value_heads": 12}
    found = problems(prefill={"p1": instance("prefill", facts=facts, tensor_parallel_size=2)},
                     decode={"d1": instance("decode", facts=facts, tensor_parallel_size=3)})
    one(found, "topology", "prefill's tensor parallel size 2 (p1) and decode's 3 (d1) are not multiples")
    assert problems(prefill={"p1": instance("prefill", facts=facts, tensor_parallel_size=2)},
                    decode={"d1": instance("decode", facts=facts, tensor_parallel_size=4)}) == []


# --- quantization ---------------------------------------------------------------------------------


def test_unknown_quantization_method():
    both = {"quantization": "int4"}
    one(problems(prefill={"p1": instance("prefill", **both)}, decode={"d1": instance("decode", **both)}),
        "quantization", "p1, d1: vllm_instance_quantization: 'int4' is not a weight quantization method",
        "awq, gptq, bitsandbytes")


def test_quantization_on_a_pre_quantized_checkpoint(tmp_path):
    path = write_model(tmp_path, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30, head_dim=64,
                       torch_dtype="float16", quantization_config={"quant_method": "awq", "bits": 4})
    both = {"model": path, "model_is_local": True, "facts": {}, "quantization": "awq"}
    one(problems(prefill={"p1": instance("prefill", **both)}, decode={"d1": instance("decode", **both)}),
        "quantization", "is 'awq', but the checkpoint is already quantized", "quant_method 'awq'",
        "leave vllm_instance_quantization empty")
    both["quantization"] = ""
    assert problems(prefill={"p1": instance("prefill", **both)}, decode={"d1": instance("decode", **both)}) == []


def test_pre_quantized_hub_model_from_declared_facts():
    facts = {**SMOL, "quantization_config": {"quant_method": "gptq"}}
    both = {"facts": facts, "quantization": "gptq"}
    one(problems(prefill={"p1": instance("prefill", **both)}, decode={"d1": instance("decode", **both)}),
        "quantization", "quant_method 'gptq'")


# --- KV sizing and capacity ------------------------------------------------------------------------


def sized(**kw: Any) -> dict[str, Any]:
    published, groups = inventory(prefill={"p1": instance("prefill", **kw)}, decode={})
    (only,) = kv_sizing(published, groups)
    return only


def test_kv_sizing_reproduces_the_sandbox_figures():
    """SmolLM2-135M, 1 GiB, CPU block 128: 364 blocks / 46592 tokens (auto = bf16), 728 / 93184 with fp8."""
    auto = sized(kv_cache_dtype="auto")
    assert (auto["bytes_per_token"], auto["block_size"], auto["num_blocks"], auto["tokens"]) == (23040, 128, 364, 46592)
    assert auto["exact"] and auto["block_size_is_default"] and auto["max_len_requests"] == 46592 // 512
    fp8 = sized(kv_cache_dtype="fp8")
    assert (fp8["bytes_per_token"], fp8["num_blocks"], fp8["tokens"]) == (11520, 728, 93184)
    assert fp8["summary"].startswith("p1/prefill-0 (prefill): 93184 tokens in 728 blocks of 128 = 182 requests")


def test_kv_sizing_helpers():
    assert kv_bytes_per_token(30, 3, 64, 2) == 23040
    assert kv_blocks(GIB, 128, 23040) == 364
    # TP splits KV heads (replicated when fewer than ranks), PP splits layers (largest stage counts).
    assert kv_bytes_per_token(48, 8, 128, 1, tp=2) == 2 * 48 * 4 * 128
    assert kv_bytes_per_token(48, 2, 128, 1, tp=4) == 2 * 48 * 1 * 128
    assert kv_bytes_per_token(30, 3, 64, 2, pp=4) == 2 * 8 * 3 * 64 * 2
    assert kv_blocks(100, 0, 10) == 0


def test_kv_sizing_dtype_bytes_and_gpu_block_default():
    assert sized(dtype="float32", facts={**SMOL, "torch_dtype": "float32"})["kv_dtype_bytes"] == 4
    assert sized(facts={**SMOL, "torch_dtype": "float32"})["kv_dtype_bytes"] == 2  # auto: fp16 for fp32 checkpoints
    gpu = sized(variant="cuda")
    assert gpu["block_size"] == 16 and gpu["num_blocks"] == GIB // (16 * 23040)


def test_kv_sizing_upper_bound_from_gpu_memory():
    s = sized(kv_cache_memory_bytes=0, gpu_memory_utilization=0.5, gpu_memory_bytes=2 * GIB,
              facts={**SMOL, "weights_bytes": 269060552}, variant="cuda")
    assert s["budget"] == "gpu_memory_utilization" and not s["exact"]
    assert s["budget_bytes"] == GIB - 269060552
    assert s["tokens"] == (GIB - 269060552) // (16 * 23040) * 16
    assert "at most" in s["summary"] and "an upper bound" in s["summary"]


def test_kv_sizing_unknowns_are_said():
    s = sized(kv_cache_memory_bytes=0, variant="cuda")
    assert s["budget"] == "unknown" and s["tokens"] is None
    assert "declare vllm_instance_gpu_memory_bytes" in s["summary"]
    s = sized(facts={})
    assert s["bytes_per_token"] is None and "declare them in vllm_instance_model_facts" in s["summary"]


def test_kv_sizing_without_groups_uses_the_published_role():
    published = inventory()[0]
    assert [(s["host"], s["role"]) for s in kv_sizing(published)] == [("p1", "prefill"), ("d1", "decode")]


def test_a_budget_that_cannot_hold_one_request():
    both = {"kv_cache_memory_bytes": 64 << 20, "max_model_len": 8192}
    one(problems(prefill={"p1": instance("prefill", **both)}, decode={"d1": instance("decode", **both)}),
        "capacity", "p1, d1: vllm_instance_kv_cache_memory_bytes: the KV cache holds 2816 tokens",
        "less than one request of max_model_len 8192", "at most 2816")


def test_max_model_len_0_means_the_models_own():
    both = {"kv_cache_memory_bytes": 64 << 20, "max_model_len": 0}
    one(problems(prefill={"p1": instance("prefill", **both)}, decode={"d1": instance("decode", **both)}),
        "capacity", "max_model_len 8192")


def test_num_gpu_blocks_override_above_what_fits():
    both = {"num_gpu_blocks_override": 1000}
    one(problems(prefill={"p1": instance("prefill", **both)}, decode={"d1": instance("decode", **both)}),
        "capacity", "vllm_instance_num_gpu_blocks_override: asks for 1000 KV blocks", "holds only 364 blocks",
        "lower it to at most 364")


def test_num_gpu_blocks_override_below_one_request():
    both = {"num_gpu_blocks_override": 2}
    one(problems(prefill={"p1": instance("prefill", **both)}, decode={"d1": instance("decode", **both)}),
        "capacity", "caps the KV cache at 2 blocks x 128 tokens = 256 tokens", "raise it to at least 4")
    assert sized(num_gpu_blocks_override=100)["tokens"] == 12800


def test_upper_bound_too_small_for_one_request():
    both = {"kv_cache_memory_bytes": 0, "gpu_memory_utilization": 0.1, "gpu_memory_bytes": 1 << 26, "variant": "cuda",
            "max_model_len": 8192}
    one(problems(prefill={"p1": instance("prefill", **both)}, decode={"d1": instance("decode", **both)}),
        "capacity", "vllm_instance_gpu_memory_utilization: the KV cache holds at most")


def test_kv_cache_memory_bytes_above_the_gpu():
    both = {"kv_cache_memory_bytes": 2 * GIB, "gpu_memory_bytes": GIB, "variant": "cuda"}
    one(problems(prefill={"p1": instance("prefill", **both)}, decode={"d1": instance("decode", **both)}),
        "capacity", "2147483648 B of KV cache per GPU do not fit in the GPU's 1073741824 B")


@pytest.mark.parametrize(("kw", "fragment"), [
    ({"block_size": 24}, "vllm_instance_block_size: is 24; vLLM accepts 1, 8, 16, 32, 64, 128"),
    ({"kv_cache_memory_bytes": 0, "gpu_memory_utilization": 1.5}, "vllm_instance_gpu_memory_utilization: is 1.5"),
    ({"num_gpu_blocks_override": "many"}, "vllm_instance_num_gpu_blocks_override: is 'many', not a whole number"),
])
def test_capacity_settings_must_be_valid(kw, fragment):
    one(problems(prefill={"p1": instance("prefill", **kw)}, decode={"d1": instance("decode", **kw)}),
        "capacity", fragment)


# --- unsupported asks -----------------------------------------------------------------------------


def test_the_roles_refused_settings_with_their_alternative():
    msg = "--swap-space was removed from vLLM; preempted requests are recomputed. Size the KV cache instead."
    one(problems(decode={"d1": instance("decode", unsupported={"vllm_instance_swap_space": msg})}), "unsupported",
        "d1: vllm_instance_swap_space: is set, but --swap-space was removed", "Fix: remove vllm_instance_swap_space.")


@pytest.mark.parametrize(("dtype", "fragment"), [
    ("int2", "no 2-bit KV cache"), ("2bit", "no 2-bit KV cache"), ("int8", "no 8-bit integer KV cache"),
    ("fp4", "no 4-bit KV cache"), ("float16x", "not a KV cache dtype vLLM 0.32 supports"),
])
def test_low_bit_kv_cache(dtype, fragment):
    both = {"kv_cache_dtype": dtype}
    one(problems(prefill={"p1": instance("prefill", **both)}, decode={"d1": instance("decode", **both)}),
        "unsupported", f"vllm_instance_kv_cache_dtype: is '{dtype}'", fragment, "use 'fp8'")


# --- client, network, secrets, booleans -----------------------------------------------------------


def test_client_timeout_against_max_model_len():
    long = {"max_model_len": 131072, "kv_cache_memory_bytes": 8 * GIB,
            "facts": {**SMOL, "max_position_embeddings": 131072}}
    prefill, decode = {"p1": instance("prefill", **long)}, {"d1": instance("decode", **long)}
    one(problems(prefill=prefill, decode=decode, options={"client_timeout_seconds": 120}), "client",
        "inferops_client_timeout_seconds: is 120 s, but one request of max_model_len 131072 tokens",
        "at inferops_min_tokens_per_second 20 tokens/s takes 6554 s", "at least 6554 s", "at most 2400")
    assert problems(prefill=prefill, decode=decode, options={"client_timeout_seconds": 7200}) == []
    assert problems(prefill=prefill, decode=decode, options={"client_timeout_seconds": None}) == []
    options = {"client_timeout_seconds": 7200, "min_tokens_per_second": 10}
    one(problems(prefill=prefill, decode=decode, options=options), "client", "13108 s")


def test_client_timeout_must_be_a_number():
    one(problems(options={"client_timeout_seconds": "soon"}), "client", "is 'soon', not a positive number")


# --- drain on stop -----------------------------------------------------------------------------------


def warnings(published=None, groups=None, options=None, **inv: Any) -> list[str]:
    if published is None:
        published, groups = inventory(**inv)
    return pf.pd_preflight_warnings(published, groups, options or {})


def test_a_drain_shorter_than_the_longest_request_is_a_warning_not_a_problem():
    long = {"max_model_len": 8192}
    prefill, decode = {"p1": instance("prefill", **long)}, {"d1": instance("decode", **long)}
    assert problems(prefill=prefill, decode=decode) == []
    (line,) = warnings(prefill=prefill, decode=decode)
    assert line == (
        "[drain] d1/decode-0: vllm_instance_shutdown_timeout: is 60 s, but one request of max_model_len 8192 tokens "
        "at inferops_min_tokens_per_second 20 tokens/s takes 410 s: a stop or restart of the instance (a changed "
        "config, a removed instance, a host shutdown) aborts the requests still running after 60 s. Fix: raise it "
        "to at least 410 (systemd then waits up to 425 s for the stop), lower vllm_instance_max_model_len to at most "
        "1200, or accept that the longest requests are cut off by a stop.")


def test_the_drain_check_uses_the_minimum_rate_and_the_models_own_length():
    decode = {"d1": instance("decode", max_model_len=0, facts={**SMOL, "max_position_embeddings": 4096})}
    assert "takes 205 s" in warnings(decode=decode)[0]
    assert "takes 410 s" in warnings(decode=decode, options={"min_tokens_per_second": 10})[0]
    assert warnings(decode=decode, options={"min_tokens_per_second": 100}) == []
    assert warnings(decode={"d1": instance("decode", max_model_len=0, facts={})}) == []  # length unknown


@pytest.mark.parametrize(("timeout", "warned"), [(409, True), (410, False), (3600, False)])
def test_a_drain_as_long_as_the_longest_request_is_fine(timeout, warned):
    decode = {"d1": instance("decode", max_model_len=8192, shutdown_timeout=timeout)}
    assert bool(warnings(decode=decode)) is warned


def test_no_drain_at_all_is_said():
    (line,) = warnings(decode={"d1": instance("decode", shutdown_timeout=0)})
    assert "vllm_instance_shutdown_timeout: is 0 s (no drain: a stop aborts every running request), but one " \
           "request of max_model_len 512 tokens at inferops_min_tokens_per_second 20 tokens/s takes 26 s" in line
    assert line.endswith("Fix: raise it to at least 26 (systemd then waits up to 41 s for the stop), or accept that "
                         "the longest requests are cut off by a stop.")


def test_prefill_instances_are_not_measured_against_the_generation_rate():
    assert warnings(prefill={"p1": instance("prefill", max_model_len=8192, shutdown_timeout=0)}) == []


def test_the_drain_warning_names_each_instance_and_its_override():
    decode = {"d1": instance("decode", max_model_len=8192, instances=[
        {"name": "decode-0", "port": 8200, "kv_transfer_port": 5700},
        {"name": "decode-1", "port": 8201, "kv_transfer_port": 5701, "overrides": {"shutdown_timeout": 30}},
        {"name": "decode-2", "port": 8202, "kv_transfer_port": 5702, "overrides": {"shutdown_timeout": 900}},
    ])}
    found = warnings(decode=decode)
    assert len(found) == 2, found
    assert found[0].startswith("[drain] d1/decode-0: vllm_instance_shutdown_timeout: is 60 s")
    assert found[1].startswith("[drain] d1/decode-1: vllm_instance_instances[decode-1].overrides.shutdown_timeout: "
                               "is 30 s")


@pytest.mark.parametrize("value", ["soon", -1, True, 1.5])
def test_the_drain_must_be_whole_seconds(value):
    found = problems(decode={"d1": instance("decode", shutdown_timeout=value)})
    one(found, "drain", f"d1: vllm_instance_shutdown_timeout: is {pf._show(value)}, not a whole number of seconds >= 0")
    assert not [line for line in found if line.startswith("[launcher]")], found  # not twice


def test_an_invalid_minimum_rate_is_a_problem_of_the_drain_check_without_a_client_timeout():
    one(problems(options={"min_tokens_per_second": 0}), "drain", "inferops_min_tokens_per_second: is 0")
    found = problems(options={"min_tokens_per_second": 0, "client_timeout_seconds": 60})
    one(found, "client", "inferops_min_tokens_per_second: is 0")
    assert not [line for line in found if line.startswith("[drain]")], found


def test_the_drain_of_an_older_publish_is_the_roles_default():
    pub = instance("decode", max_model_len=8192)
    for entry in (pub["settings"], *(i["settings"] for i in pub["instances"])):
        entry.pop("shutdown_timeout", None)
    assert "is 60 s" in warnings(decode={"d1": pub})[0]


def test_extra_args_cannot_set_the_drain_and_the_fix_names_the_variable():
    found = problems(decode={"d1": instance("decode", extra_args=["--shutdown-timeout", "0"])})
    one(found, "launcher", "d1/decode-0: vllm_instance_extra_args: the launcher on the host would refuse the "
        "instance's extra.args[0]: \"--shutdown-timeout\" is not allowed",
        "Fix: set vllm_instance_shutdown_timeout (or an instance's overrides.shutdown_timeout) instead (it renders "
        "server.shutdown_timeout).")


# --- KV load failures on decode ------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["retry", "Recompute", "", None, True])
def test_an_unknown_kv_load_failure_policy_is_refused_on_every_host(value):
    found = problems(prefill={"p1": instance("prefill", kv_load_failure_policy=value)},
                     decode={"d1": instance("decode", kv_load_failure_policy=value)})
    one(found, "unsupported", f"p1, d1: vllm_instance_kv_load_failure_policy: is {pf._show(value)}, not a KV load "
        "failure policy of vLLM 0.32 (recompute, fail).", "Fix: use 'recompute'")
    assert len(found) == 1, found  # the launcher check does not say it again for d1


@pytest.mark.parametrize("value", ["recompute", "fail"])
def test_the_kv_load_failure_policies_of_vllm(value):
    assert problems(decode={"d1": instance("decode", kv_load_failure_policy=value)}) == []


def test_a_kv_load_failure_policy_override_is_named():
    decode = {"d1": instance("decode", instances=[
        {"name": "decode-0", "port": 8200, "kv_transfer_port": 5700, "overrides": {"kv_load_failure_policy": "skip"}},
        {"name": "decode-1", "port": 8201, "kv_transfer_port": 5701}])}
    one(problems(decode=decode), "unsupported",
        "d1/decode-0: vllm_instance_instances[decode-0].overrides.kv_load_failure_policy: is 'skip'")


# --- the TOML each instance gets (the role's renderer, plugins/plugin_utils/_instance_toml.py) --------------


def rendered(published, groups, host: str, name: str) -> dict[str, Any]:
    inv = pf._load(published, groups, None)
    (inst,) = [i for i in inv.instances if i.host == host and i.name == name]
    return pf._launcher_config(inv, inst)[0]


def test_an_instances_toml_does_not_change_when_a_peer_host_is_added_or_removed():
    before = inventory()
    after = inventory(decode={"d1": instance("decode", address="10.0.0.21"),
                              "d2": instance("decode", address="10.0.0.22")},
                      prefill={"p1": instance("prefill", address="10.0.0.11"),
                               "p2": instance("prefill", address="10.0.0.12")})
    assert problems(*after) == []
    for host, name in (("p1", "prefill-0"), ("d1", "decode-0")):
        config = rendered(*before, host, name)
        assert config == rendered(*after, host, name)
        assert "prefill_instances" not in config["pd_disaggregation"]
        assert "decode_instances" not in config["pd_disaggregation"]
        assert launcher().validate(config) == []


def test_the_toml_carries_the_drain_and_the_decodes_kv_load_failure_policy():
    published, groups = inventory(decode={"d1": instance("decode", shutdown_timeout=300)})
    prefill, decode = rendered(published, groups, "p1", "prefill-0"), rendered(published, groups, "d1", "decode-0")
    assert prefill["server"]["shutdown_timeout"] == 60 and decode["server"]["shutdown_timeout"] == 300
    assert "kv_load_failure_policy" not in prefill["pd_disaggregation"]
    assert decode["pd_disaggregation"]["kv_load_failure_policy"] == "recompute"
    args = launcher().build(decode, None)[0]
    assert args[args.index("--shutdown-timeout") + 1] == "300"
    transfer = args[args.index("--kv-transfer-config") + 1]
    assert '"kv_load_failure_policy":"recompute","kv_role":"kv_consumer"' in transfer


def test_loopback_side_channel_across_hosts():
    found = problems(prefill={"p1": instance("prefill", address="127.0.0.1", source="vllm_instance_host_address")})
    one(found, "network", "p1: vllm_instance_host_address: is '127.0.0.1', a loopback/unspecified address")
    for address in ("localhost", "::1", "0.0.0.0", "127.0.1.1"):
        assert pf._loopback(address)
    assert not pf._loopback("10.0.0.1") and not pf._loopback("gpu-01")


def test_loopback_is_fine_on_a_single_host_and_fallbacks_are_not_checked():
    shared = instance("prefill", address="127.0.0.1", source="vllm_instance_host_address")
    published, groups = inventory(prefill={"h1": shared}, decode={"h1": shared}, routers={"h1": router()})
    assert pd_preflight(published, groups, {"allow_shared_hosts": True}) == []
    assert problems(prefill={"p1": instance("prefill", address="127.0.0.1", source="ansible_host")}) == []


def test_two_hosts_with_one_address():
    explicit = {"source": "vllm_instance_host_address", "address": "10.0.0.9"}
    one(problems(prefill={"p1": instance("prefill", **explicit)}, decode={"d1": instance("decode", **explicit)}),
        "network", "p1, d1: vllm_instance_host_address: 2 hosts publish the same address '10.0.0.9'")


def test_router_needs_client_keys_unless_unauthenticated_on_purpose():
    one(problems(routers={"r1": router(api_keys_count=0)}), "secrets", "r1: vllm_router_api_keys: lists no client key",
        "vllm_router_allow_unauthenticated: true")
    assert problems(routers={"r1": router(api_keys_count=0, allow_unauthenticated=True)}) == []


def test_instances_need_a_key_when_the_router_has_keys():
    keyless = {"prefill": {"p1": instance("prefill", api_key=False)},
               "decode": {"d1": instance("decode", api_key=False)}}
    found = problems(**keyless)
    one(found, "secrets", "p1, d1: vllm_instance_api_key: is empty while the router requires client keys")
    assert problems(**keyless, routers={"r1": router(api_keys_count=0, allow_unauthenticated=True)}) == []


def test_undefined_vault_references():
    found = problems(decode={"d1": instance("decode", api_key=False, api_key_broken=True)},
                     routers={"r1": router(api_keys_count=0, api_keys_broken=True)})
    assert len([p for p in found if "refers to an undefined variable" in p]) == 2


def test_tls_certificate_and_key_together():
    one(problems(routers={"r1": router(tls_certificate=True)}), "secrets", "only one of them is set")


def test_booleans_are_booleans():
    insts = [{"name": "decode-0", "port": 8200, "kv_transfer_port": 5700, "overrides": {"trust_remote_code": "no"}}]
    found = problems(
        prefill={"p1": instance("prefill", enforce_eager="yes", enable_chunked_prefill="true",
                                booleans={"vllm_install_wheelhouse_keep": 1})},
        decode={"d1": instance("decode", insts)},
        routers={"r1": router(allow_unauthenticated="false")},
    )
    lines = [p for p in found if p.startswith("[booleans]")]
    assert len(lines) == 5, "\n".join(found)
    assert any("p1: vllm_instance_enforce_eager: is 'yes' (a string), not a boolean" in p for p in lines)
    assert any("p1: vllm_instance_enable_chunked_prefill: is 'true' (a string)" in p and "(or null" in p for p in lines)
    assert any("vllm_instance_instances[decode-0].overrides.trust_remote_code: is 'no'" in p for p in lines)
    assert any("vllm_install_wheelhouse_keep: is 1 (an integer)" in p for p in lines)
    assert any("r1: vllm_router_allow_unauthenticated: is 'false'" in p for p in lines)


def test_allow_shared_hosts_must_be_a_boolean():
    published, groups = inventory()
    published["p1"]["allow_shared_hosts"] = "yes"
    one(pd_preflight(published, groups), "booleans", "p1: inferops_allow_shared_hosts: is 'yes'")
    one(pd_preflight(inventory()[0], groups, {"allow_shared_hosts": "yes"}), "booleans", "inferops_allow_shared_hosts")


# --- scale ------------------------------------------------------------------------------------------


def test_a_thousand_hosts_in_well_under_a_second_each_way():
    prefill = {f"p{i}": instance("prefill", address=f"10.1.{i // 250}.{i % 250}") for i in range(500)}
    decode = {f"d{i}": instance("decode", address=f"10.2.{i // 250}.{i % 250}", kv_cache_dtype="fp8")
              for i in range(500)}
    published, groups = inventory(prefill=prefill, decode=decode)
    start = time.perf_counter()
    found = pd_preflight(published, groups)
    sizes = kv_sizing(published, groups)
    elapsed = time.perf_counter() - start
    assert len(found) == 1 and "and 496 more (decode)" in found[0]
    assert len(sizes) == 1000 and sizes[-1]["tokens"] == 93184
    assert elapsed < 5, f"{elapsed:.2f} s"
