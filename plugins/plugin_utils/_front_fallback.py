# Copyright (c) inferops.vllm contributors
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The rules of the front's fallback endpoints (vllm_router_front_fallbacks), one place for all of them.

PRIVATE to the inferops.vllm collection: no compatibility promise; anything here may change or go in
any release. Other collections must not import it.

The PD preflight (plugins/plugin_utils/_preflight.py, check ``fallbacks``) runs them on the controller
before any host is changed; the vllm_router role's own preflight runs the same function through the
``inferops.vllm.front_fallback_problems`` filter when the role runs on its own. Each problem is
``(variable, what, fix)``; no key is ever part of one.

What each rule protects: the endpoint's name becomes a metric label and file name; its URL is where
prompts and the key go (https, or http to loopback only unless allowed on purpose); its key and its
model names are written into nginx strings (a quote or a newline would break or inject); the model map
must cover every served model name, or a client's request would reach the cloud under our name.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

VARIABLE = "vllm_router_front_fallbacks"
NAME_RE = re.compile(r"[a-z0-9-]{1,32}")
KEY_RE = re.compile(r"[A-Za-z0-9._~+/=-]{16,}")
KEY_RULE = "16 or more characters of A-Z a-z 0-9 . _ ~ + / = - (RFC 6750 bearer token characters)"
MODEL_RE = re.compile(r"[A-Za-z0-9._:/@+-]{1,200}")
HOST_RE = re.compile(r"[A-Za-z0-9.-]{1,253}")
PATH_RE = re.compile(r"(/[A-Za-z0-9._~-]*)*")
SIZE_RE = re.compile(r"[0-9]+[kKmMgG]?")
KNOWN = {"name", "url", "api_key", "models", "connect_timeout", "read_timeout", "ca_file", "allow_plaintext",
         "requests_per_minute", "max_tokens"}
# The cost controls of an endpoint (issue #25): its budget of requests per minute and its cap on a request's
# max_tokens (times n); 0 turns one off. The role's template applies the same defaults.
BUDGET_DEFAULTS = {"requests_per_minute": 60, "max_tokens": 4096}


def size_bytes(value: Any) -> int | None:
    """nginx's size syntax (64m, 512k, 1g, 1024) in bytes; None when it is not one."""
    text = str(value).strip()
    if not SIZE_RE.fullmatch(text):
        return None
    units = {"k": 1024, "m": 1024**2, "g": 1024**3}
    unit = text[-1].lower()
    return int(text[:-1]) * units[unit] if unit in units else int(text)


def loopback(host: str) -> bool:
    """A loopback IP literal. A name, localhost included, is not: nginx resolves an endpoint's name through DNS
    at each request (its resolver), and an answer other than loopback would send clear text off the host."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _whole(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None


def _endpoint(index: int, fb: Any, served: list[str], names: dict[str, int]) -> list[tuple[str, str, str]]:
    var = f"{VARIABLE}[{index}]"
    if not isinstance(fb, Mapping):
        return [(var, f"is {type(fb).__name__}, not a mapping.",
                 "write each endpoint as {name, url, api_key, models} (see the role's defaults).")]
    out = []
    unknown = sorted(set(map(str, fb)) - KNOWN)
    if unknown:
        out.append((var, f"has unknown keys {', '.join(unknown)}.", f"use only {', '.join(sorted(KNOWN))}."))
    name = fb.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        out.append((f"{var}.name", f"is {name!r}, not 1 to 32 characters of a-z 0-9 - (it becomes a metric label "
                    "and a file name).", "name the endpoint, for example openai."))
    elif name in names:
        out.append((f"{var}.name", f"{name!r} is also the name of {VARIABLE}[{names[name]}].",
                    "give every endpoint its own name."))
    elif name == "none":
        out.append((f"{var}.name", "'none' is the counter's label for requests no endpoint served.",
                    "choose another name."))
    else:
        names[name] = index
    out.extend(_url(var, fb))
    key = fb.get("api_key")
    if key is None or key == "":
        out.append((f"{var}.api_key", "is missing: the endpoint would be called without a key.",
                    "set api_key to the endpoint's key, from a vaulted variable such as vault_openai_api_key."))
    elif not isinstance(key, str) or not KEY_RE.fullmatch(key):
        out.append((f"{var}.api_key", f"is not a usable key (not shown): it must be {KEY_RULE}; it is written into "
                    "an nginx string, where other characters would break or inject into it.",
                    "check the vaulted value (no quotes, spaces or newline)."))
    out.extend(_models(var, fb.get("models"), served))
    for field, default in (("connect_timeout", 5), ("read_timeout", 300)):
        value = fb.get(field, default)
        if _whole(value) is None or _whole(value) < 1:
            out.append((f"{var}.{field}", f"is {value!r}, not a whole number of seconds of 1 or more.",
                        f"set a number of seconds (default {default})."))
    for field, default in BUDGET_DEFAULTS.items():
        value = fb.get(field, default)
        if _whole(value) is None or _whole(value) < 0:
            out.append((f"{var}.{field}", f"is {value!r}, not a whole number of 0 or more.",
                        f"set the endpoint's budget (default {default}; 0 = no limit, the cloud key spent unbounded)."))
    ca_file = fb.get("ca_file", "")
    if ca_file and (not isinstance(ca_file, str) or not re.fullmatch(r"/[A-Za-z0-9._/-]+", ca_file)):
        out.append((f"{var}.ca_file", f"is {ca_file!r}, not an absolute path on the router host.",
                    "give the PEM file's path, or leave it empty for the system's CAs."))
    if not isinstance(fb.get("allow_plaintext", False), bool):
        out.append((f"{var}.allow_plaintext", f"is {fb.get('allow_plaintext')!r}, not a boolean.",
                    "write true or false without quotes."))
    return out


def _url(var: str, fb: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    url = fb.get("url")
    fix = "give the API's base URL, for example https://api.openai.com/v1."
    if not isinstance(url, str) or not url:
        return [(f"{var}.url", "is missing.", fix)]
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return [(f"{var}.url", f"{url!r} is no URL ({exc}).", fix)]
    host = parts.hostname or ""
    if parts.scheme not in ("https", "http") or not host:
        return [(f"{var}.url", f"{url!r} is not an http(s) URL with a host.", fix)]
    out = []
    if parts.username or parts.password or parts.query or parts.fragment:
        out.append((f"{var}.url", f"{url!r} carries a user, password, query or fragment.",
                    "give the plain base URL; the key goes in api_key."))
    bracketed = parts.netloc.rsplit("@", 1)[-1].startswith("[")
    if not (bracketed or HOST_RE.fullmatch(host)) or not PATH_RE.fullmatch(parts.path or ""):
        out.append((f"{var}.url", f"{url!r} has characters nginx's configuration cannot take in its host or path.",
                    "use a host name or address and a path of A-Z a-z 0-9 . _ ~ - /."))
    if port == 0:
        out.append((f"{var}.url", f"{url!r} has port 0.", fix))
    if parts.scheme == "http" and not loopback(host) and fb.get("allow_plaintext") is not True:
        try:
            ipaddress.ip_address(host)
            where = f"{host}, beyond this host"
        except ValueError:
            where = (f"{host}, a name nginx resolves through DNS at each request (only a loopback IP address is sure "
                     "to stay on this host)")
        out.append((f"{var}.url", f"is plain HTTP to {where}: prompts, answers and the endpoint's "
                    "key would cross the network in clear text.",
                    "use https://, or set allow_plaintext: true on this endpoint to accept clear text on purpose."))
    return out


def _models(var: str, models: Any, served: list[str]) -> list[tuple[str, str, str]]:
    if not isinstance(models, Mapping) or not models:
        return [(f"{var}.models", "is missing or not a mapping of our served model names to the endpoint's.",
                 "map every served model name, e.g. models: {" + (served[0] if served else "qwen2.5-7b-instruct")
                 + ": gpt-4o-mini}.")]
    out = []
    bad = sorted(str(k) for k, v in models.items()
                 if not (isinstance(k, str) and MODEL_RE.fullmatch(k) and isinstance(v, str) and MODEL_RE.fullmatch(v)))
    if bad:
        out.append((f"{var}.models", f"has names nginx's configuration cannot take: {', '.join(bad)}.",
                    "use model names of A-Z a-z 0-9 . _ : / @ + -."))
    missing = [name for name in served if name not in models]
    if missing:
        out.append((f"{var}.models", f"does not map the served model name{'s' if len(missing) > 1 else ''} "
                    f"{', '.join(missing)}: a request for {'them' if len(missing) > 1 else 'it'} would reach the "
                    "endpoint under our name.", "add each served model name with the endpoint's model for it."))
    return out


def redact(fallbacks: Any) -> Any:
    """The fallbacks with each key replaced by a stand-in that passes or fails the key rule as the key
    does, so nothing downstream (reports, exceptions) holds a key."""
    if not isinstance(fallbacks, (list, tuple)):
        return fallbacks
    out = []
    for fb in fallbacks:
        if isinstance(fb, Mapping) and "api_key" in fb:
            key = fb.get("api_key")
            stand_in = "" if key is None or key == "" else (
                "k" * 16 if isinstance(key, str) and KEY_RE.fullmatch(key) else "(not a usable key)")
            fb = {**fb, "api_key": stand_in}
        out.append(fb)
    return out


def problems(fallbacks: Any, served: Iterable[str] = (), settings: Mapping[str, Any] | None = None
             ) -> list[tuple[str, str, str]]:
    """(variable, what, fix) for every problem of the fallback settings.

    ``served``: the instances' served model names; ``settings``: the other vllm_router_front_fallback_*
    values and vllm_router_front_max_body_size (missing ones are the role's defaults)."""
    settings = dict(settings or {})
    served = sorted({str(s) for s in served if s})
    if fallbacks is None:
        fallbacks = []
    if not isinstance(fallbacks, (list, tuple)):
        return [(VARIABLE, f"is {type(fallbacks).__name__}, not a list of endpoints.",
                 "write it as a YAML list of {name, url, api_key, models}, or [] for none.")]
    out: list[tuple[str, str, str]] = []
    names: dict[str, int] = {}
    for index, fb in enumerate(fallbacks):
        out.extend(_endpoint(index, fb, served, names))
    if not fallbacks:
        return out
    first_byte = settings.get("first_byte_timeout", 0)
    if _whole(first_byte) is None:
        out.append(("vllm_router_front_fallback_first_byte_timeout", f"is {first_byte!r}, not a whole number of "
                    "seconds.", "set 0 (no timeout-driven fallback) or a number of seconds."))
    on_limit = settings.get("on_rate_limit", True)
    if not isinstance(on_limit, bool):
        out.append(("vllm_router_front_fallback_on_rate_limit", f"is {on_limit!r}, not a boolean.",
                    "write true or false without quotes."))
    fb_size, front_size = settings.get("max_body_size", "8m"), settings.get("front_max_body_size", "64m")
    fb_body, front_body = size_bytes(fb_size), size_bytes(front_size)
    if fb_body is None or fb_body < 1:
        out.append(("vllm_router_front_fallback_max_body_size", f"is {fb_size!r}, not a size "
                    "like 8m.", "set a size such as 8m."))
    elif front_body is not None and fb_body > front_body:
        out.append(("vllm_router_front_fallback_max_body_size",
                    f"({fb_size}) is larger than vllm_router_front_max_body_size ({front_size}), which the "
                    "front refuses first.",
                    "keep it at most vllm_router_front_max_body_size."))
    return out
