# Copyright (c) inferops.vllm contributors
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""An openai client configured from nothing but the settings.json of playbooks/client_config.yml and the
environment variable it names for the key.

Written beside settings.json by the inferops.vllm.vllm_client_config role. As a library:

    from client_from_settings import client_from_settings, load_settings
    client = client_from_settings("client-config/site/settings.json")       # key from os.environ
    settings = load_settings("client-config/site/settings.json")
    reply = client.chat.completions.create(model=settings["default_model"], messages=[...], max_tokens=16)

As a command (one chat through the front, the answer on stdout):

    export INFEROPS_API_KEY=<one of the front's client keys>
    python3 client_from_settings.py client-config/site/settings.json "Name the capital of France."

What it takes from settings.json: ``endpoints.local_vllm`` (else ``base_url`` + ``/v1``) as the OpenAI base URL,
the key from the environment variable ``api_key_env`` names, ``timeout_seconds``, ``max_retries``, and ``ca_file``
(relative to settings.json) as the only CA the TLS connection trusts when present. ``retry_backoff`` is for
clients with their own retries: the openai SDK backs off by itself and honours the front's Retry-After.
"""

from __future__ import annotations

import json
import os
import ssl
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REQUIRED = ("base_url", "api_key_env", "default_model", "timeout_seconds", "max_retries")


class SettingsError(ValueError):
    """settings.json or the environment cannot configure a client."""


def load_settings(path: str | os.PathLike[str]) -> dict[str, Any]:
    """settings.json as a dict, after checking that it has what a client needs."""
    try:
        settings = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SettingsError(f"{path}: cannot read the client settings: {exc}") from exc
    if not isinstance(settings, dict):
        raise SettingsError(f"{path}: is not a JSON object")
    missing = [key for key in REQUIRED if key not in settings]
    if missing:
        raise SettingsError(f"{path}: lacks {', '.join(missing)}; render it again with playbooks/client_config.yml")
    return settings


def api_base(settings: Mapping[str, Any]) -> str:
    """The OpenAI API base URL: endpoints.local_vllm, else base_url + /v1 (the sources' base_url has no /v1)."""
    endpoint = (settings.get("endpoints") or {}).get("local_vllm")
    return str(endpoint or f"{str(settings['base_url']).rstrip('/')}/v1")


def api_key(settings: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> str:
    """The client key, from the environment variable settings.json names (never from the file)."""
    name = str(settings["api_key_env"])
    value = (os.environ if environ is None else environ).get(name)
    if not value:
        raise SettingsError(f"the environment variable {name} (settings.json: api_key_env) is not set: "
                            f"export {name}=<one of the front's client keys>")
    return value


def ca_path(settings: Mapping[str, Any], settings_path: str | os.PathLike[str]) -> str | None:
    """The CA file that settings.json names, relative to its own directory; None for the system's CA store."""
    name = settings.get("ca_file")
    if not name:
        return None
    path = Path(name)
    if not path.is_absolute():
        path = Path(settings_path).resolve().parent / path
    if not path.is_file():
        raise SettingsError(f"settings.json names ca_file {name!r}, but {path} is not a file")
    return str(path)


def client_from_settings(path: str | os.PathLike[str], environ: Mapping[str, str] | None = None, **overrides: Any):
    """An ``openai.OpenAI`` client for the front, configured from settings.json and the key's environment variable.

    ``environ`` replaces ``os.environ`` as the place the key is read from; ``overrides`` go to ``openai.OpenAI``
    last (e.g. ``max_retries=0``).
    """
    import openai  # imported here: the rest of this file needs only the standard library

    settings = load_settings(path)
    kwargs: dict[str, Any] = {
        "base_url": api_base(settings),
        "api_key": api_key(settings, environ),
        "timeout": float(settings["timeout_seconds"]),
        "max_retries": int(settings["max_retries"]),
    }
    ca = ca_path(settings, path)
    if ca:
        kwargs["http_client"] = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=ca))
    kwargs.update(overrides)
    return openai.OpenAI(**kwargs)


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(f"usage: {Path(argv[0]).name} SETTINGS_JSON [PROMPT]", file=sys.stderr)
        return 2
    prompt = argv[2] if len(argv) == 3 else "Name the capital of France."
    try:
        settings = load_settings(argv[1])
        client = client_from_settings(argv[1])
    except SettingsError as exc:
        print(exc, file=sys.stderr)
        return 1
    reply = client.chat.completions.create(model=settings["default_model"], max_tokens=32,
                                           messages=[{"role": "user", "content": prompt}])
    print(reply.choices[0].message.content)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
