"""Unit tests for plugins/modules/vllm_health.py.

The module's main() runs as in community.general's module tests (module args patched in,
exit_json/fail_json turned into exceptions), against real HTTP servers on 127.0.0.1 that fake
vLLM instances and a PD router, so that the module's HTTP code (fetch_url) really runs.
The fake router's completion handler changes the fake instances' /metrics the way a real
prefill/decode handoff does (or does not).
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from ansible.module_utils import basic
from ansible_collections.inferops.vllm.plugins.modules import vllm_health
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import (
    assert_documented_as_specified,
    assert_no_globals_besides_documentation,
)
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import exit_json as _exit_json
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import fail_json as _fail_json
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import (
    run_module as run_module_main,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
MODEL = "smollm2-135m-instruct"
# Distinctive keys: none of them may ever show up in a result or a message.
CLIENT_KEY = "sk-client-SECRET-4b8e1f0c2d"
INSTANCE_KEY = "sk-instance-SECRET-9a7c3e5d1b"
WRONG_KEY = "sk-wrong-SECRET-6d2f8a0e4c"
SECRETS = (CLIENT_KEY, INSTANCE_KEY, WRONG_KEY)


@pytest.fixture(autouse=True)
def module_harness(monkeypatch):
    monkeypatch.setattr(basic.AnsibleModule, "exit_json", _exit_json)
    monkeypatch.setattr(basic.AnsibleModule, "fail_json", _fail_json)
    # Only 127.0.0.1 is ever contacted, and never through a proxy.
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")


def run_module(args, expect="exit"):
    """Run main() with ``args``; returns the result dict of exit_json or fail_json, which never holds a key."""
    result = run_module_main(vllm_health.main, args, expect)
    assert_no_secret(result)
    return result


def assert_no_secret(result):
    dumped = json.dumps(result, default=str)
    for secret in SECRETS:
        assert secret not in dumped, f"secret {secret} leaked into the result"


# --------------------------------------------------------------------------- fake HTTP servers


class FakeServer:
    """A threaded HTTP server on 127.0.0.1 whose requests go to ``app.handle``."""

    def __init__(self, app):
        self.app = app
        app_ref = app

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _serve(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                status, ctype, payload = app_ref.handle(self.command, self.path, dict(self.headers), body)
                if isinstance(payload, str):
                    payload = payload.encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", ctype)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout tests)
                    pass

            do_GET = _serve  # noqa: N815
            do_POST = _serve  # noqa: N815

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.block_on_close = False
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _json(status, data):
    return status, "application/json", json.dumps(data)


def unauthorized(headers):
    # Like a careless server or proxy: the error body echoes the request headers, key included.
    return _json(401, {"error": "Unauthorized", "got": headers.get("Authorization"), "request_headers": headers})


def authorized(headers, key):
    return key is None or headers.get("Authorization") == f"Bearer {key}"


def bump(text, name, delta, **labels):
    """Add ``delta`` to the sample ``name`` with ``labels`` in Prometheus ``text`` (append it if absent)."""
    pattern = re.compile(r"^(?P<name>[^\s{]+)(?P<labels>\{[^}]*\})?\s+(?P<value>\S+)$")
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = pattern.match(line)
        if not m or line.startswith("#") or m.group("name") != name:
            continue
        if all(f'{k}="{v}"' in (m.group("labels") or "") for k, v in labels.items()):
            lines[i] = f"{name}{m.group('labels') or ''} {float(m.group('value')) + delta}"
            return "\n".join(lines) + "\n"
    label_text = ",".join(f'{k}="{v}"' for k, v in {"engine": "0", "model_name": MODEL, **labels}.items())
    lines.append(f"{name}{{{label_text}}} {float(delta)}")
    return "\n".join(lines) + "\n"


class FakeVllm:
    """A vLLM instance: /health (open), /version, /v1/models, /metrics from a captured fixture (the API key on
    every route but /health, as roles/vllm_instance's inferops_vllm_auth.py requires it)."""

    def __init__(self, fixture, key=None, version="0.32.0", models=(MODEL,)):
        self.metrics = (FIXTURES / fixture).read_text()
        self.key = key
        self.version = version
        self.models = list(models)
        self.health_failures = 0  # answer 503 (still loading) to this many /health requests first
        self.delays = {}  # path -> seconds to sleep before answering
        self.lock = threading.Lock()
        self.requests = []
        self.server = FakeServer(self)
        self.url = self.server.url

    def add(self, name, delta, **labels):
        with self.lock:
            self.metrics = bump(self.metrics, name, delta, **labels)

    def handle(self, method, path, headers, body):
        self.requests.append((method, path, headers.get("Authorization")))
        time.sleep(self.delays.get(path, 0))
        if path == "/health":
            if self.health_failures > 0:
                self.health_failures -= 1
                return 503, "text/plain", ""
            return 200, "text/plain", ""
        if not authorized(headers, self.key):
            return unauthorized(headers)
        if path == "/version":
            return _json(200, {"version": self.version})
        if path == "/metrics":
            with self.lock:
                return 200, "text/plain; version=0.0.4; charset=utf-8", self.metrics
        if path.startswith("/v1/"):
            if path == "/v1/models":
                return _json(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]})
        return _json(404, {"detail": "Not Found"})


SRC = "vllm:prompt_tokens_by_source_total"


def prompt_tokens(request):
    """The prompt tokens the fake instances count for a proof request (what its usage reports)."""
    return len(request["prompt"].split()) + 4


class FakeRouter:
    """vllm-router in PD mode behind an nginx front that wants the client key on every path.

    ``decodes``: the decode instances, taken in turn (round robin). ``mode``: what happens to a request
    (see :meth:`simulate`), or a list of modes, one for each request in turn. ``usage``: whether the
    answers report their token usage.
    """

    def __init__(self, prefill, decodes, key=CLIENT_KEY, mode="handoff", metrics_delay=0.0, usage=True):
        self.prefill = prefill
        self.decodes = decodes
        self.key = key
        self.modes = mode if isinstance(mode, list) else [mode]
        self.metrics_delay = metrics_delay
        self.usage = usage
        self.completions = []
        self.pd_requests = {}  # worker URL -> PD requests sent to it
        self.server = FakeServer(self)
        self.url = self.server.url
        self.metrics_server = FakeServer(RouterMetrics(self))
        self.metrics_url = f"{self.metrics_server.url}/metrics"

    def handle(self, method, path, headers, body):
        if not authorized(headers, self.key):
            return unauthorized(headers)
        if path == "/health":
            return 200, "text/plain", "OK"
        if path == "/v1/models":
            return _json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        if path == "/v1/completions" and method == "POST":
            request = json.loads(body)
            number = len(self.completions)
            self.completions.append(request)
            tokens = prompt_tokens(request)
            if self.metrics_delay:
                threading.Timer(self.metrics_delay, self.simulate, (tokens, number)).start()
            else:
                self.simulate(tokens, number)
            answer = {
                "id": f"cmpl-{len(self.completions)}",
                "object": "text_completion",
                "model": MODEL,
                "choices": [{"index": 0, "text": " The capital of France is Paris", "finish_reason": "length"}],
            }
            if self.usage:
                answer["usage"] = {
                    "prompt_tokens": tokens,
                    "completion_tokens": request["max_tokens"],
                    "total_tokens": tokens + request["max_tokens"],
                }
            return _json(200, answer)
        return _json(404, {"detail": "Not Found"})

    def simulate(self, tokens, number):
        """Change the instances' metrics as vLLM does for request ``number`` (from 0) of ``tokens`` prompt tokens.

        Modes: ``handoff`` (decode receives all but the last prompt token by NIXL and recomputes that one),
        ``direct`` (no PD: decode computes the prompt), ``recompute`` (prefill computes the prompt but the KV
        never arrives, decode recomputes it), ``partial`` (one NIXL transfer brings a third of the prompt,
        decode computes the rest), ``cache`` (no transfer, decode takes the prompt from its own prefix cache
        but for the last token), ``no_transfer`` (the tokens are counted as external but NIXL records no
        transfer), ``nixl_fail`` (handoff, and the failed-transfer counter grows).
        """
        mode = self.modes[number % len(self.modes)]
        p, d = self.prefill, self.decodes[number % len(self.decodes)]
        if mode == "direct":
            d.add(SRC, tokens, source="local_compute")
            return
        for worker in (p.url, d.url):
            self.pd_requests[worker] = self.pd_requests.get(worker, 0) + 1
        p.add(SRC, tokens, source="local_compute")
        if mode == "recompute":
            d.add(SRC, tokens, source="local_compute")
            return
        if mode == "cache":
            d.add(SRC, tokens - 1, source="local_cache_hit")
            d.add(SRC, 1, source="local_compute")
            return
        received = tokens // 3 if mode == "partial" else tokens - 1
        d.add(SRC, received, source="external_kv_transfer")
        d.add(SRC, tokens - received, source="local_compute")
        if mode == "no_transfer":
            return
        d.add("vllm:nixl_xfer_time_seconds_count", 1)
        d.add("vllm:nixl_xfer_time_seconds_sum", 0.02)
        d.add("vllm:nixl_bytes_transferred_count", 1)
        d.add("vllm:nixl_bytes_transferred_sum", 983040)
        if mode == "nixl_fail":
            d.add("vllm:nixl_num_failed_transfers_total", 1)

    def close(self):
        self.server.close()
        self.metrics_server.close()


class RouterMetrics:
    def __init__(self, router):
        self.router = router

    def handle(self, method, path, headers, body):
        router = self.router
        counts = dict(router.pd_requests)
        prefill = router.prefill.url
        lines = ["# TYPE vllm_router_pd_prefill_requests_total counter"]
        lines.append(f'vllm_router_pd_prefill_requests_total{{worker="{prefill}"}} {counts.get(prefill, 0)}')
        lines.append("# TYPE vllm_router_pd_decode_requests_total counter")
        for d in router.decodes:
            lines.append(f'vllm_router_pd_decode_requests_total{{worker="{d.url}"}} {counts.get(d.url, 0)}')
        lines.append("# TYPE vllm_router_worker_health gauge")
        for worker in [router.prefill, *router.decodes]:
            lines.append(f'vllm_router_worker_health{{worker="{worker.url}"}} 1')
        return 200, "text/plain", "\n".join(lines) + "\n"


class Deployment:
    def __init__(self, instance_key=INSTANCE_KEY, client_key=CLIENT_KEY, decodes=1, **router_kwargs):
        self.prefill = FakeVllm("prefill_metrics.txt", key=instance_key)
        self.decodes = [FakeVllm("decode_metrics.txt", key=instance_key) for number in range(decodes)]
        self.decode = self.decodes[0]
        self.router = FakeRouter(self.prefill, self.decodes, key=client_key, **router_kwargs)

    def args(self, **overrides):
        args = {
            "instances": [
                {
                    "name": "prefill-0",
                    "url": self.prefill.url,
                    "role": "prefill",
                    "expected": {"kv_cache_dtype": "auto"},
                },
                {"name": "decode-0", "url": self.decode.url + "/", "role": "decode", "expected": {"block_size": 128}},
            ]
            + [
                {"name": f"decode-{number}", "url": d.url, "role": "decode"}
                for number, d in enumerate(self.decodes[1:], start=1)
            ],
            "model": MODEL,
            "vllm_version": "0.32.0",
            "router_url": self.router.url,
            "router_metrics_url": self.router.metrics_url,
            "api_key": CLIENT_KEY,
            "instance_api_key": INSTANCE_KEY,
            "wait_timeout": 5,
            "request_timeout": 5,
            "proof_settle_timeout": 0,
        }
        args.update(overrides)
        return args

    def close(self):
        for thing in (self.router, self.prefill.server, *(d.server for d in self.decodes)):
            thing.close()


@pytest.fixture()
def deployment():
    dep = Deployment()
    yield dep
    dep.close()


def closed_port_url():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"


# --------------------------------------------------------------------------- success


def test_all_healthy_and_handoff_proven(deployment):
    result = run_module(deployment.args())
    assert result["changed"] is False
    assert result["problems"] == []

    prefill, decode = result["instances"]
    assert prefill["name"] == "prefill-0" and prefill["role"] == "prefill" and prefill["healthy"] is True
    assert decode["url"] == deployment.decode.url  # trailing slash dropped
    assert prefill["version"] == "0.32.0"
    assert prefill["models"] == [MODEL]
    # Metrics are read before the proof: the values of the captured fixtures.
    assert decode["metrics"]["prompt_tokens_external_kv_transfer"] == 21
    assert decode["metrics"]["nixl_transfers"] == 1
    assert decode["metrics"]["nixl_bytes_transferred"] == 2949120
    assert prefill["metrics"]["prompt_tokens_local_compute"] == 21
    assert prefill["metrics"]["prefix_cache_hit_rate"] == 0.0
    assert decode["cache_config"] == {
        "block_size": 128,
        "cache_dtype": "auto",
        "kv_cache_size_tokens": 46592,
        "num_gpu_blocks": 364,
    }

    router = result["router"]
    assert router["url"] == deployment.router.url and router["healthy"] is True and router["models"] == [MODEL]
    assert router["metrics"]["worker_health"] == {deployment.prefill.url: 1, deployment.decode.url: 1}

    proof = result["proof"]
    sent = deployment.router.completions
    assert len(sent) == 3
    tokens = sum(prompt_tokens(r) for r in sent)
    assert proof["handoff_proven"] is True
    assert proof["requests"] == 3 and proof["requests_failed"] == 0
    assert proof["prompt_tokens"] == tokens
    assert proof["completion_tokens"] == 3 * 8
    assert proof["prefill_served"] == {"prefill-0": tokens}
    assert proof["decode_served"] == {"decode-0": tokens - 3}
    assert proof["kv_tokens_transferred"] == tokens - 3
    assert proof["decode_local_compute_tokens"] == 3
    assert proof["nixl_transfers"] == 3
    assert proof["nixl_bytes_transferred"] == 3 * 983040
    assert proof["nixl_xfer_time_seconds"] == pytest.approx(0.06)
    assert proof["nixl_failed_transfers"] == 0
    assert proof["sample_text"] == " The capital of France is Paris"
    assert proof["mean_request_seconds"] >= 0
    assert proof["router_requests"] == {"pd_prefill_requests": 3, "pd_decode_requests": 3}
    # Each request on its own: its prompt but the last token arrived by NIXL, in one transfer.
    assert [q["request"] for q in proof["per_request"]] == [1, 2, 3]
    for q, request in zip(proof["per_request"], sent, strict=True):
        n = prompt_tokens(request)
        assert q["prompt_tokens"] == n and q["kv_tokens_expected"] == n - 1
        assert q["kv_tokens_transferred"] == n - 1 and q["decode_local_compute_tokens"] == 1
        assert q["prefill_served"] == {"prefill-0": n} and q["decode_served"] == {"decode-0": n - 1}
        assert q["nixl_transfers"] == 1 and q["nixl_failed_transfers"] == 0
        assert q["nixl_bytes_transferred"] == 983040 and q["nixl_xfer_time_seconds"] == pytest.approx(0.02)
        assert q["handoff_proven"] is True
    # The metrics were read by check_instance, then right before and after each request.
    assert [path for method, path, auth in deployment.decode.requests].count("/metrics") == 1 + 2 * 3

    # The proof requests: greedy, several tokens, each prompt unique (no prefix-cache shortcut).
    assert all(r["temperature"] == 0 and r["max_tokens"] == 8 and r["model"] == MODEL for r in sent)
    assert len({r["prompt"] for r in sent}) == 3
    assert all(len(r["prompt"].split()) >= 16 for r in sent)
    # Keys went where they belong: the instance key to every route of the instances but /health.
    for method, path, auth in deployment.prefill.requests:
        assert auth == (None if path == "/health" else f"Bearer {INSTANCE_KEY}"), (method, path)


def test_the_proof_names_the_transport_and_judges_the_kv_throughput(deployment):
    # Each fake transfer moves 983040 bytes in 20 ms: 46.875 MiB/s.
    result = run_module(deployment.args(kv_transport="tcp", min_kv_throughput_mib_s=1))
    proof = result["proof"]
    assert proof["kv_transport"] == "tcp" and proof["nixl_throughput_mib_s"] == 46.875
    assert proof["throughput_bound_mib_s"] == 1.0
    assert proof["throughput_ok"] is True and result["problems"] == []


def test_kv_at_tcp_speed_on_an_rdma_deployment_fails_the_verification():
    dep = Deployment()
    try:
        result = run_module(dep.args(kv_transport="rdma", min_kv_throughput_mib_s=1024), expect="fail")
    finally:
        dep.close()
    proof = result["proof"]
    assert proof["handoff_proven"] is True and proof["throughput_ok"] is False
    assert ("PD proof: NIXL moved the proof's KV at 46.875 MiB/s (2949120 bytes in 60.0 ms of transfers), below the "
            "1024 MiB/s expected over rdma: that is the speed of TCP") in result["msg"]


def test_without_a_bound_the_throughput_is_shown_and_not_judged(deployment):
    proof = run_module(deployment.args())["proof"]
    assert proof["kv_transport"] is None and proof["nixl_throughput_mib_s"] == 46.875
    assert proof["throughput_bound_mib_s"] is None and proof["throughput_ok"] is None


def test_check_mode_runs_the_same_checks(deployment):
    result = run_module(deployment.args(_ansible_check_mode=True))
    assert result["changed"] is False
    assert result["proof"]["handoff_proven"] is True
    assert len(deployment.router.completions) == 3


def test_api_key_is_used_for_instances_when_no_instance_key():
    dep = Deployment(instance_key=CLIENT_KEY)
    try:
        result = run_module(dep.args(instance_api_key=None, pd_proof=False, router_metrics_url=None))
    finally:
        dep.close()
    assert result["proof"] is None
    assert result["router"]["metrics"] is None


def test_waits_for_an_instance_that_is_still_loading(deployment):
    deployment.decode.health_failures = 1
    started = time.monotonic()
    result = run_module(deployment.args(wait_timeout=20, pd_proof=False))
    assert all(i["healthy"] for i in result["instances"])
    assert time.monotonic() - started >= 1.5  # polled again after ~2 s


def test_metrics_that_arrive_late_are_waited_for():
    dep = Deployment(metrics_delay=0.5)
    try:
        result = run_module(dep.args(proof_requests=2, proof_settle_timeout=10))
    finally:
        dep.close()
    assert result["proof"]["handoff_proven"] is True
    # Each request's counters were waited for before the next request: none leaked into the next one.
    assert [q["nixl_transfers"] for q in result["proof"]["per_request"]] == [1, 1]


def test_router_metrics_are_optional(deployment):
    result = run_module(deployment.args(router_metrics_url=closed_port_url() + "/metrics"))
    assert result["router"]["metrics"] is None
    assert result["proof"]["handoff_proven"] is True
    assert result["proof"]["router_requests"] is None


# --------------------------------------------------------------------------- failures


def test_unreachable_instance_names_url_and_timeout(deployment):
    args = deployment.args(wait_timeout=1, pd_proof=False)
    dead = closed_port_url()
    args["instances"].append({"name": "decode-9", "url": dead, "role": "decode"})
    started = time.monotonic()
    result = run_module(args, expect="fail")
    assert time.monotonic() - started < 10
    msg = result["msg"]
    assert "decode-9" in msg and f"{dead}/health" in msg and "wait_timeout=1s" in msg
    assert "1 problem" in msg
    assert result["problems"] == [p for p in result["problems"] if "decode-9" in p]
    # Partial results: the healthy instances are still fully reported.
    dead_result = result["instances"][2]
    assert dead_result["healthy"] is False and dead_result["metrics"] is None
    assert result["instances"][0]["metrics"]["prompt_tokens_local_compute"] == 21


def test_request_timeout(deployment):
    deployment.decode.delays["/v1/models"] = 3
    result = run_module(deployment.args(request_timeout=1), expect="fail")
    msg = result["msg"]
    assert f"{deployment.decode.url}/v1/models" in msg
    assert "timed out" in msg and "request_timeout=1s" in msg
    assert "decode-0" in msg
    assert result["proof"] is None  # no proof on a broken deployment


def test_health_that_hangs_counts_against_wait_timeout(deployment):
    deployment.prefill.delays["/health"] = 3
    started = time.monotonic()
    result = run_module(deployment.args(wait_timeout=1, request_timeout=30, pd_proof=False), expect="fail")
    assert time.monotonic() - started < 10
    assert "prefill-0" in result["msg"] and "wait_timeout=1s" in result["msg"] and "timed out" in result["msg"]


def test_wrong_api_key_is_401_and_never_shown(deployment):
    result = run_module(deployment.args(instance_api_key=WRONG_KEY, pd_proof=False), expect="fail")
    msg = result["msg"]
    assert "HTTP 401" in msg and "API key was rejected" in msg
    assert "prefill-0" in msg and "decode-0" in msg  # every instance reported at once
    # /version, /v1/models and /metrics of each instance: all need the instance key (issue #25).
    assert len(result["problems"]) == 6
    assert all("HTTP 401" in p for p in result["problems"])
    # The fake servers echo the request headers (key included) in their error bodies.
    assert '"got": "Bearer ********"' in msg
    for problem in result["problems"]:
        assert len(problem) < 500


def test_missing_api_key_is_401(deployment):
    result = run_module(deployment.args(api_key=None, instance_api_key=None, pd_proof=False), expect="fail")
    assert "HTTP 401" in result["msg"] and "none was sent" in result["msg"]
    assert any("router" in p and "401" in p for p in result["problems"])


def test_wrong_router_key_is_not_shown_either(deployment):
    started = time.monotonic()
    result = run_module(deployment.args(api_key=WRONG_KEY, wait_timeout=30), expect="fail")
    assert time.monotonic() - started < 10  # a 401 is final: no waiting for wait_timeout
    assert len(result["problems"]) == 1
    assert result["problems"][0].startswith(
        f"router ({deployment.router.url}): GET {deployment.router.url}/health returned HTTP 401 "
        '(the API key was rejected): {"error": "Unauthorized", "got": "Bearer ********"'
    )
    assert len(result["problems"][0]) < 400
    assert result["router"]["healthy"] is False


def test_wrong_model(deployment):
    result = run_module(deployment.args(model="llama-3-8b", pd_proof=False), expect="fail")
    assert len(result["problems"]) == 3  # both instances and the router
    assert all("does not serve model llama-3-8b" in p for p in result["problems"])
    assert MODEL in result["msg"]


def test_wrong_version(deployment):
    deployment.decode.version = "0.31.2"
    result = run_module(deployment.args(), expect="fail")
    assert result["problems"] == [
        f"instance decode-0 ({deployment.decode.url}): expected vLLM version 0.32.0 but /version reports 0.31.2"
    ]
    assert result["instances"][1]["version"] == "0.31.2"


def test_fp8_asked_but_not_live(deployment):
    args = deployment.args()
    for inst in args["instances"]:
        inst["expected"] = {"kv_cache_dtype": "fp8", "block_size": 128}
    result = run_module(args, expect="fail")
    assert len(result["problems"]) == 2
    for name, server in (("prefill-0", deployment.prefill), ("decode-0", deployment.decode)):
        assert any(
            name in p and server.url in p and "kv_cache_dtype=fp8" in p and "cache_dtype=auto" in p
            for p in result["problems"]
        )
    assert deployment.router.completions == []


def test_pd_without_handoff():
    dep = Deployment(mode="direct")
    try:
        result = run_module(dep.args(), expect="fail")
    finally:
        dep.close()
    proof = result["proof"]
    assert proof["handoff_proven"] is False
    assert proof["requests"] == 3
    assert proof["kv_tokens_transferred"] == 0
    assert proof["decode_local_compute_tokens"] == proof["prompt_tokens"]
    msg = result["msg"]
    assert "no KV arrived by external_kv_transfer on decode (decode-0)" in msg
    assert "recomputed on decode" in msg and "did not go through prefill" in msg


def test_pd_recomputed_on_decode():
    dep = Deployment(mode="recompute")
    try:
        result = run_module(dep.args(), expect="fail")
    finally:
        dep.close()
    assert result["proof"]["handoff_proven"] is False
    assert "recomputed on decode" in result["msg"]
    assert "did not go through prefill" not in result["msg"]


def test_pd_nixl_failures():
    dep = Deployment(mode="nixl_fail")
    try:
        result = run_module(dep.args(proof_requests=2), expect="fail")
    finally:
        dep.close()
    assert result["proof"]["nixl_failed_transfers"] == 2
    assert "NIXL failed transfers grew" in result["msg"]


def run_failing_proof(**kwargs):
    """Run the module against a deployment whose router does ``kwargs``; returns (result, prompt tokens)."""
    proof_requests = kwargs.pop("proof_requests", 3)
    dep = Deployment(**kwargs)
    try:
        result = run_module(dep.args(proof_requests=proof_requests), expect="fail")
    finally:
        dep.close()
    sent = dep.router.completions
    assert len(sent) == proof_requests
    assert result["proof"]["handoff_proven"] is False
    # Every problem is a proof problem, the instances themselves are fine.
    assert all(p.startswith("PD proof: request ") for p in result["problems"]), result["problems"]
    return result, prompt_tokens(sent[0])


def test_pd_one_request_handed_over_two_taken_from_decode_cache():
    # Decode received one request's prompt by NIXL (one transfer) and had the other two without any transfer:
    # the totals (KV arrived, at most one local token per request, prefill computed all) looked like a handoff.
    result, n = run_failing_proof(mode=["handoff", "cache", "cache"])
    proof = result["proof"]
    assert proof["kv_tokens_transferred"] == n - 1 and proof["nixl_transfers"] == 1
    assert proof["decode_local_compute_tokens"] == 3 and proof["prefill_served"] == {"prefill-0": 3 * n}
    assert [q["handoff_proven"] for q in proof["per_request"]] == [True, False, False]
    assert [q["kv_tokens_transferred"] for q in proof["per_request"]] == [n - 1, 0, 0]
    msg = result["msg"]
    assert "request 1 of 3" not in msg
    for number in (2, 3):
        assert (
            f"PD proof: request {number} of 3 ({n} prompt tokens): decode (decode-0) received 0 of {n - 1} expected "
            f"prompt tokens by NIXL (external_kv_transfer), computed 1 itself, found {n - 1} in its own prefix cache"
        ) in msg
        assert f"request {number} of 3: NIXL recorded no transfer" in msg


def test_pd_partial_handoff():
    result, n = run_failing_proof(mode="partial")
    received = n // 3
    assert [q["kv_tokens_transferred"] for q in result["proof"]["per_request"]] == [received] * 3
    assert result["proof"]["nixl_transfers"] == 3
    for number in (1, 2, 3):
        assert (
            f"request {number} of 3 ({n} prompt tokens): decode (decode-0) received {received} of {n - 1} expected "
            f"prompt tokens by NIXL (external_kv_transfer), computed {n - received} itself: only part of the "
            "prompt's KV was handed over"
        ) in result["msg"]
    assert len(result["problems"]) == 3


def test_pd_mixed_two_handed_over_one_computed_on_decode():
    result, n = run_failing_proof(mode=["handoff", "handoff", "recompute"])
    proof = result["proof"]
    assert [q["handoff_proven"] for q in proof["per_request"]] == [True, True, False]
    assert proof["nixl_transfers"] == 2
    assert all(p.startswith("PD proof: request 3 of 3") for p in result["problems"])
    assert (
        f"request 3 of 3 ({n} prompt tokens): decode (decode-0) received 0 of {n - 1} expected prompt tokens by "
        f"NIXL (external_kv_transfer), computed {n} itself: no KV arrived"
    ) in result["msg"]
    assert "recomputed on decode" in result["msg"]


def test_pd_zero_transfers():
    result, n = run_failing_proof(mode="no_transfer")
    proof = result["proof"]
    assert proof["nixl_transfers"] == 0 and proof["kv_tokens_transferred"] == 3 * (n - 1)
    assert len(result["problems"]) == 3
    for number in (1, 2, 3):
        assert f"request {number} of 3: NIXL recorded no transfer" in result["msg"]


def test_pd_two_decode_instances():
    dep = Deployment(decodes=2)
    try:
        result = run_module(dep.args())
    finally:
        dep.close()
    n = prompt_tokens(dep.router.completions[0])
    proof = result["proof"]
    assert proof["handoff_proven"] is True
    assert proof["decode_served"] == {"decode-0": 2 * (n - 1), "decode-1": n - 1}
    assert [q["decode_served"] for q in proof["per_request"]] == [
        {"decode-0": n - 1, "decode-1": 0},
        {"decode-0": 0, "decode-1": n - 1},
        {"decode-0": n - 1, "decode-1": 0},
    ]
    assert proof["router_requests"] == {"pd_prefill_requests": 3, "pd_decode_requests": 3}


def test_pd_two_decode_instances_one_recomputes():
    result, n = run_failing_proof(decodes=2, mode=["handoff", "recompute"], proof_requests=2)
    assert [q["handoff_proven"] for q in result["proof"]["per_request"]] == [True, False]
    assert f"request 2 of 2 ({n} prompt tokens): decode (decode-1) received 0 of {n - 1}" in result["msg"]


def test_pd_without_usage_in_the_answers():
    dep = Deployment(usage=False)
    try:
        result = run_module(dep.args(proof_requests=2))
    finally:
        dep.close()
    n = prompt_tokens(dep.router.completions[0])
    proof = result["proof"]
    assert proof["handoff_proven"] is True
    assert proof["prompt_tokens"] is None and proof["completion_tokens"] is None
    assert [(q["prompt_tokens"], q["kv_tokens_expected"]) for q in proof["per_request"]] == [(None, n - 1)] * 2
    # The instances' own counts still catch a partial handoff.
    result, n = run_failing_proof(usage=False, mode=["handoff", "partial"], proof_requests=2)
    assert f"request 2 of 2 ({n} prompt tokens as the instances counted them" in result["msg"]
    assert f"received {n // 3} of {n - 1} expected" in result["msg"]


def test_metrics_garbage(deployment):
    deployment.decode.metrics = "<html><body>" + "oops " * 200 + "</body></html>"
    result = run_module(deployment.args(), expect="fail")
    assert f"{deployment.decode.url}/metrics" in result["msg"]
    assert "not Prometheus text" in result["msg"]


def test_invalid_parameters():
    result = run_module(
        {"instances": [{"name": "p", "url": "10.0.0.1:8100", "role": "prefill"}], "model": MODEL, "pd_proof": True},
        expect="fail",
    )
    assert "Invalid parameters" in result["msg"]
    assert "pd_proof needs router_url" in result["msg"]
    assert "is not an http:// or https:// URL" in result["msg"]
    assert "role decode" in result["msg"]


def test_missing_prometheus_client(monkeypatch):
    monkeypatch.setattr(vllm_health, "HAS_PROMETHEUS_CLIENT", False)
    monkeypatch.setattr(vllm_health, "PROMETHEUS_CLIENT_IMPORT_ERROR", "Traceback: No module named 'prometheus_client'")
    result = run_module({"instances": [], "model": MODEL}, expect="fail")
    assert "prometheus_client" in result["msg"]
    assert "No module named" in result["exception"]


def test_nixl_counters_absent_before_the_first_transfer():
    dep = Deployment()
    # A freshly started decode instance has not created its NIXL metrics yet.
    dep.decode.metrics = "\n".join(line for line in dep.decode.metrics.splitlines() if "nixl" not in line) + "\n"
    try:
        result = run_module(dep.args(proof_requests=1))
    finally:
        dep.close()
    assert result["instances"][1]["metrics"]["nixl_transfers"] == 0
    assert result["proof"]["handoff_proven"] is True
    assert result["proof"]["nixl_transfers"] == 1


# --------------------------------------------------------------------------- documentation and structure


def test_documentation_matches_argument_spec():
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load(vllm_health.DOCUMENTATION)
    spec = vllm_health.argument_spec()
    assert_documented_as_specified(doc["options"], spec)
    assert spec["api_key"]["no_log"] is True and spec["instance_api_key"]["no_log"] is True
    assert doc["version_added"] == "0.1.0"
    assert doc["requirements"] == ["prometheus_client"]
    assert doc["attributes"]["check_mode"]["support"] == "full"
    assert doc["attributes"]["diff_mode"]["support"] == "none"
    assert len(spec["proof_prompt"]["default"].split()) >= 16

    examples = yaml.safe_load(vllm_health.EXAMPLES)
    for task in examples:
        args = task.get("inferops.vllm.vllm_health")
        if args is not None:
            assert set(args) <= set(spec), set(args) - set(spec)

    returned = yaml.safe_load(vllm_health.RETURN)
    assert {"instances", "router", "proof", "problems"} <= set(returned)
    assert set(returned["instances"]["contains"]["metrics"]["contains"]) == {
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_hit_rate",
        "prompt_tokens_local_compute",
        "prompt_tokens_local_cache_hit",
        "prompt_tokens_external_kv_transfer",
        "nixl_transfers",
        "nixl_failed_transfers",
        "nixl_bytes_transferred",
        "nixl_xfer_time_seconds",
    }

    def has_sample(entry, where):
        if "contains" in entry and entry["type"] in ("dict", "list"):
            for key, sub in entry["contains"].items():
                has_sample(sub, f"{where}.{key}")
        else:
            assert "sample" in entry, where

    for key, entry in returned.items():
        has_sample(entry, key)


def test_module_has_no_globals_besides_documentation():
    assert_no_globals_besides_documentation(vllm_health)
