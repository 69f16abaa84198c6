"""Unit tests for plugins/modules/vllm_instance_drain.py.

The module's main() runs as in community.general's module tests (module args patched in, exit_json/fail_json
turned into exceptions), against a fake vLLM /metrics on 127.0.0.1 (Prometheus exposition format, one or two
engines), so that the module's HTTP code really runs. The module's clock and sleep are a fake clock, so a 60 s
wait takes no time; the fake serves one page per read (the last one repeats).
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from ansible.module_utils import basic
from ansible_collections.inferops.vllm.plugins.modules import vllm_instance_drain
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import (
    assert_documented_as_specified,
    captured_module_arguments,
    run_module,
)
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import exit_json as _exit_json
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import fail_json as _fail_json

MODEL = "smollm2-135m-instruct"


def page(*engines):
    """A vLLM /metrics page with ``engines``, each (running, waiting), among other metrics of the instance."""
    lines = [
        "# HELP python_gc_objects_collected_total Objects collected during gc",
        "# TYPE python_gc_objects_collected_total counter",
        'python_gc_objects_collected_total{generation="0"} 12345.0',
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
    ]
    lines += [f'vllm:num_requests_running{{engine="{i}",model_name="{MODEL}"}} {float(r)}'
              for i, (r, _w) in enumerate(engines)]
    lines += [
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
        "# TYPE vllm:num_requests_waiting gauge",
    ]
    lines += [f'vllm:num_requests_waiting{{engine="{i}",model_name="{MODEL}"}} {float(w)}'
              for i, (_r, w) in enumerate(engines)]
    lines += [
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.25',
        "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.",
        "# TYPE vllm:num_preemptions_total counter",
        f'vllm:num_preemptions_total{{engine="0",model_name="{MODEL}"}} 7.0',
    ]
    return "\n".join(lines) + "\n"


class FakeMetrics:
    """A vLLM instance's /metrics on 127.0.0.1: ``pages[i]`` answers the i-th read, the last one repeats."""

    def __init__(self, *pages, status=200, key=None):
        self.pages = list(pages)
        self.status = status
        self.key = key  # when set, /metrics needs "Authorization: Bearer <key>" (roles/vllm_instance, issue #25)
        self.auths = []
        self.reads = 0
        self.paths = []
        app = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):  # noqa: N802
                app.paths.append(self.path)
                app.auths.append(self.headers.get("Authorization"))
                status, body = 404, b"Not Found"
                if app.key and self.headers.get("Authorization") != f"Bearer {app.key}":
                    status, body = 401, b'{"error":{"message":"missing or invalid API key"}}'
                elif self.path == "/metrics":
                    status = app.status
                    body = app.pages[min(app.reads, len(app.pages) - 1)].encode()
                    app.reads += 1
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class FakeClock:
    """Stands in for the module's ``time`` (monotonic and sleep)."""

    def __init__(self):
        self.now = 1000.0
        self.sleeps = []

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        assert seconds > 0
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture()
def metrics():
    started = []

    def start(*pages, **kwargs):
        server = FakeMetrics(*pages, **kwargs)
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


@pytest.fixture()
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(vllm_instance_drain, "time", fake)
    return fake


@pytest.fixture(autouse=True)
def module_harness(monkeypatch):
    monkeypatch.setattr(basic.AnsibleModule, "exit_json", _exit_json)
    monkeypatch.setattr(basic.AnsibleModule, "fail_json", _fail_json)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    # A proxy that refuses everything: the module must ask the instance directly.
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{closed_port()}")


def closed_port():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


def run(args, **kwargs):
    return run_module(vllm_instance_drain.main, args, **kwargs)


# --------------------------------------------------------------------------- draining


def test_drains_when_the_requests_finish(metrics, clock):
    server = metrics(page((2, 1)), page((1, 0)), page((0, 0)), page((0, 0)))
    result = run({"port": server.port})

    assert result["changed"] is False
    assert result["drained"] is True and result["running"] == 0
    # Two busy reads, then the default quiet=2 reads in a row with nothing running, one second apart.
    assert server.reads == 4 and clock.sleeps == [1, 1, 1]
    assert result["seconds"] == 3.0
    assert result["msg"] == "no request running after 3.0 s"
    assert server.paths == ["/metrics"] * 4


def test_idle_instance_needs_quiet_reads_in_a_row(metrics, clock):
    # A zero between two busy reads does not count: the quiet reads must follow one another.
    server = metrics(page((0, 0)), page((0, 1)), page((0, 0)), page((0, 0)), page((0, 0)))
    result = run({"port": server.port, "quiet": 3})
    assert result["drained"] is True
    assert server.reads == 5 and result["seconds"] == 4.0


def test_quiet_one_returns_at_the_first_idle_read(metrics, clock):
    server = metrics(page((0, 0)))
    result = run({"port": server.port, "quiet": 1})
    assert result["drained"] is True and server.reads == 1 and clock.sleeps == []
    assert result["seconds"] == 0.0


def test_quiet_zero_counts_as_one(metrics, clock):
    server = metrics(page((0, 0)), page((5, 0)))
    result = run({"port": server.port, "quiet": 0})
    assert result["drained"] is True and server.reads == 1


def test_engines_are_summed(metrics, clock):
    # Engine 0 is idle, engine 1 still runs one and has one waiting: the instance is busy until both are idle.
    server = metrics(page((0, 0), (1, 1)), page((0, 0), (0, 1)), page((0, 0), (0, 0)))
    result = run({"port": server.port, "quiet": 1, "timeout": 0})
    assert result["drained"] is False and result["running"] == 2
    result = run({"port": server.port, "quiet": 1})
    assert result["drained"] is True and server.reads == 3


def test_timeout_with_requests_still_running_returns_without_failing(metrics, clock):
    server = metrics(page((3, 2), (1, 0)))
    result = run({"port": server.port, "timeout": 10})

    assert result["changed"] is False
    assert "failed" not in result
    assert result["drained"] is False and result["running"] == 6
    assert result["seconds"] == 10.0 and clock.sleeps == [1] * 10
    assert server.reads == 11
    assert result["msg"].startswith("still 6 request(s) running or waiting after 10.0 s")
    assert "--shutdown-timeout" in result["msg"]


def test_timeout_zero_reads_once(metrics, clock):
    server = metrics(page((1, 0)))
    result = run({"port": server.port, "timeout": 0})
    assert result["drained"] is False and result["running"] == 1
    assert server.reads == 1 and clock.sleeps == []


def test_check_mode_reads_once_and_returns(metrics, clock):
    server = metrics(page((2, 3)), page((0, 0)))
    result = run({"port": server.port}, check_mode=True)

    assert result["changed"] is False
    assert server.reads == 1 and clock.sleeps == []
    assert result["running"] == 5 and result["drained"] is False
    assert result["msg"] == "check mode: 5 request(s) running or waiting now"


def test_check_mode_on_an_idle_instance(metrics, clock):
    server = metrics(page((0, 0)))
    result = run({"port": server.port}, check_mode=True)
    assert result["drained"] is True and result["running"] == 0 and server.reads == 1
    assert result["msg"] == "check mode: 0 request(s) running or waiting now"


def test_host_is_used_and_ipv6_is_bracketed(metrics, clock):
    server = metrics(page((0, 0)))
    result = run({"port": server.port, "host": "127.0.0.1", "quiet": 1})
    assert result["drained"] is True
    # An IPv6 literal is put in brackets in the URL (nothing listens on ::1 here, so the read fails).
    port = closed_port()
    result = run({"port": port, "host": "::1"}, expect="fail")
    assert f"http://[::1]:{port}/metrics" in result["msg"]


# --------------------------------------------------------------------------- failures


def test_a_page_without_the_gauges_fails(metrics, clock):
    server = metrics("# HELP process_cpu_seconds_total Total user and system CPU time\nprocess_cpu_seconds_total 1.5\n")
    result = run({"port": server.port}, expect="fail")

    url = f"http://127.0.0.1:{server.port}/metrics"
    assert result["msg"] == f"cannot read {url}: {url} has no vllm:num_requests_running: is it a vLLM instance?"
    assert result["drained"] is False and result["running"] == -1
    assert clock.sleeps == []


def test_gauges_with_a_longer_name_are_not_taken_for_them(metrics, clock):
    # Only the exact gauge names count, not a metric whose name merely starts like them.
    text = f'vllm:num_requests_running_by_reason{{engine="0",model_name="{MODEL}"}} 3.0\n'
    server = metrics(text)
    result = run({"port": server.port}, expect="fail")
    assert "is it a vLLM instance?" in result["msg"]


def test_unreachable_port_fails(clock):
    port = closed_port()
    result = run({"port": port}, expect="fail")
    assert result["msg"].startswith(f"cannot read http://127.0.0.1:{port}/metrics: ")
    assert "refused" in result["msg"].lower()
    assert result["drained"] is False and result["running"] == -1
    assert clock.sleeps == []


def test_http_error_fails(metrics, clock):
    server = metrics("", status=500)
    result = run({"port": server.port}, expect="fail")
    assert result["msg"].startswith(f"cannot read http://127.0.0.1:{server.port}/metrics: ")
    assert result["running"] == -1


def test_instance_that_goes_away_during_the_wait_fails(metrics, clock):
    server = metrics(page((1, 0)))
    real_sleep = clock.sleep

    def sleep_and_stop(seconds):
        real_sleep(seconds)
        server.close()

    clock.sleep = sleep_and_stop
    result = run({"port": server.port}, expect="fail")
    assert result["msg"].startswith(f"cannot read http://127.0.0.1:{server.port}/metrics: ")
    assert result["seconds"] == 1.0


# --------------------------------------------------------------------------- the instance key (issue #25)

KEY = "instance-key-drain-0123456789"


def test_the_key_is_sent_to_metrics(metrics, clock):
    server = metrics(page((0, 0)), key=KEY)
    result = run({"port": server.port, "api_key": KEY, "quiet": 1})
    assert result["drained"] is True
    assert server.auths == [f"Bearer {KEY}"]
    assert KEY not in json.dumps(result)


def test_without_the_key_an_instance_that_requires_it_fails_saying_so(metrics, clock):
    server = metrics(page((0, 0)), key=KEY)
    result = run({"port": server.port}, expect="fail")
    assert "Unauthorized" in result["msg"] and "requires the instance key" in result["msg"]
    result = run({"port": server.port, "api_key": "wrong-key-0123456789abcdef"}, expect="fail")
    assert "the API key was refused" in result["msg"] and "wrong-key" not in result["msg"]


def test_no_key_sends_no_authorization(metrics, clock):
    server = metrics(page((0, 0)))
    run({"port": server.port, "quiet": 1})
    assert server.auths == [None]


# --------------------------------------------------------------------------- documentation


def test_documentation_matches_argument_spec(monkeypatch):
    yaml = pytest.importorskip("yaml")
    captured = captured_module_arguments(monkeypatch, vllm_instance_drain)
    doc = yaml.safe_load(vllm_instance_drain.DOCUMENTATION)
    assert_documented_as_specified(doc["options"], captured["argument_spec"])
    assert captured["supports_check_mode"] is True
    for task in yaml.safe_load(vllm_instance_drain.EXAMPLES):
        assert set(task["inferops.vllm.vllm_instance_drain"]) <= set(captured["argument_spec"])
    assert set(yaml.safe_load(vllm_instance_drain.RETURN)) == {"drained", "seconds", "running", "msg"}
