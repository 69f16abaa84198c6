"""playbooks/client_config.yml against the deployment: the openai client configured from nothing but the
rendered settings.json (and the key from the environment variable it names) completes a chat through the front."""

from __future__ import annotations

import json
import os
import stat
import sys

import pytest
from conftest import ROUTER, container_ip, deploy_playbook, front_ca, secret

EPHEMERAL = os.environ.get("MOLECULE_EPHEMERAL_DIRECTORY", "")
pytestmark = pytest.mark.skipif(not EPHEMERAL, reason="runs inside molecule only (its inventory)")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    out = tmp_path_factory.mktemp("client-config")
    run = deploy_playbook(os.path.join(EPHEMERAL, "inventory"), "client_config.yml",
                          "-e", f"vllm_client_config_dir={out}", "-e", f"inferops_front_ca_file={front_ca()}")
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    return out


def test_settings_name_the_front_over_tls_and_hold_no_key(rendered, router_host):
    settings = json.loads((rendered / "settings.json").read_text())
    assert settings["base_url"].startswith(f"https://{container_ip(ROUTER)}:")
    assert settings["default_model"] == "smollm2-135m-instruct"
    assert settings["api_key_env"] and settings["timeout_seconds"] > 0
    for path in rendered.iterdir():
        text = path.read_text(errors="replace")
        assert secret("client_api_key") not in text, path
        assert not path.stat().st_mode & stat.S_IWOTH


def test_openai_client_from_settings_alone_completes_a_chat(rendered):
    sys.path.insert(0, str(rendered))
    try:
        from client_from_settings import client_from_settings, load_settings
    finally:
        sys.path.remove(str(rendered))
    settings = load_settings(rendered / "settings.json")
    key = {settings["api_key_env"]: secret("client_api_key")}
    client = client_from_settings(rendered / "settings.json", environ=key)
    reply = client.chat.completions.create(model=settings["default_model"], max_tokens=8, temperature=0,
                                           messages=[{"role": "user", "content": "Name the capital of France."}])
    assert reply.choices[0].message.content
    assert reply.usage.completion_tokens > 0
