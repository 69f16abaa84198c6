"""Unit tests for the inferops.vllm.pd_instances filter."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest
from ansible.errors import AnsibleFilterError
from ansible_collections.inferops.vllm.plugins.filter.pd import FilterModule, pd_instances, url_host


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


HOSTVARS = {
    "p1": published("10.0.0.11", [
        {"name": "prefill-0", "port": 8100, "kv_transfer_port": 5600},
        {"name": "prefill-1", "port": "8101", "kv_transfer_port": 5601, "overrides": {"block_size": 16}},
    ], kv_cache_dtype="fp8"),
    "d1": published("10.0.0.21", [{"name": "decode-0", "port": 8200, "kv_transfer_port": 5700}], block_size=16),
    "r1": {"inventory_hostname": "r1"},
}


def test_lists_every_instance_prefill_first_with_urls_and_expected_settings():
    out = pd_instances(HOSTVARS, ["p1"], ["d1"])
    assert [(i["host"], i["name"], i["role"], i["url"]) for i in out] == [
        ("p1", "prefill-0", "prefill", "http://10.0.0.11:8100"),
        ("p1", "prefill-1", "prefill", "http://10.0.0.11:8101"),
        ("d1", "decode-0", "decode", "http://10.0.0.21:8200"),
    ]
    assert out[0]["expected"] == {"kv_cache_dtype": "fp8", "block_size": None}
    # Per-instance overrides win over the host's settings; 0 means vLLM's default (None).
    assert out[1]["expected"] == {"kv_cache_dtype": "fp8", "block_size": 16}
    assert out[2]["expected"] == {"kv_cache_dtype": "auto", "block_size": 16}
    assert out[1]["kv_transfer_port"] == 5601


def test_hosts_that_published_nothing_are_named():
    with pytest.raises(AnsibleFilterError, match=r"published no instances in this run: r1, ghost"):
        pd_instances(HOSTVARS, ["p1", "r1"], ["ghost"])


def test_empty_groups_give_an_empty_list():
    assert pd_instances(HOSTVARS, [], None) == []


def test_registered_under_its_name():
    assert FilterModule().filters()["pd_instances"] is pd_instances
    assert FilterModule().filters()["url_host"] is url_host


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("fd00::1", "[fd00::1]"),
        ("::1", "[::1]"),
        ("[fd00::1]", "[fd00::1]"),
        (" fd00::1 ", "[fd00::1]"),
        ("10.0.0.11", "10.0.0.11"),
        ("pd1.example.internal", "pd1.example.internal"),
    ],
)
def test_url_host_brackets_ipv6_literals_only(host, expected):
    assert url_host(host) == expected


def test_ipv6_addresses_are_bracketed_in_urls():
    hostvars = {"p6": published("fd00::11", [{"name": "prefill-0", "port": 8100, "kv_transfer_port": 5600}])}
    (inst,) = pd_instances(hostvars, ["p6"], [])
    assert inst["url"] == "http://[fd00::11]:8100"
    # What vllm_firewall reads from it (urlsplit) still works.
    assert urlsplit(inst["url"]).port == 8100 and urlsplit(inst["url"]).hostname == "fd00::11"
