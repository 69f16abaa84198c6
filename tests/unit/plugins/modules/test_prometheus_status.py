"""Unit tests for plugins/modules/prometheus_status.py.

The module's main() runs as in community.general's module tests (module args patched in, exit_json/fail_json
turned into exceptions). Prometheus is a fake on 127.0.0.1 that answers each path from a script, so the module's
HTTP code really runs; the module's clock and sleep are a fake clock, so a 120 s wait takes no time.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml
from ansible.module_utils import basic
from ansible_collections.inferops.vllm.plugins.modules import prometheus_status
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import (
    assert_documented_as_specified,
    assert_no_globals_besides_documentation,
    captured_module_arguments,
    run_module,
)
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import exit_json as _exit_json
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import fail_json as _fail_json

UP = {"labels": {"job": "vllm", "host": "prefill-1", "instance_name": "prefill-0"},
      "scrapeUrl": "http://10.0.0.11:8100/metrics", "health": "up", "lastError": ""}
REFUSED = 'Get "http://10.0.0.21:9100/metrics": dial tcp 10.0.0.21:9100: connect: connection refused'
DOWN = {"labels": {"job": "node", "host": "decode-1"}, "scrapeUrl": "http://10.0.0.21:9100/metrics",
        "health": "down", "lastError": REFUSED}
UNKNOWN = {"labels": {"job": "node", "host": "router-1"}, "scrapeUrl": "http://127.0.0.1:9100/metrics",
           "health": "unknown", "lastError": ""}
RULES = {"status": "success", "data": {"groups": [{"name": "inferops-vllm-pd", "rules": []}]}}


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def clock(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


class Script:
    """Per path, the answers in turn (the last one repeats): (status, JSON body)."""

    def __init__(self):
        self.answers = {}
        self.asked = []

    def answer(self, path):
        self.asked.append(path)
        answers = self.answers.get(path) or [(404, {"status": "error"})]
        return answers.pop(0) if len(answers) > 1 else answers[0]


@pytest.fixture
def prometheus():
    script = Script()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            status, body = script.answer(self.path)
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    script.url = f"http://127.0.0.1:{server.server_port}"
    yield script
    server.shutdown()
    server.server_close()


@pytest.fixture(autouse=True)
def module_harness(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(basic.AnsibleModule, "exit_json", _exit_json)
    monkeypatch.setattr(basic.AnsibleModule, "fail_json", _fail_json)
    monkeypatch.setattr(prometheus_status.PrometheusStatus, "clock", staticmethod(clock.clock))
    monkeypatch.setattr(prometheus_status.PrometheusStatus, "sleep", staticmethod(clock.sleep))
    return clock


def targets(*active):
    return (200, {"status": "success", "data": {"activeTargets": list(active), "droppedTargets": []}})


def run(script, expect="exit", **args):
    return run_module(prometheus_status.main, {"url": script.url, "interval": 3, **args}, expect=expect)


def test_documentation_says_what_the_spec_does(monkeypatch):
    spec = captured_module_arguments(monkeypatch, prometheus_status)
    assert spec["supports_check_mode"] is True
    doc = yaml.safe_load(prometheus_status.DOCUMENTATION)
    assert_documented_as_specified(doc["options"], spec["argument_spec"])
    assert_no_globals_besides_documentation(prometheus_status)


def test_waits_for_ready_and_for_every_target_scraped_then_returns_them_and_the_rule_groups(prometheus):
    prometheus.answers = {
        "/-/ready": [(503, {}), (503, {}), (200, {})],
        "/api/v1/targets?state=active": [targets(UP, UNKNOWN), targets(UP, {**UNKNOWN, "health": "up"})],
        "/api/v1/rules?type=alert": [(200, RULES)],
    }
    result = run(prometheus)
    assert prometheus.asked == ["/-/ready"] * 3 + ["/api/v1/targets?state=active"] * 2 + ["/api/v1/rules?type=alert"]
    assert [t["health"] for t in result["targets"]] == ["up", "up"]
    assert result["targets"][0] == {"job": "vllm", "instance_name": "prefill-0", "host": "prefill-1",
                                    "scrape_url": "http://10.0.0.11:8100/metrics", "health": "up", "error": ""}
    assert result["down"] == [] and result["rule_groups"] == ["inferops-vllm-pd"]
    assert result["waited"] == 9.0 and result["changed"] is False


def test_a_target_that_stays_down_is_returned_once_its_grace_is_over(prometheus, module_harness):
    prometheus.answers = {"/-/ready": [(200, {})], "/api/v1/targets?state=active": [targets(UP, DOWN)],
                          "/api/v1/rules?type=alert": [(200, {"status": "success", "data": {"groups": []}})]}
    result = run(prometheus, targets_grace=7)
    # Read at 0, 3, 6 and 9 s: down at each, returned at the first read past 7 s.
    assert prometheus.asked.count("/api/v1/targets?state=active") == 4
    assert result["down"] == [f"node on decode-1 (http://10.0.0.21:9100/metrics): {REFUSED}"]
    assert result["rule_groups"] == []


def test_fails_naming_the_targets_not_scraped_when_the_time_is_up(prometheus):
    prometheus.answers = {"/-/ready": [(200, {})], "/api/v1/targets?state=active": [targets(UP, UNKNOWN)]}
    result = run(prometheus, expect="fail", targets_timeout=30)
    assert "has not scraped every target after 30 s: not scraped yet: node on router-1 " \
           "(http://127.0.0.1:9100/metrics): unknown" in result["msg"]
    assert "/api/v1/rules?type=alert" not in prometheus.asked


def test_fails_when_prometheus_is_not_ready_in_time_or_answers_no_rules(prometheus):
    prometheus.answers = {"/-/ready": [(503, {"status": "starting"})]}
    result = run(prometheus, expect="fail", ready_timeout=10)
    assert f"Prometheus at {prometheus.url} is not ready after 10 s: /-/ready answered 503" in result["msg"]
    assert prometheus.asked == ["/-/ready"] * 5  # at 0, 3, 6, 9 and 12 s
    prometheus.asked.clear()
    prometheus.answers = {"/-/ready": [(200, {})], "/api/v1/targets?state=active": [targets(UP)]}
    result = run(prometheus, expect="fail")
    assert "did not list its alert rules: /api/v1/rules answered 404" in result["msg"]


def test_nothing_listening_is_said_as_such(unused_tcp_port_url):
    result = run_module(prometheus_status.main, {"url": unused_tcp_port_url, "ready_timeout": 0}, expect="fail")
    assert "is not ready after 0 s: /-/ready answered nothing" in result["msg"]


@pytest.fixture
def unused_tcp_port_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    port = server.server_port
    server.server_close()
    return f"http://127.0.0.1:{port}"
