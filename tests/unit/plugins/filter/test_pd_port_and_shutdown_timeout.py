"""Unit tests for the ``port`` and ``shutdown_timeout`` of each instance in the inferops.vllm.pd_instances filter.

``shutdown_timeout`` comes from the host's published settings, with the instance's overrides over them
(roles/vllm_instance publishes it templated, so it may be a string); ``port`` is the instance's API port.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ansible_collections.inferops.vllm.plugins.filter.pd import pd_instances

FILTERS = Path(__file__).resolve().parents[4] / "plugins" / "filter"


def published(address, instances, **settings):
    return {
        "vllm_instance_published": {
            "pd_role": "x",
            "address": address,
            "served_model_name": "m",
            "instances": instances,
            "settings": {"kv_cache_dtype": "auto", "block_size": 0, **settings},
        }
    }


def by_name(out):
    return {inst["name"]: inst for inst in out}


def test_port_and_shutdown_timeout_from_settings_and_overrides():
    hostvars = {
        "p1": published("10.0.0.11", [
            {"name": "prefill-0", "port": 8100, "kv_transfer_port": 5600},
            {"name": "prefill-1", "port": "8101", "kv_transfer_port": 5601, "overrides": {"shutdown_timeout": 300}},
        ], shutdown_timeout=60),
        "d1": published("10.0.0.21", [
            {"name": "decode-0", "port": 8200, "kv_transfer_port": 5700},
            {"name": "decode-1", "port": 8201, "kv_transfer_port": 5701, "overrides": {"shutdown_timeout": "0"}},
        ], shutdown_timeout="600"),
    }
    out = by_name(pd_instances(hostvars, ["p1"], ["d1"]))

    assert {name: (i["port"], i["shutdown_timeout"]) for name, i in out.items()} == {
        "prefill-0": (8100, 60),  # the host's setting
        "prefill-1": (8101, 300),  # its override wins; a port given as text is a number
        "decode-0": (8200, 600),  # published templated, as text
        "decode-1": (8201, 0),  # an override of 0 (no drain) stays 0
    }
    for inst in out.values():
        assert isinstance(inst["port"], int) and isinstance(inst["shutdown_timeout"], int)
        assert inst["url"].endswith(f":{inst['port']}")
    # The override is the instance's own: the host's other instance keeps the host's setting.
    assert out["prefill-0"]["shutdown_timeout"] == 60


def test_shutdown_timeout_is_zero_when_not_published():
    hostvars = {"d1": published("10.0.0.21", [{"name": "decode-0", "port": 8200, "kv_transfer_port": 5700}])}
    (inst,) = pd_instances(hostvars, [], ["d1"])
    assert inst["shutdown_timeout"] == 0 and inst["port"] == 8200


def test_an_override_without_shutdown_timeout_keeps_the_host_setting():
    hostvars = {"d1": published("10.0.0.21", [
        {"name": "decode-0", "port": 8200, "kv_transfer_port": 5700, "overrides": {"block_size": 16}},
    ], shutdown_timeout=90)}
    (inst,) = pd_instances(hostvars, [], ["d1"])
    assert inst["shutdown_timeout"] == 90
    assert inst["expected"]["block_size"] == 16


def test_every_entry_has_the_documented_keys():
    hostvars = {"p1": published("fd00::11", [{"name": "prefill-0", "port": 8100, "kv_transfer_port": 5600}],
                                shutdown_timeout=60)}
    (inst,) = pd_instances(hostvars, ["p1"], [])
    assert set(inst) == {"name", "host", "role", "url", "port", "kv_transfer_port", "shutdown_timeout", "expected"}
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load((FILTERS / "pd_instances.yml").read_text())
    assert set(inst) == set(doc["RETURN"]["_value"]["contains"])
    assert doc["RETURN"]["_value"]["contains"]["shutdown_timeout"]["type"] == "int"
    assert doc["RETURN"]["_value"]["contains"]["port"]["type"] == "int"
    assert inst["url"] == "http://[fd00::11]:8100" and inst["port"] == 8100
