"""Unit tests for roles/vllm_instance/files/inferops_vllm_auth.py: the instance key on every route of a vLLM
instance except /health (issue #25).

Driven through a small hand-written ASGI harness (no HTTP server), against a bare ASGI app and, when
Starlette is importable, against a Starlette app wired the way vLLM 0.32 wires it
(``app.add_middleware(InstanceKeyMiddleware)`` with no arguments, a ``Mount`` for /metrics, a websocket
route). The live check of every route a real vLLM registers is molecule/default/tests/test_security.py.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import time
from pathlib import Path

import pytest

MODULE = Path(__file__).resolve().parents[2] / "roles" / "vllm_instance" / "files" / "inferops_vllm_auth.py"
_spec = importlib.util.spec_from_file_location("inferops_vllm_auth", MODULE)
auth = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(auth)

KEY = "instance-key-0123456789abcdef"
OTHER = "other-key-0123456789abcdefgh"


def call(app, path, method="GET", headers=(), kind="http"):
    """One request through ``app``; returns (status or 'closed:<code>' / 'accepted', headers, body, reached)."""
    sent = []
    reached = []

    async def inner(scope, receive, send):
        reached.append(scope["path"])
        if scope["type"] == "websocket":
            await send({"type": "websocket.accept"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"served " + scope["path"].encode()})

    async def receive():
        if kind == "websocket":
            return {"type": "websocket.connect"}
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {
        "type": kind, "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
        "raw_path": path.encode(), "root_path": "", "scheme": "http", "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers],
        "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8100),
    }
    if kind == "websocket":
        scope.pop("method")
    target = app(inner) if callable(app) and not hasattr(app, "router") else app
    asyncio.run(target(scope, receive, send))
    if kind == "websocket":
        first = sent[0]
        status = "accepted" if first["type"] == "websocket.accept" else f"closed:{first.get('code')}"
        return status, {}, b"", reached
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    hdrs = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    return start["status"], hdrs, body, reached


def mw(keys=(KEY,)):
    return lambda inner: auth.InstanceKeyMiddleware(inner, keys=[k.encode() for k in keys])


def bearer(key):
    return [("Authorization", f"Bearer {key}")]


# --------------------------------------------------------------------------- the rules, on a bare ASGI app

ROUTES = ["/v1/completions", "/invocations", "/tokenize", "/detokenize", "/metrics", "/metrics/", "/version",
          "/openapi.json", "/docs", "/pooling", "/collective_rpc", "/server_info", "/load", "/ping", "/",
          "/no-such-route", "/health/", "/healthz", "/HEALTH", "//health", "/health/../tokenize"]


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("method", ["GET", "POST", "OPTIONS"])
def test_every_route_but_health_is_refused_without_the_key(path, method):
    status, hdrs, body, reached = call(mw(), path, method)
    assert status == 401
    assert reached == []
    assert hdrs["www-authenticate"].startswith("Bearer ")
    assert hdrs["content-type"] == "application/json"
    assert int(hdrs["content-length"]) == len(body)
    assert json.loads(body)["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("path", ROUTES)
def test_every_route_is_served_with_the_key(path):
    status, _hdrs, body, reached = call(mw(), path, "POST", bearer(KEY))
    assert status == 200 and reached == [path] and body == b"served " + path.encode()


@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_health_needs_no_key(method):
    status, _hdrs, _body, reached = call(mw(), "/health", method)
    assert status == 200 and reached == ["/health"]


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "OPTIONS"])
def test_health_with_another_method_needs_the_key(method):
    assert call(mw(), "/health", method)[0] == 401


@pytest.mark.parametrize(
    "headers",
    [
        [("Authorization", f"Bearer {OTHER}")],
        [("Authorization", f"Bearer {KEY[:-1]}")],
        [("Authorization", f"Bearer {KEY}x")],
        [("Authorization", f"Basic {KEY}")],
        [("Authorization", KEY)],
        [("Authorization", "Bearer ")],
        [("Authorization", "Bearer")],
        [("Authorization", "")],
        [("X-Api-Key", KEY)],
        [("Authorization", f"Bearer {KEY}"), ("Authorization", f"Bearer {OTHER}")],
        [("Authorization", f"Bearer {KEY.upper()}")],
    ],
    ids=["other", "prefix", "longer", "basic", "no-scheme", "empty-token", "scheme-only", "empty", "x-api-key",
         "two-headers", "case-changed"],
)
def test_a_wrong_or_malformed_key_is_refused(headers):
    status, _hdrs, body, reached = call(mw(), "/v1/completions", "POST", headers)
    assert status == 401 and reached == []
    assert KEY.encode() not in body and OTHER.encode() not in body


def test_the_scheme_is_case_insensitive_and_surrounding_spaces_are_ignored():
    assert call(mw(), "/tokenize", "POST", [("Authorization", f"bearer {KEY}")])[0] == 200
    assert call(mw(), "/tokenize", "POST", [("Authorization", f"  BEARER   {KEY}  ")])[0] == 200


def test_any_of_several_keys_is_accepted():
    app = mw((OTHER, KEY))
    assert call(app, "/invocations", "POST", bearer(KEY))[0] == 200
    assert call(app, "/invocations", "POST", bearer(OTHER))[0] == 200
    assert call(app, "/invocations", "POST", bearer("third-key-0123456789abcdef"))[0] == 401


def test_without_any_key_configured_everything_but_health_is_refused(caplog):
    app = mw(())
    assert call(app, "/health")[0] == 200
    assert call(app, "/v1/models", "GET", bearer(""))[0] == 401
    assert call(app, "/v1/models", "GET", bearer(KEY))[0] == 401
    assert "every route but /health is refused" in caplog.text


def test_keys_come_from_vllm_api_key(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    app = auth.InstanceKeyMiddleware  # as vLLM builds it: the class called with the app alone
    assert call(app, "/tokenize", "POST", bearer(KEY))[0] == 200
    assert call(app, "/tokenize", "POST")[0] == 401
    assert auth.keys_from_environment({"VLLM_API_KEY": ""}) == []
    assert auth.keys_from_environment({}) == []


def test_a_websocket_without_the_key_is_closed_before_it_is_accepted():
    status, _h, _b, reached = call(mw(), "/v1/realtime", kind="websocket")
    assert status == "closed:1008" and reached == []
    status, _h, _b, reached = call(mw(), "/v1/realtime", kind="websocket", headers=bearer(KEY))
    assert status == "accepted" and reached == ["/v1/realtime"]


def test_lifespan_passes():
    seen = []

    async def inner(scope, receive, send):
        seen.append(scope["type"])

    asyncio.run(auth.InstanceKeyMiddleware(inner, keys=[KEY.encode()])({"type": "lifespan"}, None, None))
    assert seen == ["lifespan"]


def test_the_comparison_uses_compare_digest_against_every_key(monkeypatch):
    """Constant time: hmac.compare_digest, and no early exit when an earlier key matched."""
    calls = []
    real = auth.hmac.compare_digest

    def spy(a, b):
        calls.append(b)
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    keys = [KEY.encode(), OTHER.encode(), b"third-key-0123456789abcdef"]
    assert auth.authorized([(b"authorization", b"Bearer " + KEY.encode())], keys)
    assert calls == keys


def test_timing_does_not_depend_on_how_much_of_the_key_matches():
    """A coarse guard against a plain == creeping back in: a token sharing a long prefix with the key
    takes no measurably longer than one sharing none (compare_digest looks at every byte)."""
    key = b"k" * 4096
    keys = [key]
    near = [(b"authorization", b"Bearer " + b"k" * 4095 + b"x")]
    far = [(b"authorization", b"Bearer " + b"x" * 4096)]

    def best(headers):
        times = []
        for _unused in range(7):
            t = time.perf_counter()
            for _unused2 in range(2000):
                auth.authorized(headers, keys)
            times.append(time.perf_counter() - t)
        return min(times)

    near_t, far_t = best(near), best(far)
    assert near_t < far_t * 3 and far_t < near_t * 3, (near_t, far_t)


# --------------------------------------------------------------------------- wired as vLLM wires it (Starlette)


def test_in_a_starlette_app_as_vllm_adds_it(monkeypatch):
    starlette = pytest.importorskip("starlette")
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse
    from starlette.routing import Mount, Route, WebSocketRoute

    async def text(request):
        return PlainTextResponse(f"served {request.url.path}")

    async def metrics_app(scope, receive, send):
        await PlainTextResponse("vllm:num_requests_running 0\n")(scope, receive, send)

    async def ws(websocket):
        await websocket.accept()
        await websocket.close()

    async def openapi(request):
        return JSONResponse({"paths": {"/v1/completions": {}, "/invocations": {}, "/tokenize": {}}})

    metrics = Mount("/metrics", metrics_app)
    metrics.path_regex = re.compile("^/metrics(?P<path>.*)$")  # vLLM's own workaround for the 307 of a Mount
    app = Starlette(routes=[
        Route("/health", text), Route("/v1/completions", text, methods=["POST"]),
        Route("/invocations", text, methods=["POST"]), Route("/tokenize", text, methods=["POST"]),
        Route("/openapi.json", openapi), metrics, WebSocketRoute("/v1/realtime", ws),
    ])
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    # vLLM: `app.add_middleware(imported)` for a class given to --middleware (no arguments).
    app.add_middleware(auth.InstanceKeyMiddleware)
    assert call(app, "/health")[0] == 200
    for path, method in [("/v1/completions", "POST"), ("/invocations", "POST"), ("/tokenize", "POST"),
                         ("/openapi.json", "GET"), ("/metrics", "GET"), ("/metrics/", "GET"), ("/nope", "GET")]:
        assert call(app, path, method)[0] == 401, path
    assert call(app, "/invocations", "POST", bearer(KEY))[2] == b"served /invocations"
    status, _h, body, _r = call(app, "/metrics", "GET", bearer(KEY))
    assert status == 200 and b"vllm:num_requests_running" in body
    assert call(app, "/openapi.json", "GET", bearer(KEY))[0] == 200
    assert call(app, "/nope", "GET", bearer(KEY))[0] == 404  # the key does not make an unknown route exist
    assert call(app, "/v1/realtime", kind="websocket")[0] == "closed:1008"
    assert starlette.__version__


# --------------------------------------------------------------------------- the keys file (rotation without restart


def _replace(path: Path, text: str) -> None:
    """As the role writes it: a new file renamed over the old one."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def test_keys_come_from_the_keys_file_the_launcher_names(monkeypatch, tmp_path):
    keys_file = tmp_path / "api-keys"
    keys_file.write_text(f"{KEY}\n")
    monkeypatch.setenv("INFEROPS_VLLM_API_KEYS_FILE", str(keys_file))
    monkeypatch.setenv("VLLM_API_KEY", OTHER)  # not used when a keys file is named
    app = auth.InstanceKeyMiddleware  # as vLLM builds it: the class, given the app only
    assert call(app, "/tokenize", "POST", bearer(KEY))[0] == 200
    assert call(app, "/tokenize", "POST", bearer(OTHER))[0] == 401


def test_a_rotation_through_the_keys_file_needs_no_restart(tmp_path, caplog):
    """One FileKeys for the life of the process: accept-both, switch, drop-old are three writes of the file."""
    caplog.set_level("INFO", logger="inferops_vllm_auth")
    keys_file = tmp_path / "api-keys"
    keys_file.write_text(f"{OTHER}\n")
    keys = auth.FileKeys(str(keys_file))
    assert keys() == [OTHER.encode()]
    _replace(keys_file, f"# new first\n{KEY}\n\n  {OTHER}  \n{KEY}\n")
    assert keys() == [KEY.encode(), OTHER.encode()]
    assert auth.authorized([(b"authorization", f"Bearer {OTHER}".encode())], keys())
    _replace(keys_file, f"{KEY}\n")
    assert keys() == [KEY.encode()]
    assert not auth.authorized([(b"authorization", f"Bearer {OTHER}".encode())], keys())
    assert "1 key(s) accepted" in caplog.text


def test_the_same_length_rewrite_within_one_timestamp_is_seen(tmp_path):
    """A key of the same length written again: the rename gives the file a new inode, which is part of the stamp."""
    keys_file = tmp_path / "api-keys"
    keys_file.write_text(f"{KEY}\n")
    keys = auth.FileKeys(str(keys_file))
    assert keys() == [KEY.encode()]
    swapped = KEY[::-1]
    _replace(keys_file, f"{swapped}\n")
    assert keys() == [swapped.encode()]


@pytest.mark.parametrize("state", ["missing", "empty", "comments only"])
def test_a_missing_or_empty_keys_file_closes_every_route_but_health(tmp_path, caplog, state):
    keys_file = tmp_path / "api-keys"
    if state != "missing":
        keys_file.write_text("" if state == "empty" else "# nothing\n\n")
    keys = auth.FileKeys(str(keys_file))
    assert keys() == []

    def app(inner):
        middleware = auth.InstanceKeyMiddleware(inner, keys=[])
        middleware._keys = keys  # the file's keys, as with INFEROPS_VLLM_API_KEYS_FILE
        return middleware

    assert call(app, "/health")[0] == 200
    assert call(app, "/v1/models", "GET", bearer(KEY))[0] == 401
    assert "every route but /health is refused" in caplog.text
    # Written later (a repaired host): accepted from the next request on.
    _replace(keys_file, f"{KEY}\n")
    assert keys() == [KEY.encode()]
