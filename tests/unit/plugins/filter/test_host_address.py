"""host_address_problems: vllm_instance_host_address must be one of the host's own addresses (issue #24).

An address the host does not have passed the controller's preflight (which has no facts) and stopped the instances
at start, after every host had been changed. The role's preflight now refuses it with the host's facts.
"""

from __future__ import annotations

import pytest
from ansible_collections.inferops.vllm.plugins.filter.preflight import FilterModule
from ansible_collections.inferops.vllm.plugins.plugin_utils import _preflight as pf

OWN = ["10.88.0.5", "192.168.7.20", "fd00::5", "fe80::a8c1:abff:fe12:3456%eth0"]


@pytest.mark.parametrize("address", ["10.88.0.5", "192.168.7.20", "fd00::5", "fe80::a8c1:abff:fe12:3456",
                                     "[fd00::5]", "127.0.0.1", "::1", "0.0.0.0"])
def test_an_address_of_the_host_or_loopback_passes(address):
    # Loopback and unspecified are the controller's rule (allowed when prefill and decode share the host).
    assert pf.host_address_problems(address, "pd-1", OWN) == []


def test_an_address_the_host_does_not_have_is_refused_with_the_hosts_addresses_and_the_fix():
    problems = pf.host_address_problems("192.0.2.77", "pd-1", OWN)
    assert len(problems) == 1, problems
    line = problems[0]
    assert line.startswith("[network] pd-1: vllm_instance_host_address: is '192.0.2.77', which is not an address of "
                           "this host (its addresses: 10.88.0.5, 192.168.7.20, fd00::5, fe80::a8c1:abff:fe12:3456)")
    assert "fail at start, after the hosts were changed" in line
    assert line.endswith("Fix: set it to this host's address on the KV network, or remove it to use the default "
                         "route's address.")


def test_a_name_is_not_an_address():
    problems = pf.host_address_problems("pd-1.example.net", "pd-1", OWN)
    assert len(problems) == 1 and "is 'pd-1.example.net', not an IP address" in problems[0], problems


def test_no_address_in_the_facts_leaves_nothing_to_compare():
    assert pf.host_address_problems("192.0.2.77", "pd-1", []) == []
    assert pf.host_address_problems("192.0.2.77", "pd-1", None) == []


def test_the_filter_is_registered():
    assert FilterModule().filters()["host_address_problems"].__name__ == "host_address_problems"
