# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The instance key on every route of a vLLM instance except ``/health`` (inferops.vllm, issue #25).

vLLM 0.32's own ``--api-key`` guards only paths under ``/v1``, ``/v2``, ``/inference`` and ``/cohere``:
``/invocations`` (completions and chat), ``/tokenize``, ``/detokenize``, ``/pooling``, ``/metrics``,
``/openapi.json``, ``/version``, ... answer without a key. The launcher (inferops_vllm_launch.py, beside
this file) passes ``--middleware inferops_vllm_auth.InstanceKeyMiddleware`` and puts this directory on
vLLM's ``PYTHONPATH`` whenever the instance has a key. vLLM adds the class with
``app.add_middleware(cls)``, so it is the outermost layer and sees every request before any route,
mount (``/metrics``) or vLLM's own middleware.

Rules
    * ``GET``/``HEAD /health`` passes without a key (load balancers, vllm-router's health checks,
      systemd waits); everything else, of every method (``OPTIONS`` too: nothing browses an
      instance), needs ``Authorization: Bearer <key>``.
    * The keys: the file ``INFEROPS_VLLM_API_KEYS_FILE`` names (one key a line; the launcher sets it from
      ``server.api_keys_file``, which the vllm_instance role writes), re-read whenever it changes, so a key
      rotation needs no restart: the role adds the new key beside the one the routers still present,
      switches the routers, then drops the old one. Without that variable, the instance's ``VLLM_API_KEY``
      (the variable vLLM itself reads). Each is compared in constant time (``hmac.compare_digest``),
      against every key without stopping at the first match.
    * No key configured, or a keys file that is missing, unreadable or empty: every route but ``/health``
      is refused (closed, never open) and vLLM's log says why once per change.
    * A refused HTTP request gets 401 with ``WWW-Authenticate: Bearer`` and a fixed JSON body; a
      refused websocket is closed before it is accepted (the server answers the handshake 403).
      Lifespan events pass.

Standard library only: the class is a plain ASGI middleware, so it runs in any ASGI app (vLLM's
FastAPI app, a Starlette test app, a bare callable).
"""

from __future__ import annotations

import hmac
import json
import logging
import os

KEY_VARIABLE = "VLLM_API_KEY"
KEYS_FILE_VARIABLE = "INFEROPS_VLLM_API_KEYS_FILE"
OPEN_PATHS = frozenset({"/health"})
OPEN_METHODS = frozenset({"GET", "HEAD"})
_UNAUTHORIZED = json.dumps(
    {"error": {"message": "missing or invalid API key", "type": "invalid_request_error", "code": "invalid_api_key"}},
    separators=(",", ":"),
).encode()
# RFC 1008 policy violation: the closest websocket close code to "unauthorized".
_WS_POLICY_VIOLATION = 1008

_log = logging.getLogger("inferops_vllm_auth")


def keys_from_environment(environ=None) -> list[bytes]:
    """The keys an instance accepts: its VLLM_API_KEY (empty or unset: none)."""
    value = (os.environ if environ is None else environ).get(KEY_VARIABLE, "")
    return [value.encode()] if value else []


def parse_keys(data: bytes) -> list[bytes]:
    """The keys of a keys file: one a line, surrounding white space and blank or ``#`` lines ignored."""
    keys = []
    for line in data.splitlines():
        line = line.strip()
        if line and not line.startswith(b"#") and line not in keys:
            keys.append(line)
    return keys


class FileKeys:
    """The keys of a file, read again whenever its identity, size or modification time changes (the role
    replaces it by a rename: a request sees the old or the new list, never a half-written one). A missing,
    unreadable or empty file means no key: every route but /health is refused."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp = None
        self._keys: list[bytes] = []

    def __call__(self) -> list[bytes]:
        try:
            st = os.stat(self.path)
            stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError as exc:
            stamp = ("missing", str(exc))
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                with open(self.path, "rb") as f:
                    self._keys = parse_keys(f.read())
            except OSError as exc:
                self._keys = []
                _log.error("inferops_vllm_auth: cannot read the keys file %s (%s): every route but /health is "
                           "refused (401) until it can be read.", self.path, exc.strerror or exc)
                return self._keys
            if not self._keys:
                _log.error("inferops_vllm_auth: the keys file %s holds no key: every route but /health is refused "
                           "(401).", self.path)
            else:
                _log.info("inferops_vllm_auth: %d key(s) accepted, from %s.", len(self._keys), self.path)
        return self._keys


def _bearer(headers) -> bytes | None:
    """The token of the request's single ``Authorization: Bearer`` header, or None."""
    values = [value for name, value in headers if name.lower() == b"authorization"]
    if len(values) != 1:
        return None
    scheme, _sep, token = values[0].strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    token = token.strip()
    return token or None


def authorized(headers, keys) -> bool:
    """Whether ``headers`` (ASGI: (name, value) byte pairs) carry one of ``keys``, compared in constant time."""
    token = _bearer(headers)
    if token is None:
        return False
    ok = False
    for key in keys:
        # No short circuit: the time does not tell which key, or whether an earlier one, matched.
        ok = hmac.compare_digest(token, key) | ok
    return ok


class InstanceKeyMiddleware:
    """ASGI middleware: the instance key on every HTTP and websocket route but ``GET``/``HEAD /health``."""

    def __init__(self, app, keys=None) -> None:
        self.app = app
        keys_file = os.environ.get(KEYS_FILE_VARIABLE, "") if keys is None else ""
        if keys_file:
            # Re-read at a request when the file changed: a rotation needs no restart.
            self._keys = FileKeys(keys_file)
            self._keys()  # read now: its log line says at start how many keys it holds
            return
        fixed = list(keys) if keys is not None else keys_from_environment()
        self._keys = lambda: fixed
        if not fixed:
            _log.error(
                "inferops_vllm_auth: %s is empty or unset: every route but /health is refused (401). Set the "
                "instance key (vllm_instance_api_key) or remove --middleware inferops_vllm_auth.InstanceKeyMiddleware.",
                KEY_VARIABLE,
            )

    @staticmethod
    def is_open(scope) -> bool:
        return (
            scope["type"] == "http"
            and scope.get("path") in OPEN_PATHS
            and scope.get("method", "GET").upper() in OPEN_METHODS
        )

    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or self.is_open(scope):
            await self.app(scope, receive, send)
            return
        keys = self._keys()
        if keys and authorized(scope.get("headers") or [], keys):
            await self.app(scope, receive, send)
            return
        if kind == "websocket":
            await send({"type": "websocket.close", "code": _WS_POLICY_VIOLATION})
            return
        await send({
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(_UNAUTHORIZED)).encode()),
                (b"www-authenticate", b'Bearer realm="inferops-vllm-instance"'),
            ],
        })
        await send({"type": "http.response.body", "body": _UNAUTHORIZED})
