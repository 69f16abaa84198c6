"""Documented vllm_router behaviour checked through the role's own preflight and templates (tests/gateway/render.yml
on tests/preflight/good, no host contacted): the router's log level stays at info or above (at debug vllm-router
0.1.17 writes every prompt to its journal), and vllm_router_front_extra_routes opens exactly the routes it lists,
with their methods, to key holders only, beside the OpenAI routes."""

from __future__ import annotations

import re

import pytest
from test_front_fallback import PLAIN, _location, _render
from test_preflight_inventories import ANSIBLE_PLAYBOOK

pytestmark = pytest.mark.skipif(ANSIBLE_PLAYBOOK is None, reason="ansible-playbook is not installed")

EMBEDDINGS = {"path": "/v1/embeddings", "methods": ["POST"]}


@pytest.mark.parametrize(("settings", "refusal"), [
    # The role's argument spec refuses the level itself...
    ({"vllm_router_log_level": "debug"},
     "value of vllm_router_log_level must be one of: info, warning, error, critical, got: debug"),
    # ...and its preflight (the PD preflight's `router` rule) the same level passed around it.
    ({"vllm_router_extra_args": ["--log-level", "debug"]},
     "[router] router-1: vllm_router_extra_args: sets --log-level or --log-dir"),
], ids=["log_level", "extra_args"])
def test_the_router_refuses_a_debug_log_level(tmp_path, settings, refusal):
    run = _render(tmp_path, {**PLAIN, **settings})
    output = run.stdout + run.stderr
    assert run.returncode != 0, output[-3000:]
    assert refusal in output, output[-3000:]
    assert not (tmp_path / "router-1" / "inferops-vllm.conf").exists()


def test_extra_routes_open_exactly_the_listed_routes_to_key_holders(tmp_path):
    run = _render(tmp_path / "extra", {**PLAIN, "vllm_router_front_extra_routes": [EMBEDDINGS]})
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    site = (tmp_path / "extra" / "router-1" / "inferops-vllm.conf").read_text()
    plain = _render(tmp_path / "plain", PLAIN)
    assert plain.returncode == 0, (plain.stdout + plain.stderr)[-3000:]
    base = (tmp_path / "plain" / "router-1" / "inferops-vllm.conf").read_text()
    routes = set(re.findall(r"location = (/\S+) \{", site))
    assert routes - set(re.findall(r"location = (/\S+) \{", base)) == {"/v1/embeddings"}
    block = _location(site, "= /v1/embeddings")
    # Its methods only (405 with Allow otherwise), a key required (401), and passed to the router replicas.
    assert "if ($request_method !~ ^(POST)$)" in block and 'add_header Allow "POST" always;' in block
    assert 'if ($inferops_vllm_client = "")' in block and "error_page 418 = @inferops_vllm_unauthorized;" in block
    assert "include /etc/nginx/inferops-vllm-proxy.conf;" in block
    # The same checks as an OpenAI route of the front.
    completions = _location(site, "= /v1/completions")
    assert block.replace("/v1/embeddings", "X").replace("POST", "M") == \
        completions.replace("/v1/completions", "X").replace("POST", "M")


@pytest.mark.parametrize("route", [
    {"path": "/v1/embeddings; return 200", "methods": ["POST"]},
    {"path": "/v1/embeddings", "methods": ["PUT"]},
], ids=["path", "method"])
def test_extra_routes_refuse_a_bad_path_or_method(tmp_path, route):
    run = _render(tmp_path, {**PLAIN, "vllm_router_front_extra_routes": [route]})
    output = run.stdout + run.stderr
    assert run.returncode != 0, output[-3000:]
    assert "[router] router-1: vllm_router_front_extra_routes: is " in output, output[-3000:]
    assert "not a list of {path: /exact/path, methods: [POST]}" in output, output[-3000:]


def test_every_route_answers_its_per_key_limit_with_retry_after(tmp_path):
    """nginx drops the server's error_page directives in a location that has one of its own (the failed-key
    limit's): each route must name the per-key limit's 429 page again, or a client over its limit gets a 429
    without Retry-After (seen in molecule)."""
    run = _render(tmp_path, PLAIN)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    site = (tmp_path / "router-1" / "inferops-vllm.conf").read_text()
    assert "location @inferops_vllm_limited {\n        add_header Retry-After 1 always;" in site
    routes = re.findall(r"location = (/\S+) \{", site)
    assert "/v1/completions" in routes
    for route in routes:
        block = _location(site, f"= {route}")
        if "error_page" in block and route != "/health":
            assert "error_page 429 @inferops_vllm_limited;" in block, block
