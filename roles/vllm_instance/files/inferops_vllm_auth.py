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
    * The keys are the instance's ``VLLM_API_KEY`` (the variable vLLM itself reads, which the
      launcher sets from the EnvironmentFile). Each is compared in constant time
      (``hmac.compare_digest``), against every key without stopping at the first match.
    * No key configured: every route but ``/health`` is refused (closed, never open) and vLLM's log
      says why once.
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
        self.keys = list(keys) if keys is not None else keys_from_environment()
        if not self.keys:
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
        if self.keys and authorized(scope.get("headers") or [], self.keys):
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
