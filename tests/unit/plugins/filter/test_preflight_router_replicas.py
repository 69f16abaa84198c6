"""Unit tests for the router replicas in the ports check of the inferops.vllm.pd_preflight filter.

vllm-router runs vllm_router_replicas processes (default 2): replica N listens on vllm_router_port + N and
vllm_router_metrics_port + N, so those ports must not collide with vllm_router_front_port, the other base port or
an instance's ports on the same host. The inventories are built with the helpers of test_preflight.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from ansible_collections.inferops.vllm.plugins.plugin_utils._preflight import pd_preflight
from ansible_collections.inferops.vllm.tests.unit.plugins.filter.test_preflight import (
    inventory,
    one,
    problems,
    router,
)

KEY = "k" * 24


def ports(found: list[str]) -> list[str]:
    return [p for p in found if p.startswith("[ports]")]


def from_host_variables(**router_vars: Any) -> list[str]:
    """The problems of the default inventory whose router host r1 has ``router_vars`` as inventory variables,
    as roles/vllm_router/tasks/publish.yml publishes them (vllm_router_published, the role's defaults else)."""
    published, groups = inventory()
    hostvars: dict[str, Any] = {h: {"vllm_instance_published": e["instance"]}
                                for h, e in published.items() if e["instance"]}
    record = router(**{key.removeprefix("vllm_router_"): value for key, value in router_vars.items()})
    hostvars["r1"] = {"vllm_router_published": record}
    return pd_preflight(hostvars, groups)


# --- published router settings --------------------------------------------------------------------


def test_replica_port_collides_with_the_front_port():
    line = one(problems(routers={"r1": router(port=8300, front_port=8301, replicas=2)}), "ports",
               "[ports] r1: vllm_router_front_port, vllm_router_port: port 8301 is used by ",
               "vllm_router_port + 1 (router replica 1)", "vllm_router_front_port.", "distinct values")
    assert "router replica 1" in line


def test_replica_port_collides_with_the_metrics_port():
    found = problems(routers={"r1": router(port=8300, metrics_port=8301, replicas=2)})
    line = one(found, "ports", "r1: vllm_router_metrics_port, vllm_router_port: port 8301 is used by ",
               "vllm_router_port + 1 (router replica 1) and vllm_router_metrics_port")
    # The metrics port of replica 1 (8302) collides with nothing: one problem only.
    assert "8302" not in line


def test_no_collision_with_one_replica():
    assert ports(problems(routers={"r1": router(port=8300, front_port=8301, replicas=1)})) == []
    assert ports(problems(routers={"r1": router(port=8300, metrics_port=8301, replicas=1)})) == []
    assert problems(routers={"r1": router(port=8300, front_port=8301, metrics_port=8302, replicas=1)}) == []


def test_no_collision_when_the_replicas_fit_between_the_ports():
    assert problems(routers={"r1": router(port=8300, front_port=8302, metrics_port=8304, replicas=2)}) == []


@pytest.mark.parametrize("replicas", [2, "2", 2.0])
def test_replicas_given_as_text_or_float_count_too(replicas):
    one(problems(routers={"r1": router(port=8300, front_port=8301, replicas=replicas)}), "ports",
        "port 8301 is used by vllm_router_port + 1 (router replica 1)")


def test_every_replica_is_checked_and_named():
    found = ports(problems(routers={"r1": router(port=8300, metrics_port=8302, front_port=8000, replicas=4)}))
    # 8300-8303 for the replicas' API, 8302-8305 for their metrics: 8302 and 8303 are used twice.
    assert len(found) == 2, found
    assert any("port 8302 is used by vllm_router_port + 2 (router replica 2) and vllm_router_metrics_port." in p
               for p in found), found
    assert any("port 8303 is used by vllm_router_port + 3 (router replica 3) and vllm_router_metrics_port + 1 "
               "(router replica 1)." in p for p in found), found


def test_metrics_replica_collides_with_the_front_port():
    one(problems(routers={"r1": router(metrics_port=29000, front_port=29001, replicas=2)}), "ports",
        "r1: vllm_router_front_port, vllm_router_metrics_port: port 29001 is used by "
        "vllm_router_metrics_port + 1 (router replica 1) and vllm_router_front_port.")


def test_replica_port_collides_with_an_instance_on_a_shared_host():
    published, groups = inventory(routers={"p1": router(port=8099, front_port=8000, replicas=2)})
    one(pd_preflight(published, groups, {"allow_shared_hosts": True}), "ports",
        "p1: vllm_instance_instances: port 8100 is used by prefill-0 port and vllm_router_port + 1 "
        "(router replica 1).")


def test_replica_port_beyond_65535_is_not_a_port():
    found = ports(problems(routers={"r1": router(port=65535, metrics_port=29000, front_port=8000, replicas=2)}))
    assert len(found) == 1, found
    assert found[0].startswith("[ports] r1: vllm_router_port")
    assert "65536" in found[0] and "not a port (1-65535)" in found[0]


def test_replicas_on_different_router_hosts_do_not_collide():
    routers = {"r1": router(port=8300, front_port=8000, replicas=2), "r2": router(port=8299, front_port=8000,
                                                                                  replicas=2)}
    assert ports(problems(routers=routers)) == []


# --- router host variables (as the role publishes them for playbooks/preflight.yml) -----------------------------------


def test_host_variables_default_to_two_replicas():
    # vllm_router_replicas unset: the role's default, 2, so replica 1 takes 8301.
    line = one(from_host_variables(vllm_router_front_port=8301), "ports",
               "r1: vllm_router_front_port, vllm_router_port: port 8301 is used by vllm_router_port + 1 "
               "(router replica 1) and vllm_router_front_port.")
    assert "default 8300" in line
    one(from_host_variables(vllm_router_metrics_port=8301), "ports",
        "r1: vllm_router_metrics_port, vllm_router_port: port 8301 is used by vllm_router_port + 1 (router replica 1)")


def test_host_variables_with_one_replica_have_no_collision():
    assert from_host_variables(vllm_router_front_port=8301, vllm_router_replicas=1) == []
    assert from_host_variables(vllm_router_metrics_port=8301, vllm_router_replicas="1") == []


def test_host_variables_with_three_replicas():
    assert ports(from_host_variables(vllm_router_front_port=8303, vllm_router_replicas=3)) == []
    one(from_host_variables(vllm_router_front_port=8302, vllm_router_replicas="3"), "ports",
        "port 8302 is used by vllm_router_port + 2 (router replica 2) and vllm_router_front_port.")
