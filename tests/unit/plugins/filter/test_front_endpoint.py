"""inferops.vllm.front_endpoint: where clients reach the router host's front (plugins/filter/pd.py)."""

from __future__ import annotations

import pytest
from ansible_collections.inferops.vllm.plugins.filter.pd import FilterModule, front_endpoint

GROUPS = {"router": ["r1", "r2"], "prefill": ["p1"], "decode": ["d1"]}


def endpoint(options=None, **router_vars):
    return front_endpoint({"r1": {"ansible_host": "10.0.0.5", **router_vars}, "r2": {}}, GROUPS, options)


def test_plain_http_from_ansible_host_by_default():
    out = endpoint()
    assert (out["url"], out["api_url"], out["tls"], out["host_source"], out["router"], out["problems"]) == (
        "http://10.0.0.5:8000", "http://10.0.0.5:8000/v1", False, "ansible_host", "r1", [])


def test_https_and_port_from_the_router_variables():
    out = endpoint(vllm_router_tls_certificate="/pki/front.pem", vllm_router_front_port=8443)
    assert out["url"] == "https://10.0.0.5:8443" and out["scheme"] == "https"


@pytest.mark.parametrize(("options", "router_vars", "host", "source"), [
    ({"host": "llm.example.com"}, {"vllm_router_front_server_name": "other"}, "llm.example.com", "the host option"),
    ({}, {"vllm_router_front_server_name": "llm.example.com", "vllm_router_front_bind": "10.0.0.9"}, "llm.example.com",
     "vllm_router_front_server_name"),
    ({}, {"vllm_router_front_server_name": "_", "vllm_router_front_bind": "10.0.0.9"}, "10.0.0.9",
     "vllm_router_front_bind"),
    ({}, {"vllm_router_front_bind": "::"}, "10.0.0.5", "ansible_host"),
    ({}, {"vllm_router_front_bind": "fd00::5"}, "fd00::5", "vllm_router_front_bind"),
])
def test_the_host_part(options, router_vars, host, source):
    out = endpoint(options, **router_vars)
    assert (out["host"], out["host_source"], out["problems"]) == (host, source, [])
    if ":" in host:
        assert out["url"] == f"http://[{host}]:8000"


def test_the_inventory_name_when_there_is_no_address():
    out = front_endpoint({"r1": {}}, {"router": ["r1"]})
    assert (out["url"], out["host_source"]) == ("http://r1:8000", "inventory_hostname")


def test_refused_without_router_or_on_loopback():
    out = front_endpoint({}, {"router": []})
    assert out["url"] is None and out["problems"][0].startswith("[front] router: the inventory has no router host")
    out = endpoint({"host_variable": "vllm_client_config_front_host"}, vllm_router_front_bind="127.0.0.1")
    assert "vllm_router_front_bind: is '127.0.0.1'" in out["problems"][0]
    assert "vllm_client_config_front_host" in out["problems"][0]
    out = front_endpoint({"r1": {"ansible_host": "127.0.0.1"}}, {"router": ["r1"]})
    assert "ansible_host: is '127.0.0.1', a loopback address" in out["problems"][0]
    # An address given on purpose (a proxy on the router host) is accepted.
    assert endpoint({"host": "proxy.example.com"}, vllm_router_front_bind="127.0.0.1")["problems"] == []
    out = endpoint(vllm_router_front_port="http")
    assert "vllm_router_front_port: is 'http', not a port number" in out["problems"][0]


def test_registered():
    assert FilterModule().filters()["front_endpoint"] is front_endpoint
