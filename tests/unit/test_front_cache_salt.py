"""Tenant isolation of the prefix cache (vllm_router_front_cache_salt_per_key, issue #25) in the front the
vllm_router role renders (tests/gateway/render.yml on tests/preflight/good, no host contacted). What njs does
with the body, against real nginx + njs: tests/gateway/run.sh; on real vLLM: molecule's test_cache_salt.py."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_front_fallback import GATEWAY, PLAIN, _location, _ok, _render
from test_preflight_inventories import ANSIBLE_PLAYBOOK

pytestmark = pytest.mark.skipif(ANSIBLE_PLAYBOOK is None, reason="ansible-playbook is not installed")

GATEWAY_VARS = json.loads((GATEWAY / "vars.json").read_text(encoding="utf-8"))
SALTED = ("/v1/completions", "/v1/chat/completions")
UNSALTED = ("/v1/models", "/tokenize", "/detokenize")
SET_BODY = "proxy_set_body $inferops_vllm_salted_body;"


@pytest.fixture(scope="module")
def sites(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("front-cache-salt")
    jobs = {
        # njs is loaded for the salt alone (without fallbacks and with hide_internals off).
        "salt_only": {**PLAIN, "vllm_router_front_cache_salt_per_key": True, "vllm_router_front_hide_internals": False},
        # The gateway's: salt, fallbacks and hide_internals together.
        "salt_fallbacks": GATEWAY_VARS,
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_render, tmp / name, extra) for name, extra in jobs.items()}
        runs = {name: (f.result(), tmp / name / "router-1") for name, f in futures.items()}
    out = {}
    for name, (run, path) in runs.items():
        _ok(run)
        out[name] = (path / "inferops-vllm.conf").read_text()
    return out


def test_the_gateway_turns_the_salt_on():
    # Otherwise tests/gateway/run.sh would not test it, nor the second key it uses.
    assert GATEWAY_VARS["vllm_router_front_cache_salt_per_key"] is True
    assert len(GATEWAY_VARS["vllm_router_api_keys"]) == 2


@pytest.mark.parametrize("name", ["salt_only", "salt_fallbacks"])
def test_the_completion_bodies_get_the_keys_salt_and_nothing_else_does(sites, name):
    site = sites[name]
    assert "js_import inferops from inferops-vllm-fallback.js;" in site
    assert site.count("js_set $inferops_vllm_salted_body inferops.saltedBody;") == 1
    for route in SALTED:
        loc = _location(site, f"= {route}")
        # After the proxy include (whose proxy_pass it completes), once.
        include = loc.index("include /etc/nginx/inferops-vllm-proxy.conf;")
        assert loc.count(SET_BODY) == 1 and loc.index(SET_BODY) > include
    for route in UNSALTED:
        assert "proxy_set_body" not in _location(site, f"= {route}"), route
    assert "proxy_set_body" not in _location(site, "= /health")
    # Every body njs may read stays in memory: the buffer is the largest body the front accepts.
    assert "client_max_body_size 64m;\n" in site
    assert "client_body_buffer_size 64m;\n    client_body_in_single_buffer on;" in site


def test_with_fallbacks_a_cloud_gets_its_own_body_not_the_salted_one(sites):
    site = sites["salt_fallbacks"]
    for index in (0, 1):
        loc = _location(site, f"@inferops_vllm_fallback_{index}")
        assert f"proxy_set_body $inferops_fallback_body_{index};" in loc
        assert SET_BODY not in loc
    # The local routes keep both: the salt on the way in, the opaque ids on the way out.
    loc = _location(site, "= /v1/chat/completions")
    assert SET_BODY in loc and "js_body_filter inferops.localBody" in loc
    assert "error_page 429 500 502 503 504 = @inferops_vllm_fallback_0;" in loc


def test_without_hide_internals_only_the_salt_runs_njs(sites):
    site = sites["salt_only"]
    assert "js_header_filter" not in site and "js_body_filter" not in site
    assert "js_set $inferops_fallback" not in site and "@inferops_vllm_fallback" not in site
