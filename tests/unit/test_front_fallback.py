"""The front's fallback endpoints (vllm_router_front_fallbacks, issue #13) through the real ansible-playbook.

tests/gateway/render.yml runs the vllm_router role's own preflight and templates on tests/preflight/good (no
host contacted): the rendered nginx configuration is checked line by line here, and its behaviour against
real nginx + njs by tests/gateway/run.sh (podman). The PD preflight (playbooks/preflight.yml) refuses bad
fallback settings before any host is changed, with the exact lines below; the role's preflight refuses a
host name without a DNS resolver. No key ever appears in an output.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from ansible_collections.inferops.vllm.plugins.plugin_utils import _preflight as pf
from test_preflight_inventories import ANSIBLE_PLAYBOOK, CASES_DIR, REPO, playbook_env

pytestmark = pytest.mark.skipif(ANSIBLE_PLAYBOOK is None, reason="ansible-playbook is not installed")

GOOD = CASES_DIR / "good"
GATEWAY = REPO / "tests" / "gateway"
ROUTER = REPO / "roles" / "vllm_router"
# The gateway's variables without vllm_router_front_cache_salt_per_key: the fallback alone here; the salt, also
# with fallbacks, in tests/unit/test_front_cache_salt.py.
VARS = {k: v for k, v in json.loads((GATEWAY / "vars.json").read_text(encoding="utf-8")).items()
        if k != "vllm_router_front_cache_salt_per_key"}
KEYS = [fb["api_key"] for fb in VARS["vllm_router_front_fallbacks"]]
PLAIN = {"vllm_router_front_allow_plaintext": True}


def _render(out: Path, extra: dict) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [ANSIBLE_PLAYBOOK, "-i", str(GOOD), str(GATEWAY / "render.yml"),
         "-e", json.dumps({"out_dir": str(out), "ansible_python_interpreter": sys.executable, **extra})],
        cwd=REPO, env=playbook_env(), capture_output=True, text=True, timeout=300, check=False)


def _preflight(extra: dict) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [ANSIBLE_PLAYBOOK, "-i", str(GOOD), str(REPO / "playbooks" / "preflight.yml"), "-e", json.dumps(extra)],
        cwd=REPO, env=playbook_env(), capture_output=True, text=True, timeout=300, check=False)


def _endpoint(**changes) -> dict:
    base = {"name": "openai", "url": "https://api.openai.com/v1", "api_key": "sk-test-fallback-key-0001",
            "models": {"smollm2-135m-instruct": "gpt-4o-mini"}}
    return {k: v for k, v in {**base, **changes}.items() if v is not None}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("front-fallback")
    jobs = {
        "fallbacks": lambda: _render(tmp / "fallbacks", VARS),
        "none": lambda: _render(tmp / "none", PLAIN),
        "rate_fallback": lambda: _render(tmp / "rate_fallback", {
            **VARS, "vllm_router_front_fallback_on_rate_limit": True}),
        "none_shown": lambda: _render(tmp / "none_shown", {**PLAIN, "vllm_router_front_hide_internals": False}),
        "no_rate_fallback": lambda: _render(tmp / "no_rate_fallback", {
            **VARS, "vllm_router_front_fallback_on_rate_limit": False,
            "vllm_router_front_fallback_first_byte_timeout": 0,
        }),
        "no_resolver": lambda: _render(tmp / "no_resolver", {
            **PLAIN, "vllm_router_front_fallbacks": [_endpoint()], "vllm_router_front_fallback_resolver": []}),
        "pd_preflight": lambda: _preflight({"vllm_router_front_fallbacks": [
            _endpoint(name="nokey", api_key=None),
            _endpoint(name="plain", url="http://cloud.example.com/v1"),
            _endpoint(name="nomap", models={"other-model": "gpt-4o-mini"}),
            _endpoint(name="loop", url="http://127.0.0.1:9000/v1"),
            _endpoint(name="allowed", url="http://10.1.2.3/v1", allow_plaintext=True),
            # Issue #25: the loopback exemption holds for IP literals only (a name goes through DNS).
            _endpoint(name="localname", url="http://localhost:9000/v1"),
            _endpoint(name="loop6", url="http://[::1]:9000/v1"),
        ]}),
        "pd_undefined": lambda: _preflight({"vllm_router_front_fallbacks": [
            _endpoint(api_key="{{ vault_openai_api_key_not_loaded }}")]}),
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        return {name: (f.result(), tmp / name / "router-1") for name, f in futures.items()}


def _ok(run) -> str:
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    for key in KEYS:
        assert key not in output
    return output


def _location(site: str, name: str) -> str:
    start = site.index(f"location {name} {{")
    return site[start:site.index("\n    }\n", start)]


def test_the_front_falls_back_from_the_generation_routes_only(runs):
    run, out = runs["fallbacks"]
    _ok(run)
    site = (out / "inferops-vllm.conf").read_text()
    for route in ("/v1/completions", "/v1/chat/completions"):
        loc = _location(site, f"= {route}")
        assert "error_page 429 500 502 503 504 = @inferops_vllm_fallback_0;" in loc
        assert "recursive_error_pages on;" in loc and "proxy_intercept_errors on;" in loc
        assert "add_header X-Inferops-Served-By local always;" in loc
    for route in ("/v1/models", "/tokenize", "/detokenize"):
        # Only the failed-key redirect (issue #25), never a fallback.
        assert "@inferops_vllm_fallback" not in _location(site, f"= {route}")
        assert "error_page 418 = @inferops_vllm_unauthorized;" in _location(site, f"= {route}")
    # njs only on the fallback path, one body variable per endpoint, the body in memory.
    assert "js_import inferops from inferops-vllm-fallback.js;" in site
    assert "js_set $inferops_fallback_body_0 inferops.fallbackBody;" in site
    assert "js_set $inferops_fallback_body_1 inferops.fallbackBody;" in site
    assert "js_var $inferops_fallback_max_body 4194304;" in site
    assert "client_body_buffer_size 4m;\n    client_body_in_single_buffer on;" in site
    # Names resolved per request: a resolver, a variable in proxy_pass, no upstream block for an endpoint.
    assert "resolver 127.0.0.1:5353;" in site
    assert "upstream inferops_vllm_fallback" not in site


def test_each_endpoint_has_its_host_path_key_models_timeouts_and_tls(runs):
    run, out = runs["fallbacks"]
    _ok(run)
    site = (out / "inferops-vllm.conf").read_text()
    first, last = _location(site, "@inferops_vllm_fallback_0"), _location(site, "@inferops_vllm_fallback_1")
    for line in ("set $inferops_fallback_name cloud-a;",
                 "set $inferops_fallback_models '{\"smollm2-135m-instruct\":\"gpt-cloud-mini\"}';",
                 'set $inferops_fallback_upstream_0 "cloud.test:18443";',
                 "rewrite ^/v1/(.*)$ /v1/$1? break;",
                 # Issue #25: the cost controls, and only mapped models.
                 "set $inferops_fallback_rpm 1000;", "set $inferops_fallback_max_tokens 100;",
                 "return 404 $inferops_fallback_unmapped_0;",
                 "include /etc/nginx/inferops-vllm-fallback-0.conf;",
                 "include /etc/nginx/inferops-vllm-fallback-proxy.conf;",
                 "proxy_set_body $inferops_fallback_body_0;",
                 "proxy_pass https://$inferops_fallback_upstream_0;",
                 'proxy_set_header Host "cloud.test:18443";',
                 "proxy_ssl_name cloud.test;",
                 "proxy_ssl_trusted_certificate /etc/nginx/inferops-test-ca.pem;",
                 "proxy_connect_timeout 3s;", "proxy_read_timeout 30s;",
                 "error_page 401 403 407 429 500 502 503 504 = @inferops_vllm_fallback_1;",
                 "access_log /var/log/nginx/inferops-vllm-fallback.cloud-a.limited.count inferops_vllm_tick "
                 "if=$inferops_fb_limited;"):
        assert line in first, line
    assert "rewrite ^/v1/(.*)$ /openai/v1/$1? break;" in last
    # An endpoint over its budget: the next one (a bare 429 for error_page), the last one answers our 429.
    budget_if = first[first.index("if ($inferops_fallback_over_budget_0)"):]
    assert budget_if[:budget_if.index("}")].rstrip().endswith("return 429;")
    assert "fallback_budget_exhausted" in last and "add_header Retry-After 60 always;" in last
    assert "set $inferops_fallback_rpm 20;" in last and "set $inferops_fallback_max_tokens 4096;" in last
    for i in (0, 1):
        assert f"js_set $inferops_fallback_unmapped_{i} inferops.unmapped;" in site
        assert f"js_set $inferops_fallback_over_budget_{i} inferops.overBudget;" in site
    assert "js_var $inferops_fallback_budget_dir /var/lib/nginx/inferops-vllm-budget;" in site
    assert "proxy_connect_timeout 5s;" in last and "proxy_read_timeout 300s;" in last
    assert "error_page 401 403 407 = @inferops_vllm_fallback_auth;" in last
    assert "error_page 502 504 =503 @inferops_vllm_fallback_unavailable;" in last
    # Every `if` before the rewrite (`rewrite ... break` ends the rewrite directives).
    assert first.index("if ($inferops_fallback_too_big)") < first.index("rewrite ^/v1/")
    assert first.index("if ($inferops_fallback_unmapped_0)") < first.index("if ($inferops_fallback_over_budget_0)")
    assert first.index("if ($inferops_fallback_over_budget_0)") < first.index("rewrite ^/v1/")
    assert "inferops-vllm-fallback.none.other.count" in _location(site, "@inferops_vllm_fallback_unavailable")
    proxy = (out / "inferops-vllm-fallback-proxy.conf").read_text()
    for line in ("proxy_pass_request_headers off;", "proxy_ssl_verify on;", "proxy_hide_header Set-Cookie;",
                 "js_body_filter inferops.body buffer_type=buffer;",
                 "add_header X-Inferops-Served-By fallback always;"):
        assert line in proxy, line
    assert "Accept-Encoding" not in proxy.replace("No Accept-Encoding", "")
    # The key file holds the key and nothing of it is anywhere else.
    for i, key in enumerate(KEYS):
        key_file = (out / f"inferops-vllm-fallback-{i}.conf").read_text()
        assert f'proxy_set_header Authorization "Bearer {key}";' in key_file
        assert key not in site + proxy
    # The stub_status server serves the counters, for vllm_monitoring.
    assert "location = /fallback_metrics {\n        js_content inferops.metrics;" in site
    published = json.loads((out / "published.json").read_text())
    assert published["fallback_metrics_url"] == "http://127.0.0.1:8090/fallback_metrics"


def test_the_first_byte_timeout_is_the_read_timeout_of_the_local_side(runs):
    run, out = runs["fallbacks"]
    _ok(run)
    assert "proxy_read_timeout 2s;" in (out / "inferops-vllm-proxy.conf").read_text()
    run, out = runs["no_rate_fallback"]
    _ok(run)
    assert "proxy_read_timeout 1800s;" in (out / "inferops-vllm-proxy.conf").read_text()


def test_without_fallbacks_the_front_is_as_before(runs):
    run, out = runs["none"]
    _ok(run)
    site = (out / "inferops-vllm.conf").read_text()
    for absent in ("js_set", "js_var", "resolver", "fallback_", "X-Inferops-Served-By"):
        assert absent not in site, absent
    # Failed keys counted per address (vllm_router_front_failed_key_rate): through @inferops_vllm_unauthorized.
    assert "limit_req_zone $inferops_vllm_failed_key_addr zone=inferops_vllm_failed_keys:10m rate=60r/m;" in site
    unauthorized = _location(site, "@inferops_vllm_unauthorized")
    assert "limit_req zone=inferops_vllm_failed_keys burst=20 nodelay;" in unauthorized
    assert "try_files /inferops-vllm-no-such-file =401;" in unauthorized
    # vllm_router_front_hide_internals (default true): njs filters the answers of every route, nothing else.
    assert "js_import inferops from inferops-vllm-fallback.js;" in site
    for route in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize"):
        loc = _location(site, f"= {route}")
        assert "js_header_filter inferops.localHeaders;" in loc and "js_body_filter inferops.localBody" in loc
    # /health follows vllm-router's /readiness (issue #24): njs answers ok / degraded / unavailable from it, read
    # through an internal location; the gateway tests (tests/gateway) check the answers on real nginx.
    assert "js_content inferops.health;" in _location(site, "= /health")
    readiness = _location(site, "= /_inferops_vllm_readiness")
    assert "internal;" in readiness and "proxy_pass http://inferops_vllm_router/readiness;" in readiness
    assert "proxy_pass_request_headers off;" in readiness and "error_page" not in readiness
    # vllm_router_front_cache_salt_per_key (default false): bodies pass as the client sent them.
    assert "proxy_set_body" not in site and "saltedBody" not in site
    run, shown = runs["none_shown"]
    _ok(run)
    site = (shown / "inferops-vllm.conf").read_text()
    assert "js_" not in site
    # Without njs, /health passes /readiness' status (and its counts: internals are not hidden) and a fixed 503.
    health = _location(site, "= /health")
    assert "proxy_pass http://inferops_vllm_router/readiness;" in health
    assert "error_page 500 502 503 504 =503 @inferops_vllm_unhealthy;" in health
    assert "/_inferops_vllm_readiness" not in site
    assert "client_body_buffer_size 1m;" in site
    assert "proxy_read_timeout 1800s;" in (out / "inferops-vllm-proxy.conf").read_text()
    assert json.loads((out / "published.json").read_text())["fallback_metrics_url"] == ""
    assert not list(out.glob("inferops-vllm-fallback-[0-9]*.conf"))


def test_a_key_over_its_limits_can_be_refused_instead_of_sent_to_the_cloud(runs):
    run, out = runs["no_rate_fallback"]
    _ok(run)
    site = (out / "inferops-vllm.conf").read_text()
    assert ('map "$limit_req_status$limit_conn_status" $inferops_fallback_own_limit { "~REJECTED" 1; default ""; }'
            in site)
    first = _location(site, "@inferops_vllm_fallback_0")
    assert "if ($inferops_fallback_own_limit) {" in first and "return 429" in first
    assert first.index("if ($inferops_fallback_own_limit)") < first.index("rewrite ^/v1/")
    assert "inferops_fallback_own_limit" not in _location(site, "@inferops_vllm_fallback_1")
    # The opt-in (true) renders no such check.
    assert "inferops_fallback_own_limit" not in (runs["rate_fallback"][1] / "inferops-vllm.conf").read_text()
    # Issue #25: refusing is the default now (the key's limits hold on the fallback path too).
    assert "if ($inferops_fallback_own_limit) {" in (runs["fallbacks"][1] / "inferops-vllm.conf").read_text()


def test_the_role_refuses_a_host_name_without_a_resolver(runs):
    run, out = runs["no_resolver"]
    output = " ".join((run.stdout + run.stderr).split())
    assert run.returncode != 0
    assert ("router-1: the fallback endpoints api.openai.com are reached by name, which nginx resolves per request "
            "through vllm_router_front_fallback_resolver (is []): it must list the DNS servers' addresses") in output
    assert not out.exists()
    assert "sk-test-fallback-key-0001" not in output


def test_the_pd_preflight_refuses_bad_fallbacks_before_any_change(runs):
    run, _out = runs["pd_preflight"]
    output = run.stdout + run.stderr
    assert run.returncode != 0
    assert "no host was contacted or changed" in output
    lines = list(dict.fromkeys(line.strip() for line in output.splitlines() if line.strip().startswith("[fallbacks]")))
    assert lines == [
        "[fallbacks] router-1: vllm_router_front_fallbacks[0].api_key: is missing: the endpoint would be called "
        "without a key. Fix: set api_key to the endpoint's key, from a vaulted variable such as vault_openai_api_key.",
        "[fallbacks] router-1: vllm_router_front_fallbacks[1].url: is plain HTTP to cloud.example.com, a name nginx "
        "resolves through DNS at each request (only a loopback IP address is sure to stay on this host): prompts, "
        "answers and the endpoint's key would cross the network in clear text. Fix: use https://, or "
        "set allow_plaintext: true on this endpoint to accept clear text on purpose.",
        "[fallbacks] router-1: vllm_router_front_fallbacks[2].models: does not map the served model name "
        "smollm2-135m-instruct: a request for it would reach the endpoint under our name. Fix: add each served "
        "model name with the endpoint's model for it.",
        "[fallbacks] router-1: vllm_router_front_fallbacks[5].url: is plain HTTP to localhost, a name nginx "
        "resolves through DNS at each request (only a loopback IP address is sure to stay on this host): prompts, "
        "answers and the endpoint's key would cross the network in clear text. Fix: use https://, or "
        "set allow_plaintext: true on this endpoint to accept clear text on purpose.",
    ], output
    assert "sk-test-fallback-key-0001" not in output


def test_the_published_record_holds_the_fallbacks_without_their_keys(runs):
    """vllm_router_published (what the PD preflight and others read) carries stand-ins, never a key."""
    run, out = runs["fallbacks"]
    _ok(run)
    text = (out / "published.json").read_text()
    for key in KEYS:
        assert key not in text
    fallbacks = json.loads(text)["fallbacks"]
    assert [fb["name"] for fb in fallbacks] == [fb["name"] for fb in VARS["vllm_router_front_fallbacks"]]
    assert {fb["api_key"] for fb in fallbacks} == {"k" * 16}


def test_a_key_from_an_unloaded_vault_is_named_before_any_change(runs):
    run, _out = runs["pd_undefined"]
    output = run.stdout + run.stderr
    assert run.returncode != 0
    assert "no host was contacted or changed" in output
    assert ("[fallbacks] router-1: vllm_router_front_fallbacks: refers to an undefined variable (is the vault file "
            "loaded? --ask-vault-pass / --vault-id).") in output, output


def test_the_key_tasks_show_nothing():
    tasks = yaml.safe_load((ROUTER / "tasks" / "configure.yml").read_text())
    block = next(t for t in tasks if t.get("name") == "Install the fallback endpoints' settings")["block"]
    (keys,) = [t for t in block if "key" in t["name"]]
    assert keys["no_log"] is True and keys["diff"] is False
    assert keys["ansible.builtin.template"]["mode"] == "0600" and keys["ansible.builtin.template"]["owner"] == "root"
    (check,) = [t for t in yaml.safe_load((ROUTER / "tasks" / "preflight.yml").read_text())
                if t.get("name", "").startswith("Check the fallback endpoints")]
    assert check["no_log"] is True


def test_the_site_is_validated_with_the_enabled_modules():
    """njs is a dynamic module: the minimal nginx.conf the site is checked in must load it (js_path is unknown
    otherwise, and every deploy with fallbacks would fail at the site's validate)."""
    tasks = yaml.safe_load((ROUTER / "tasks" / "configure.yml").read_text())
    (front,) = [t for t in tasks if t.get("name", "").startswith("Write the front's client keys")]
    assert "'validate': _vllm_router_nginx_site_check" in front["inferops.vllm.config_files"]["files"]
    check = yaml.safe_load((ROUTER / "vars" / "main.yml").read_text())["_vllm_router_nginx_site_check"]
    assert check.startswith('sh -c \'c=$(mktemp) && printf "include /etc/nginx/modules-enabled/*.conf;\\npid ')


def test_the_filter_and_the_pd_check_share_one_rule():
    problems = pf.front_fallback_problems([_endpoint(api_key="short")], ["smollm2-135m-instruct"])
    assert problems == [
        "vllm_router_front_fallbacks[0].api_key: is not a usable key (not shown): it must be 16 or more characters of "
        "A-Z a-z 0-9 . _ ~ + / = - (RFC 6750 bearer token characters); it is written into an nginx string, where "
        "other characters would break or inject into it. Fix: check the vaulted value (no quotes, spaces or newline)."]
    assert pf.front_fallback_problems([_endpoint()], ["smollm2-135m-instruct"]) == []
