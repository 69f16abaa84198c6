"""Fake "local" OpenAI-compatible service (stands in for the vllm-router replicas).

Listens on the ports given on the command line (one per router replica). What it answers is
switched by the mode file (default /tmp/gw/local_mode), read on every request:
  ok           200, JSON or SSE (as the request's "stream" asks), model = the requested one
  503 500 502  that status with an OpenAI-style error body, before anything else
  429          429 (the local service's own limit)
  400 401 404  client errors (must reach the client unchanged, no fallback)
  slow         sleeps SLOW_SECS (default 5) before the status line
  stream_die   200 + SSE headers, two chunks, then the connection is dropped (no [DONE])
  router_text  vllm-router's own errors: 400 in plain text naming a worker's URL (POST), 503 in plain
               text on GET /v1/models
  vllm_addr    400 in vLLM's JSON error shape whose message names an instance's URL and address
Completion ids are vllm-router's: they carry the instances' addresses (ID below); the front must hide them.
Every request is appended to /tmp/gw/local_requests.log (path, model) for the tests.
Connection refused is tested by stopping this process.
"""
import json
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODE_FILE = os.environ.get("MODE_FILE", "/tmp/gw/local_mode")
LOG = os.environ.get("REQ_LOG", "/tmp/gw/local_requests.log")
SLOW_SECS = float(os.environ.get("SLOW_SECS", "5"))
# vllm-router's completion ids, with the instances' addresses in them (issue #25).
ID = "cmpl-___prefill_addr_10.89.250.11:8100___decode_addr_10.89.250.12:8200_5f0c2a9e8d7b4c1aa3e6f9b2d4c8e7a1"


def readiness():
    """What GET /readiness answers (the readiness_mode file beside the mode file): ok (every worker healthy),
    degraded (one decode of two), none (no healthy decode: 503) or garbage (200 that is not JSON)."""
    try:
        with open(os.path.join(os.path.dirname(MODE_FILE), "readiness_mode")) as f:
            return f.read().strip() or "ok"
    except FileNotFoundError:
        return "ok"


def mode():
    try:
        with open(MODE_FILE) as f:
            return f.read().strip() or "ok"
    except FileNotFoundError:
        return "ok"


class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed-ACK stall

    def log_message(self, *a):
        pass

    def _json(self, status, obj, extra=None):
        body = (json.dumps(obj) + "\n").encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def _text(self, status, text):
        body = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/v1/models" and mode() == "router_text":
            self._text(503, "No available workers: 1 prefill (http://10.89.250.11:8100), 0 decode")
        elif self.path == "/readiness":
            # vllm-router 0.1.17's /readiness (measured): 200 while a prefill and a decode worker are healthy.
            state = readiness()
            if state == "garbage":
                self._text(200, "not json")
            elif state == "none":
                self._json(503, {"status": "not_ready", "reason": "no healthy decode workers",
                                 "prefill": {"healthy": 1, "total": 1}, "decode": {"healthy": 0, "total": 2}})
            else:
                self._json(200, {"status": "ready", "prefill": {"healthy": 1, "total": 1},
                                 "decode": {"healthy": 1 if state == "degraded" else 2, "total": 2}})
        elif self.path == "/health":
            m = mode()
            if m in ("ok", "slow", "stream_die", "400", "401", "404", "429"):
                self._json(200, {"status": "ok"})
            else:
                self._json(503, {"status": "unhealthy"})
        else:
            self._json(404, {"error": {"message": "not found"}})

    def do_POST(self):
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n)
        try:
            req = json.loads(raw)
        except Exception:
            req = {}
        m = mode()
        with open(LOG, "a") as f:
            f.write(json.dumps({"path": self.path, "model": req.get("model"), "mode": m,
                                "auth": self.headers.get("Authorization"),
                                "cache_salt": req.get("cache_salt") if isinstance(req, dict) else None}) + "\n")
        if m == "router_text":
            return self._text(400, "Failed to send request to http://10.89.250.12:8200/v1/completions: bad body")
        if m == "vllm_addr":
            msg = "KV transfer from http://10.89.250.11:8100 (10.89.250.11:5600) failed: bad request"
            return self._json(400, {"error": {"message": msg, "type": "BadRequestError", "param": None, "code": 400}})
        if m in ("503", "500", "502", "429", "400", "401", "404"):
            code = int(m)
            extra = {"Retry-After": "1"} if code == 429 else None
            return self._json(code, {"error": {"message": f"local says {code}", "type": "local", "code": code}}, extra)
        if m == "slow":
            time.sleep(SLOW_SECS)
        model = req.get("model", "?")
        if req.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            words = ["local", " says", " hello", " world"]
            for i, w in enumerate(words):
                if m == "stream_die" and i == 2:
                    self.wfile.flush()
                    # Drop the connection mid-stream (RST).
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    self.connection.close()
                    return
                chunk = {"id": ID, "object": "chat.completion.chunk", "model": model,
                         "choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
                time.sleep(0.05)
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True
            return
        self._json(200, {"id": ID, "object": "chat.completion", "model": model,
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": "local says hello"},
                                      "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}})


def main():
    os.makedirs(os.path.dirname(MODE_FILE), exist_ok=True)
    servers = [ThreadingHTTPServer(("127.0.0.1", int(p)), H) for p in sys.argv[1:]]
    for s in servers:
        s.daemon_threads = True
        threading.Thread(target=s.serve_forever, daemon=True).start()
    print("fake local on", sys.argv[1:], flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
