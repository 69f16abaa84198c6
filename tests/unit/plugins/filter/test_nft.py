"""Unit tests for the inferops.vllm.nft_elements filter (roles/vllm_firewall's address sets)."""

from __future__ import annotations

import ipaddress

import pytest
from ansible.errors import AnsibleFilterError
from ansible_collections.inferops.vllm.plugins.filter.nft import FilterModule, nft_elements


def test_an_address_inside_a_cidr_is_merged_into_it():
    # nft -f fails on `elements = { 10.0.0.0/8, 10.1.2.3 }` in an interval set: "conflicting intervals".
    assert nft_elements(["10.1.2.3", "10.0.0.0/8"], "ipv4") == ["10.0.0.0/8"]
    assert nft_elements(["fd00::/8", "fd00:10::5"], "ipv6") == ["fd00::/8"]


def test_families_are_split_sorted_and_deduplicated():
    out = nft_elements(["10.0.0.21", "fd00::1", "10.0.0.11", "10.0.0.21", "FD00:0:0::1", "192.168.0.0/16", "::1"])
    assert out == {"ipv4": ["10.0.0.11", "10.0.0.21", "192.168.0.0/16"], "ipv6": ["::1", "fd00::1"]}
    assert nft_elements(["fd00::1"], "ipv4") == []
    assert nft_elements(["10.0.0.1"], "ipv6") == []


def test_adjacent_networks_become_one_and_single_addresses_have_no_prefix():
    assert nft_elements(["192.168.1.0/25", "192.168.1.128/25", "10.0.0.1/32"], "ipv4") == ["10.0.0.1", "192.168.1.0/24"]
    assert nft_elements(["fd00:0:0:0::/64", "fd00::7/128"], "ipv6") == ["fd00::/64"]


def test_host_bits_and_whitespace_are_dropped():
    # As the PD preflight reads them (ip_network(strict=False)).
    assert nft_elements([" 10.1.2.3/8 ", "0.0.0.0/0"], "ipv4") == ["0.0.0.0/0"]


def test_no_overlap_whatever_the_input():
    values = ["10.0.0.0/8", "10.1.2.3", "10.1.0.0/16", "10.255.255.255", "11.0.0.1", "11.0.0.0/31", "11.0.0.2"]
    nets = [ipaddress.ip_network(e) for e in nft_elements(values, "ipv4")]
    assert nets == sorted(nets)
    assert not any(a.overlaps(b) for i, a in enumerate(nets) for b in nets[i + 1:])
    assert [str(n) for n in nets] == ["10.0.0.0/8", "11.0.0.0/31", "11.0.0.2/32"]


def test_empty_or_none_gives_empty_lists():
    assert nft_elements(None) == {"ipv4": [], "ipv6": []}
    assert nft_elements([], "ipv6") == []


def test_bad_entries_are_named_after_what():
    with pytest.raises(AnsibleFilterError) as exc:
        nft_elements(
            ["10.0.0.1", "prometheus.example.internal", "10.30.0.0/33", "fe80::1%eth0", "[fd00::1]"],
            what="web1: vllm_firewall_api_sources",
        )
    msg = str(exc.value)
    assert msg.startswith("web1: vllm_firewall_api_sources: 'prometheus.example.internal', '10.30.0.0/33', ")
    assert "'fe80::1%eth0', '[fd00::1]' are no IP address or CIDR" in msg
    with pytest.raises(AnsibleFilterError, match=r"web1: x: 'nope' is no IP address or CIDR"):
        nft_elements(["nope"], what="web1: x")


@pytest.mark.parametrize("value", ["10.0.0.1", {"a": "10.0.0.1"}, 5])
def test_not_a_list_is_refused(value):
    with pytest.raises(AnsibleFilterError, match=r"^h: vllm_firewall_api_sources: is .*, not a list"):
        nft_elements(value, what="h: vllm_firewall_api_sources")


def test_unknown_family_is_refused():
    with pytest.raises(AnsibleFilterError, match=r"family is 'inet'"):
        nft_elements(["10.0.0.1"], "inet")


def test_registered_under_its_name():
    assert FilterModule().filters()["nft_elements"] is nft_elements
