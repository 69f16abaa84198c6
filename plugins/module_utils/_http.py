# Copyright (c) inferops.vllm contributors
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""HTTP for the collection's modules that send many requests in one run: one TLS context per run.

PRIVATE to the inferops.vllm collection: no compatibility promise; anything here may change or go in
any release. Other collections must not import it.

Why
    ``ansible.module_utils.urls`` builds a new TLS context for every request made without one
    (``make_context``: ``ssl.create_default_context()`` and the system's CA store read again), also for
    plain ``http://`` URLs, where it is never used. That costs ~25-30 ms of CPU per request (measured
    with ansible-core 2.19: 30 ms for an ``open_url`` of a loopback ``http://`` URL against 1 ms for
    ``urllib`` alone). The verification (vllm_health) sends ~30 requests per run, the instance wait
    polls every 2 s: with ``shared_context`` the context is built once per run and settings.

What
    ``shared_context(validate_certs, ca_path)``: the context ``open_url`` would build, made once.
    ``open_shared(url, ...)``: ``open_url`` with it (``open_url`` itself takes no context; ``Request.open`` does).
    ``fetch(...)``: ``fetch_url``'s ``(response, info)`` for the parts the modules read (``status``,
    ``msg``, ``body`` of an HTTP error), through ``open_shared``. Unlike ``fetch_url`` it never
    ends the module: a URL that ``open_url`` rejects is a failed request (status -1)
    that the module reports with its other problems.
"""

from __future__ import annotations

import http.client
import urllib.error

from ansible.module_utils.urls import Request, make_context

_CONTEXTS: dict = {}


def shared_context(validate_certs=True, ca_path=None):
    """The TLS context of these settings, built on first use and kept for the module run."""
    key = (bool(validate_certs), ca_path or None)
    if key not in _CONTEXTS:
        _CONTEXTS[key] = make_context(cafile=ca_path or None, validate_certs=bool(validate_certs))
    return _CONTEXTS[key]


def open_shared(url, method="GET", validate_certs=True, ca_path=None, **kwargs):
    """``open_url(url, method=..., ...)`` with the shared TLS context of ``validate_certs`` and ``ca_path``."""
    return Request().open(method, url, validate_certs=validate_certs, ca_path=ca_path,
                          context=shared_context(validate_certs, ca_path), **kwargs)


def fetch(url, data=None, headers=None, method="GET", timeout=10, validate_certs=True, ca_path=None,
          use_proxy=True, http_agent="ansible-httpget"):
    """(response, info) as ``fetch_url`` returns them: the response on success (the caller closes it), else
    None; ``info`` has ``status`` (-1 when no HTTP answer came), ``msg`` and, for an HTTP error, ``body``."""
    info = {"url": url, "status": -1}
    try:
        resp = open_shared(url, method=method, validate_certs=validate_certs, ca_path=ca_path, data=data,
                           headers=headers, timeout=timeout, use_proxy=use_proxy, http_agent=http_agent)
    except urllib.error.HTTPError as exc:
        body = b""
        try:
            if exc.fp is not None:
                body = exc.read()
        except (OSError, http.client.HTTPException, AttributeError):
            pass
        finally:
            exc.close()
        info.update(status=exc.code, msg=str(exc), body=body)
        return None, info
    except urllib.error.URLError as exc:
        info.update(status=int(getattr(exc, "code", -1) or -1), msg=f"Request failed: {exc}")
        return None, info
    except (OSError, http.client.HTTPException, ValueError) as exc:
        info.update(msg=f"Connection failure: {exc}")
        return None, info
    info.update(status=resp.getcode(), msg="OK")
    return resp, info
