"""Unit tests for plugins/module_utils/_http.py against a real HTTP server on 127.0.0.1: one TLS context per
settings however many requests, and fetch_url's (response, info) for an answer, an HTTP error, no answer and a
URL that open_url rejects."""

from __future__ import annotations

import contextlib
import http.server
import socket
import ssl
import threading

import pytest
from ansible_collections.inferops.vllm.plugins.module_utils import _http


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        status, body = (200, b"ok") if self.path == "/ok" else (503, b"engine not ready")
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args):
        pass


@pytest.fixture(scope="module")
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_port}"
    srv.shutdown()
    srv.server_close()


@contextlib.contextmanager
def socket_bound():
    """A port bound and not listening, so a connection to it is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@pytest.fixture()
def fresh(monkeypatch):
    """No context kept from an earlier test; counts the contexts built."""
    built = []
    real = _http.make_context
    monkeypatch.setattr(_http, "_CONTEXTS", {})
    monkeypatch.setattr(_http, "make_context", lambda **kw: built.append(kw) or real(**kw))
    return built


def test_one_context_per_settings_however_many_requests(server, fresh):
    for _request in range(5):
        resp, info = _http.fetch(f"{server}/ok")
        assert info["status"] == 200 and resp.read() == b"ok"
        resp.close()
    with _http.open_shared(f"{server}/ok", timeout=5) as resp:
        assert resp.read() == b"ok"
    assert fresh == [{"cafile": None, "validate_certs": True}]
    unverified = _http.shared_context(validate_certs=False)
    assert unverified.verify_mode == ssl.CERT_NONE and not unverified.check_hostname
    assert _http.shared_context(validate_certs=True).verify_mode == ssl.CERT_REQUIRED
    assert len(fresh) == 2


def test_an_http_error_gives_its_status_and_body(server, fresh):
    resp, info = _http.fetch(f"{server}/not-ready")
    assert resp is None
    assert info["status"] == 503 and info["body"] == b"engine not ready", info


def test_no_answer_and_a_bad_url_are_failed_requests_not_a_failed_module(fresh):
    with socket_bound() as port:  # a port nobody listens on
        resp, info = _http.fetch(f"http://127.0.0.1:{port}/health", timeout=2)
    assert resp is None and info["status"] == -1 and "refused" in info["msg"].lower(), info
    resp, info = _http.fetch("nothing://here", timeout=2)
    assert resp is None and info["status"] == -1 and info["msg"], info
