"""Fake "cloud" OpenAI-compatible endpoint over HTTPS (certificate of a test CA, name cloud.test).

usage: fake_cloud.py PORT NAME EXPECTED_KEY CERT KEY
It checks `Authorization: Bearer EXPECTED_KEY` (401 otherwise, and, like some providers, that
401 quotes the key it received: the front must never pass that body on). It answers with a model
name of its own: the requested one + "-2024-07-18" (as OpenAI does for an alias), JSON or SSE.
Mode file /tmp/gw/cloud_<NAME>_mode: ok | 503 | 429 | 401 | 400 | slow.
Each request is logged to /tmp/gw/cloud_<NAME>_requests.log: model received, whether the key
matched, and the names of the headers it received (values of none but a few).
"""
import json
import ssl
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PORT, NAME, KEY, CERT, PKEY = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
MODE_FILE = f"/tmp/gw/cloud_{NAME}_mode"
LOG = f"/tmp/gw/cloud_{NAME}_requests.log"


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

    def _json(self, status, obj):
        body = (json.dumps(obj) + "\n").encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Set-Cookie", "__cf_bm=tracking; path=/")
        self.send_header("openai-organization", "org-secret-tenant")
        self.send_header("openai-version", "2020-10-01")
        self.send_header("x-ratelimit-remaining-requests", "9999")
        self.send_header("x-request-id", "req_cloud_123")
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n)
        try:
            req = json.loads(raw)
        except Exception:
            req = None
        auth = self.headers.get("Authorization", "")
        m = mode()
        with open(LOG, "a") as f:
            f.write(json.dumps({"path": self.path, "model": (req or {}).get("model"), "key_ok": auth == f"Bearer {KEY}",
                                "mode": m, "content_length": n, "body_len_ok": len(raw) == n,
                                "host": self.headers.get("Host"),
                                "x_forwarded_for": self.headers.get("X-Forwarded-For"),
                                "headers": sorted(self.headers.keys()),
                                "messages_len": len(json.dumps((req or {}).get("messages", ""))),
                                "max_tokens": (req or {}).get("max_tokens"), "n": (req or {}).get("n")}) + "\n")
        if req is None:
            return self._json(400, {"error": {"message": "body is not JSON"}})
        if auth != f"Bearer {KEY}" or m == "401":
            return self._json(401, {"error": {"message": f"Incorrect API key provided: {auth[7:]}",
                                              "type": "invalid_request_error", "code": "invalid_api_key"}})
        if m in ("503", "429", "400"):
            return self._json(int(m), {"error": {"message": f"cloud {NAME} says {m}"}})
        if m == "slow":
            time.sleep(5)
        model = str(req.get("model")) + "-2024-07-18"
        if req.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream; charset=utf-8")
            self.send_header("Set-Cookie", "__cf_bm=tracking; path=/")
            self.send_header("x-ratelimit-remaining-tokens", "123456")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def chunk(b):
                self.wfile.write(f"{len(b):x}\r\n".encode() + b + b"\r\n")
                self.wfile.flush()
            words = ["cloud", " says", " h\u00e9llo", " \u4e16\u754c"]
            for i, w in enumerate(words):
                c = {"id": "chatcmpl-cloud", "object": "chat.completion.chunk", "model": model,
                     "choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}]}
                data = f"data: {json.dumps(c, ensure_ascii=False)}\n\n".encode()
                if i == 1:
                    # Split one event across two TCP writes, in the middle of the "model" value
                    # and in the middle of a UTF-8 sequence: the filter must not depend on
                    # events arriving whole.
                    cut = data.index(b'"model"') + 12
                    chunk(data[:cut])
                    time.sleep(0.05)
                    chunk(data[cut:])
                elif i == 2:
                    cut = data.index("\u00e9".encode()) + 1
                    chunk(data[:cut])
                    time.sleep(0.05)
                    chunk(data[cut:])
                else:
                    chunk(data)
                time.sleep(0.03)
            chunk(b"data: [DONE]\n\n")
            chunk(b"")
            return
        self._json(200, {"id": "chatcmpl-cloud", "object": "chat.completion", "model": model,
                         "choices": [{"index": 0, "message": {"role": "assistant",
                                                              "content": f"cloud {NAME} says hello"},
                                      "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}})


def main():
    srv = ThreadingHTTPServer(("127.0.0.1", int(PORT)), H)
    srv.daemon_threads = True
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(CERT, PKEY)
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    print(f"fake cloud {NAME} on {PORT}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
