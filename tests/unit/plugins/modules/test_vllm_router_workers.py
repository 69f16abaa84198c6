"""Unit tests for plugins/modules/vllm_router_workers.py.

The module's main() runs as in community.general's module tests (module args patched in, exit_json/fail_json
turned into exceptions), against fake vllm-router processes on 127.0.0.1, so that the module's HTTP code really
runs. The fake answers the admin routes of vllm-router 0.1.17: GET /list_workers, GET /workers and
POST /remove_worker?url=..., which answers 200 "Successfully removed worker: URL" even for a URL it does not list.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from ansible.module_utils import basic
from ansible_collections.inferops.vllm.plugins.modules import vllm_router_workers
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import (
    assert_documented_as_specified,
    captured_module_arguments,
    run_module,
)
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import exit_json as _exit_json
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import fail_json as _fail_json

PREFILL = "http://10.0.0.4:8100"
DECODE = "http://10.0.0.5:8200"
OTHER_DECODE = "http://10.0.0.6:8200"
# A decode pool of two: taking one out leaves the other (an instance alone in its pool is refused, see below).
POOL = {PREFILL: "prefill", DECODE: "decode", OTHER_DECODE: "decode"}


def run(args=None, **kwargs):
    """vllm_router_workers.main() with ``args``: what it exited (or, with expect="fail", failed) with."""
    return run_module(vllm_router_workers.main, args, **kwargs)


class FakeRouter:
    """One vllm-router process in PD mode on 127.0.0.1.

    ``workers``: URL -> worker type (prefill/decode); ``healthy``: the URLs it counts healthy (all by default);
    ``removes``: whether POST /remove_worker really removes (a router that answers 200 but keeps the worker
    when False). Every request is recorded as (method, path, query).
    """

    def __init__(self, workers, healthy=None, removes=True):
        self.workers = dict(workers)
        self.healthy = set(self.workers) if healthy is None else set(healthy)
        self.removes = removes
        self.lock = threading.Lock()
        self.requests = []
        app = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _serve(self):
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                status, ctype, payload = app.handle(self.command, self.path)
                payload = payload.encode()
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = _serve  # noqa: N815
            do_POST = _serve  # noqa: N815

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def handle(self, method, raw_path):
        parsed = urllib.parse.urlsplit(raw_path)
        query = urllib.parse.parse_qs(parsed.query)
        with self.lock:
            self.requests.append((method, parsed.path, query))
            if method == "GET" and parsed.path == "/list_workers":
                return 200, "application/json", json.dumps({"urls": list(self.workers)})
            if method == "GET" and parsed.path == "/workers":
                workers = [
                    {
                        "url": url,
                        "model_id": "unknown",
                        "worker_type": kind,
                        "is_healthy": url in self.healthy,
                        "load": 0,
                        "connection_mode": "Http",
                    }
                    for url, kind in self.workers.items()
                ]
                return 200, "application/json", json.dumps(
                    {"workers": workers, "total": len(workers), "stats": {"prefill_count": 1, "decode_count": 1}}
                )
            if method == "POST" and parsed.path == "/remove_worker":
                url = query["url"][0]
                if self.removes:
                    self.workers.pop(url, None)
                    self.healthy.discard(url)
                return 200, "text/plain", f"Successfully removed worker: {url}"
        return 404, "text/plain", "Not Found"

    def set_healthy(self, url):
        with self.lock:
            self.healthy.add(url)

    def calls(self, method, path):
        return [query for m, p, query in self.requests if (m, p) == (method, path)]

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture()
def routers():
    started = []

    def start(workers=None, **kwargs):
        router = FakeRouter({PREFILL: "prefill", DECODE: "decode"} if workers is None else workers, **kwargs)
        started.append(router)
        return router

    yield start
    for router in started:
        router.close()


@pytest.fixture(autouse=True)
def module_harness(monkeypatch):
    monkeypatch.setattr(basic.AnsibleModule, "exit_json", _exit_json)
    monkeypatch.setattr(basic.AnsibleModule, "fail_json", _fail_json)
    # The module must not need a proxy setting to reach loopback: a proxy here would refuse everything.
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)


class FakeClock:
    """Stands in for the module's ``time`` (monotonic and sleep), so a long wait takes no time."""

    def __init__(self):
        self.now = 1000.0
        self.sleeps = []

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        assert seconds > 0
        self.sleeps.append(seconds)
        self.now += seconds


def closed_port():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


# --------------------------------------------------------------------------- state=absent


def test_absent_removes_from_every_router(routers):
    first, second = routers(POOL), routers(POOL)
    result = run({"routers": [first.url, second.url + "/"], "url": DECODE, "state": "absent"})

    assert result["changed"] is True
    assert result["routers"] == [
        {"router": first.url, "listed_before": True, "listed_after": False},
        {"router": second.url, "listed_before": True, "listed_after": False},  # trailing slash dropped
    ]
    for router in (first, second):
        # The URL arrives whole (it is percent-encoded in the query), and only that worker goes.
        assert router.calls("POST", "/remove_worker") == [{"url": [DECODE]}]
        assert list(router.workers) == [PREFILL, OTHER_DECODE]
        # Read before, and again after the removal to confirm it; the pool read once, before any removal.
        assert len(router.calls("GET", "/list_workers")) == 2
        assert len(router.calls("GET", "/workers")) == 1


def test_absent_url_with_trailing_slash_is_the_same_worker(routers):
    router = routers(POOL)
    result = run({"routers": [router.url], "url": DECODE + "/"})  # state defaults to absent
    assert result["changed"] is True
    assert router.calls("POST", "/remove_worker") == [{"url": [DECODE]}]
    assert DECODE not in router.workers


def test_absent_when_already_absent_is_not_a_change(routers):
    first, second = routers({PREFILL: "prefill"}), routers({PREFILL: "prefill", OTHER_DECODE: "decode"})
    result = run({"routers": [first.url, second.url], "url": DECODE, "state": "absent"})

    assert result["changed"] is False
    assert [(r["listed_before"], r["listed_after"]) for r in result["routers"]] == [(False, False), (False, False)]
    # Nothing is posted when the router does not list it (vllm-router would answer 200 anyway).
    assert first.calls("POST", "/remove_worker") == [] and second.calls("POST", "/remove_worker") == []
    assert list(second.workers) == [PREFILL, OTHER_DECODE]


def test_absent_from_one_router_only_is_a_change(routers):
    first, second = routers({PREFILL: "prefill"}), routers(POOL)
    result = run({"routers": [first.url, second.url], "url": DECODE})
    assert result["changed"] is True
    assert [r["listed_before"] for r in result["routers"]] == [False, True]
    assert first.calls("POST", "/remove_worker") == []
    assert second.calls("POST", "/remove_worker") == [{"url": [DECODE]}]


def test_check_mode_removes_nothing_but_reports_the_change(routers):
    first, second = routers(POOL), routers(POOL)
    result = run({"routers": [first.url, second.url], "url": DECODE}, check_mode=True)

    assert result["changed"] is True
    assert [r["listed_before"] for r in result["routers"]] == [True, True]
    for router in (first, second):
        assert router.calls("POST", "/remove_worker") == []
        assert DECODE in router.workers
        assert len(router.calls("GET", "/list_workers")) == 1


def test_check_mode_when_already_absent_reports_no_change(routers):
    router = routers({PREFILL: "prefill"})
    result = run({"routers": [router.url], "url": DECODE}, check_mode=True)
    assert result["changed"] is False
    assert router.calls("POST", "/remove_worker") == []


def test_router_that_keeps_the_worker_fails(routers):
    first, stubborn = routers(POOL), routers(POOL, removes=False)
    result = run({"routers": [first.url, stubborn.url], "url": DECODE}, expect="fail")

    assert result["msg"] == f"{stubborn.url} still lists {DECODE} after POST /remove_worker"
    assert "still lists" in result["msg"]
    assert result["routers"][0] == {"router": first.url, "listed_before": True, "listed_after": False}
    assert result["routers"][1] == {"router": stubborn.url, "listed_before": True, "listed_after": True}
    assert stubborn.calls("POST", "/remove_worker") == [{"url": [DECODE]}]


def test_router_that_is_down_fails_with_its_url_before_any_change(routers):
    up = routers(POOL)
    down = f"http://127.0.0.1:{closed_port()}"
    result = run({"routers": [up.url, down], "url": DECODE}, expect="fail")

    assert result["msg"].startswith(f"GET {down}/workers: ")
    assert "refused" in result["msg"].lower()
    # Every router's pool is read before the first removal: the one that answers still has it.
    assert result["routers"] == []
    assert DECODE in up.workers and up.calls("POST", "/remove_worker") == []


def test_router_that_is_down_fails_in_state_present_too():
    down = f"http://127.0.0.1:{closed_port()}"
    result = run({"routers": [down], "url": DECODE, "state": "present"}, expect="fail")
    assert down in result["msg"] and "list_workers" in result["msg"]
    assert result["routers"] == []


def test_answer_that_is_not_a_worker_list_fails(routers):
    router = routers()
    router.handle = lambda method, path: (200, "application/json", json.dumps({"workers": []}))
    result = run({"routers": [router.url], "url": DECODE}, expect="fail")
    assert result["msg"].startswith(f"GET {router.url}/list_workers: not a worker list")


def test_http_error_is_reported_with_status(routers):
    router = routers()
    router.handle = lambda method, path: (500, "text/plain", "internal error")
    result = run({"routers": [router.url], "url": DECODE}, expect="fail")
    assert result["msg"].startswith(f"GET {router.url}/workers: HTTP 500")
    assert "internal error" in result["msg"]


# --------------------------------------------------------------------------- never an empty pool (issue #24)


def test_absent_refuses_to_take_out_the_last_healthy_instance_of_its_pool_before_any_change(routers):
    """The other decode instance is down (or being rolled at the same time): the rollout used to take this one out
    too, and every request failed until one was back."""
    first = routers(POOL)
    second = routers(POOL, healthy=[PREFILL, DECODE])
    result = run({"routers": [first.url, second.url], "url": DECODE}, expect="fail")

    assert result["msg"].startswith(f"Taking {DECODE} out would leave a router without a healthy worker of its kind: "
                                    f"{second.url} counts no other healthy decode worker (its other decode workers: "
                                    f"{OTHER_DECODE} (unhealthy))")
    assert first.url not in result["msg"]  # that router still has a healthy decode besides it
    assert "Nothing was changed" in result["msg"] and "vllm_rollout_allow_downtime=true" in result["msg"]
    assert first.calls("POST", "/remove_worker") == [] and second.calls("POST", "/remove_worker") == []


@pytest.mark.parametrize("url, kind", [(DECODE, "decode"), (PREFILL, "prefill")])
def test_absent_refuses_an_instance_alone_in_its_pool_even_in_check_mode(routers, url, kind):
    router = routers()  # one prefill, one decode: the other kind's health does not count
    for check_mode in (False, True):
        result = run({"routers": [router.url], "url": url}, expect="fail", check_mode=check_mode)
        assert f"counts no other healthy {kind} worker (its other {kind} workers: none)" in result["msg"]
    assert router.calls("POST", "/remove_worker") == [] and url in router.workers


def test_absent_empties_the_pool_when_allowed(routers):
    router = routers(POOL, healthy=[PREFILL, DECODE])
    result = run({"routers": [router.url], "url": DECODE, "allow_empty_pool": True})
    assert result["changed"] is True and list(router.workers) == [PREFILL, OTHER_DECODE]
    assert router.calls("GET", "/workers") == []  # not even read


# --------------------------------------------------------------------------- state=present


def test_present_and_healthy_everywhere(routers):
    first, second = routers(), routers()
    result = run({"routers": [first.url, second.url], "url": DECODE, "state": "present"})

    assert result["changed"] is False
    assert result["routers"] == [
        {"router": first.url, "listed_before": True, "listed_after": True, "healthy": True},
        {"router": second.url, "listed_before": True, "listed_after": True, "healthy": True},
    ]
    for router in (first, second):
        assert router.calls("POST", "/remove_worker") == []
        assert len(router.calls("GET", "/workers")) == 1


def test_present_without_healthy_does_not_read_the_workers(routers):
    router = routers(healthy=[])
    result = run({"routers": [router.url], "url": DECODE, "state": "present", "healthy": False})
    assert result["changed"] is False
    assert "healthy" not in result["routers"][0]
    assert router.calls("GET", "/workers") == []


def test_present_fails_naming_the_router_that_lacks_the_worker(routers):
    listing, lacking = routers(), routers({PREFILL: "prefill"})
    result = run({"routers": [listing.url, lacking.url], "url": DECODE, "state": "present"}, expect="fail")

    assert result["msg"].startswith(f"{lacking.url} does not list {DECODE}")
    assert listing.url not in result["msg"]
    assert "restart that router" in result["msg"]
    assert [r["listed_before"] for r in result["routers"]] == [True, False]
    # Present never adds (vllm-router 0.1.17 in PD mode cannot) and never removes.
    assert lacking.calls("POST", "/remove_worker") == [] and listing.calls("POST", "/remove_worker") == []


def test_present_waits_until_the_worker_is_healthy(routers):
    router = routers(healthy=[PREFILL])
    timer = threading.Timer(1.0, router.set_healthy, (DECODE,))
    started = time.monotonic()
    timer.start()
    try:
        result = run({"routers": [router.url], "url": DECODE, "state": "present", "timeout": 20})
    finally:
        timer.cancel()
    elapsed = time.monotonic() - started

    assert result["routers"][0]["healthy"] is True
    assert 0.9 <= elapsed < 10
    assert len(router.calls("GET", "/workers")) >= 2  # asked again until it counted it healthy


def test_present_fails_when_the_worker_never_becomes_healthy(routers, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(vllm_router_workers, "time", clock)
    healthy, unhealthy = routers(), routers(healthy=[PREFILL])
    result = run({"routers": [healthy.url, unhealthy.url], "url": DECODE, "state": "present", "timeout": 5},
                 expect="fail")

    assert result["msg"] == f"{unhealthy.url} lists {DECODE} but does not count it healthy after 5 s"
    assert result["routers"][0]["healthy"] is True and "healthy" not in result["routers"][1]
    # Polled once a second until the timeout had passed, and not much longer.
    assert set(clock.sleeps) == {1}
    assert 5 <= sum(clock.sleeps) <= 6
    assert len(unhealthy.calls("GET", "/workers")) == len(clock.sleeps) + 1


def test_a_worker_listed_as_unhealthy_under_another_url_does_not_count(routers, monkeypatch):
    monkeypatch.setattr(vllm_router_workers, "time", FakeClock())
    router = routers({PREFILL: "prefill", DECODE: "decode", OTHER_DECODE: "decode"}, healthy=[PREFILL, OTHER_DECODE])
    result = run({"routers": [router.url], "url": DECODE, "state": "present", "timeout": 0}, expect="fail")
    assert "does not count it healthy after 0 s" in result["msg"]


# --------------------------------------------------------------------------- keep (instances leaving)


def test_keep_takes_out_every_worker_not_kept_from_every_router(routers):
    first = routers({PREFILL: "prefill", DECODE: "decode", OTHER_DECODE: "decode"})
    second = routers({PREFILL: "prefill", DECODE: "decode", OTHER_DECODE: "decode"})
    result = run({"routers": [first.url, second.url], "keep": [PREFILL, DECODE + "/"]})

    assert result["changed"] is True
    assert result["removed"] == [{"url": OTHER_DECODE, "worker_type": "decode", "routers": [first.url, second.url]}]
    assert result["routers_down"] == []
    for router in (first, second):
        assert router.calls("POST", "/remove_worker") == [{"url": [OTHER_DECODE]}]
        assert list(router.workers) == [PREFILL, DECODE]


def test_keep_with_nothing_leaving_changes_nothing(routers):
    router = routers()
    result = run({"routers": [router.url], "keep": [PREFILL, DECODE, OTHER_DECODE]})
    assert result["changed"] is False and result["removed"] == []
    assert router.calls("POST", "/remove_worker") == []


def test_keep_skips_routers_that_do_not_run_yet(routers):
    up = routers({PREFILL: "prefill", DECODE: "decode", OTHER_DECODE: "decode"})
    down = f"http://127.0.0.1:{closed_port()}"
    result = run({"routers": [down, up.url], "keep": [PREFILL, DECODE]})
    assert result["routers_down"] == [down]
    assert [e["url"] for e in result["removed"]] == [OTHER_DECODE]
    assert OTHER_DECODE not in up.workers


def test_keep_in_check_mode_reports_what_would_leave(routers):
    router = routers({PREFILL: "prefill", DECODE: "decode", OTHER_DECODE: "decode"})
    result = run({"routers": [router.url], "keep": [PREFILL, DECODE]}, check_mode=True)
    assert result["changed"] is True and [e["url"] for e in result["removed"]] == [OTHER_DECODE]
    assert router.calls("POST", "/remove_worker") == [] and OTHER_DECODE in router.workers


@pytest.mark.parametrize("keep, empty", [([PREFILL], "decode"), ([DECODE], "prefill"), ([], "prefill and no decode")])
def test_keep_refuses_to_empty_a_pool_before_any_change(routers, keep, empty):
    first, second = routers(), routers()
    result = run({"routers": [first.url, second.url], "keep": keep}, expect="fail")
    assert result["msg"].startswith(f"{first.url} would have no {empty} worker left")
    assert "Nothing was changed" in result["msg"] and "vllm_rollout_allow_downtime=true" in result["msg"]
    assert first.calls("POST", "/remove_worker") == [] and second.calls("POST", "/remove_worker") == []


def test_keep_empties_a_pool_when_allowed(routers):
    router = routers()
    result = run({"routers": [router.url], "keep": [PREFILL], "allow_empty_pool": True})
    assert [e["url"] for e in result["removed"]] == [DECODE]
    assert list(router.workers) == [PREFILL]


def test_keep_fails_on_a_router_that_answers_an_error(routers):
    router = routers()
    router.handle = lambda method, path: (500, "text/plain", "internal error")
    result = run({"routers": [router.url], "keep": [PREFILL]}, expect="fail")
    assert result["msg"].startswith(f"GET {router.url}/workers: HTTP 500")


def test_url_and_keep_are_exclusive_and_one_is_required(routers):
    router = routers()
    assert "mutually exclusive" in run({"routers": [router.url], "url": DECODE, "keep": []}, expect="fail")["msg"]
    assert "one of the following" in run({"routers": [router.url]}, expect="fail")["msg"]
    assert "state is present" in run({"routers": [router.url], "keep": [], "state": "present"}, expect="fail")["msg"]


# --------------------------------------------------------------------------- documentation


def test_documentation_matches_argument_spec(monkeypatch):
    yaml = pytest.importorskip("yaml")
    captured = captured_module_arguments(monkeypatch, vllm_router_workers)
    doc = yaml.safe_load(vllm_router_workers.DOCUMENTATION)
    assert_documented_as_specified(doc["options"], captured["argument_spec"])
    assert captured["supports_check_mode"] is True
    assert doc["attributes"]["check_mode"]["support"] == "full"
    for task in yaml.safe_load(vllm_router_workers.EXAMPLES):
        args = task.get("inferops.vllm.vllm_router_workers")
        assert set(args) <= set(captured["argument_spec"])
    assert set(yaml.safe_load(vllm_router_workers.RETURN)) == {"routers", "removed", "routers_down"}
