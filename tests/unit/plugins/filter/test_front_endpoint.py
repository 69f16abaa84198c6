"""inferops.vllm.front_endpoint: where clients reach the router host's front (plugins/filter/pd.py)."""

from __future__ import annotations

import pytest
from ansible_collections.inferops.vllm.plugins.filter.pd import FilterModule, front_endpoint

GROUPS = {"router": ["r1", "r2"], "prefill": ["p1"], "decode": ["d1"]}
# What roles/vllm_router/tasks/publish.yml publishes with the role's defaults (the keys front_endpoint reads).
DEFAULTS = {"front_port": 8000, "front_bind": "0.0.0.0", "front_server_name": "", "ansible_host": "", "tls": False}
# The record's key for each router variable these tests set.
KEYS = {"vllm_router_front_port": "front_port", "vllm_router_front_bind": "front_bind",
        "vllm_router_front_server_name": "front_server_name", "ansible_host": "ansible_host"}


def record(**router_vars):
    """vllm_router_published of a router host with these variables (tls: vllm_router_tls_certificate set)."""
    out = dict(DEFAULTS)
    for name, value in router_vars.items():
        if name == "vllm_router_tls_certificate":
            out["tls"] = bool(value)
        else:
            out[KEYS[name]] = value
    return out


def endpoint(options=None, **router_vars):
    published = record(ansible_host="10.0.0.5", **router_vars)
    return front_endpoint({"r1": {"vllm_router_published": published}, "r2": {}}, GROUPS, options)


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
    out = front_endpoint({"r1": {"vllm_router_published": record()}}, {"router": ["r1"]})
    assert (out["url"], out["host_source"]) == ("http://r1:8000", "inventory_hostname")


def test_refused_without_router_or_on_loopback():
    out = front_endpoint({}, {"router": []})
    assert out["url"] is None and out["problems"][0].startswith("[front] router: the inventory has no router host")
    out = endpoint({"host_variable": "vllm_client_config_front_host"}, vllm_router_front_bind="127.0.0.1")
    assert "vllm_router_front_bind: is '127.0.0.1'" in out["problems"][0]
    assert "vllm_client_config_front_host" in out["problems"][0]
    out = front_endpoint({"r1": {"vllm_router_published": record(ansible_host="127.0.0.1")}}, {"router": ["r1"]})
    assert "ansible_host: is '127.0.0.1', a loopback address" in out["problems"][0]
    # An address given on purpose (a proxy on the router host) is accepted.
    assert endpoint({"host": "proxy.example.com"}, vllm_router_front_bind="127.0.0.1")["problems"] == []
    out = endpoint(vllm_router_front_port="http")
    assert "vllm_router_front_port: is 'http', not a port number" in out["problems"][0]


@pytest.mark.parametrize(("published", "url"), [
    (record(ansible_host="10.0.0.5"), "http://10.0.0.5:8000"),
    (record(ansible_host="10.0.0.5", vllm_router_tls_certificate="/pki/front.pem"), "https://10.0.0.5:8000"),
    (record(ansible_host="10.0.0.5", vllm_router_front_port=9443, vllm_router_tls_certificate="x"),
     "https://10.0.0.5:9443"),
    (record(ansible_host="fd00::5", vllm_router_front_port="8100"), "http://[fd00::5]:8100"),
    # As set_fact may publish it: the booleans as text.
    ({**record(ansible_host="10.0.0.5"), "tls": "True", "front_port": "8443"}, "https://10.0.0.5:8443"),
    ({**record(ansible_host="10.0.0.5"), "tls": "False"}, "http://10.0.0.5:8000"),
])
def test_the_url_comes_from_the_router_record_alone(published, url):
    """Only vllm_router_published is read: router variables beside it are not (the record has them resolved)."""
    hostvars = {"r1": {"vllm_router_published": published, "vllm_router_front_port": 1,
                       "vllm_router_tls_certificate": "/ignored.pem" if url.startswith("http:") else ""}}
    out = front_endpoint(hostvars, {"router": ["r1"]})
    port, scheme = int(url.rsplit(":", 1)[1]), url.split(":")[0]
    assert (out["url"], out["port"], out["scheme"], out["problems"]) == (url, port, scheme, [])
    assert isinstance(out["port"], int)


def test_a_router_that_published_nothing():
    for hostvars in ({"r1": {"vllm_router_front_port": 8000}}, {}):
        out = front_endpoint(hostvars, {"router": ["r1"]})
        assert out["url"] is None and out["router"] == "r1"
        assert out["problems"] == [
            "[front] r1: vllm_router_published: the router host published no settings in this run, so where its "
            "front listens is unknown. Fix: run the play on the router host too (no --limit that leaves it out); the "
            "first play of playbooks/client_config.yml and playbooks/benchmark.yml publishes it (the vllm_router "
            "role's tasks_from: publish), contacting no host."]


def test_registered():
    assert FilterModule().filters()["front_endpoint"] is front_endpoint
