"""roles/vllm_monitoring on the router host (the `monitoring` group): the real Prometheus of the distribution
scrapes the real deployment, and after traffic every query of the dashboard and every metric an alert rule reads
returns at least one series; every target is up; the alert rules are loaded.

Prometheus listens on the router host's loopback: its HTTP API is read from inside that container."""

from __future__ import annotations

import json
import os
import re
import shlex
import time
import urllib.parse

import prom_report  # benchmarks/, put on sys.path by conftest.py
import pytest
from conftest import deploy_playbook, front_ca, molecule_only, secret

PROMETHEUS = "http://127.0.0.1:9090"
GET = ("import json, sys, urllib.request, urllib.error\n"
       "try:\n"
       "    body = urllib.request.urlopen(sys.argv[1], timeout=30).read().decode()\n"
       "except urllib.error.HTTPError as exc:\n"
       "    body = exc.read().decode()\n"
       "print(body)\n")


@pytest.fixture(scope="module")
def prometheus_get(router_host):
    """prom_report's HTTP GET, done inside the router container (Prometheus is on its loopback)."""
    def get(url, params, timeout=30):
        full = url.rstrip("/") + "?" + urllib.parse.urlencode(params)
        out = router_host.run(f"python3 -c {shlex.quote(GET)} {shlex.quote(full)}")
        assert out.rc == 0, f"GET {full} in the router container: {out.stderr[-500:]}"
        body = json.loads(out.stdout)
        if body.get("status") != "success":
            raise RuntimeError(f"{full}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]
    return get


@pytest.fixture(scope="module")
def traffic(front_url):
    """Completions and a chat through the front, so that the latency histograms and NIXL counters have data."""
    import openai
    ca = front_ca()
    client = openai.OpenAI(base_url=f"{front_url}/v1", api_key=secret("client_api_key"), timeout=120, max_retries=0,
                           http_client=openai.DefaultHttpxClient(verify=ca) if ca else None)
    for i in range(3):
        client.completions.create(model="smollm2-135m-instruct", prompt=f"Count to {i + 3}:", max_tokens=8)
    client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=8, stream=False,
                                   messages=[{"role": "user", "content": "Say hello."}])
    return time.time()


def test_every_target_is_scraped(prometheus_get):
    deadline = time.monotonic() + 120
    while True:
        targets = prometheus_get(f"{PROMETHEUS}/api/v1/targets", {"state": "active"})["activeTargets"]
        down = [(t["scrapeUrl"], t.get("lastError")) for t in targets if t["health"] != "up"]
        if targets and not down:
            break
        assert time.monotonic() < deadline, f"targets not up after 120 s: {down}"
        time.sleep(5)
    jobs = {t["labels"].get("job") for t in targets}
    roles = {t["labels"].get("role") for t in targets}
    assert {"prefill", "decode"} <= roles, roles
    assert len(jobs) >= 4, jobs  # instances, router, nginx, node exporters


def test_the_alert_rules_are_loaded(prometheus_get):
    rules = prometheus_get(f"{PROMETHEUS}/api/v1/rules", {"type": "alert"})
    names = {r["name"] for g in rules["groups"] for r in g["rules"]}
    expected = {r["alert"] for r in prom_report.rules_from_text(prom_report.render_rules()) if "alert" in r}
    assert expected and expected <= names, expected - names


def test_every_dashboard_query_and_rule_metric_returns_series(prometheus_get, traffic, monkeypatch):
    monkeypatch.setattr(prom_report, "_get", prometheus_get)
    # Scraped after the traffic: wait for it (scrape interval and the rate window), then ask again.
    deadline = time.monotonic() + 180
    while True:
        missing = prom_report.check_queries(PROMETHEUS)
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(10)
    assert not missing, "\n".join(f"{m['source']}: {m['query']} {m.get('error', '')}" for m in missing)


def test_the_png_report_draws_every_panel_from_the_real_prometheus(prometheus_get, traffic, monkeypatch, tmp_path):
    """benchmarks/prom_report.py (for users without Grafana) against the real Prometheus: a PNG per panel of the
    dashboard, each with data (after the traffic) and no query error."""
    monkeypatch.setattr(prom_report, "_get", prometheus_get)
    end = time.time()
    index = prom_report.render_report(PROMETHEUS, end - 900, end, 15, tmp_path)
    text = index.read_text()
    panels = prom_report.dashboard_panels()
    images = sorted(tmp_path.glob("*.png"))
    assert panels and len(images) == len(panels), (len(panels), [p.name for p in images])
    for image in images:
        assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({image.name})" in text, image
    assert "- error:" not in text and "- no series in this range" not in text, text


@molecule_only
def test_the_monitoring_playbook_alone_finds_everything_in_place(router_host):
    """playbooks/monitoring.yml (the monitoring part of deploy_pd.yml, run on its own after a change of the
    monitoring settings) on the deployed inventory: it runs through and changes nothing, since converge set up
    the same; Prometheus stays up."""
    run = deploy_playbook(os.path.join(os.environ["MOLECULE_EPHEMERAL_DIRECTORY"], "inventory"), "monitoring.yml")
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    recap = re.findall(r"^(\S+)\s+: ok=\d+\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", output, re.M)
    assert recap and all(r[1:] == ("0", "0", "0") for r in recap), (recap, output[-4000:])
    assert router_host.service("prometheus").is_running
