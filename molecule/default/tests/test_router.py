"""Verify the router host: vllm-router behind the authenticating front, answering real clients
(the official openai package) with disaggregated prefill/decode, and keys enforced everywhere."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
from conftest import ROUTER, container_ip, metric_samples, secret

MODEL = "smollm2-135m-instruct"
PROMPT = "Question: what is the capital of France? Answer in one word. Answer: The capital of France is"


@pytest.fixture(scope="module")
def front_url():
    return f"http://{container_ip(ROUTER)}:8000"


@pytest.fixture(scope="module")
def client(front_url):
    return openai.OpenAI(base_url=f"{front_url}/v1", api_key=secret("client_api_key"), timeout=300, max_retries=0)


def status_of(url: str, headers: dict | None = None, body: dict | None = None) -> int:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_router_units_and_sockets(router_host):
    for unit in ("vllm-router", "nginx"):
        svc = router_host.service(unit)
        assert svc.is_running and svc.is_enabled, unit
    # vllm-router and its metrics only on loopback; the front on all addresses.
    assert router_host.socket("tcp://127.0.0.1:8300").is_listening
    assert not router_host.socket("tcp://0.0.0.0:8300").is_listening
    assert router_host.socket("tcp://127.0.0.1:29000").is_listening
    assert router_host.socket("tcp://0.0.0.0:8000").is_listening
    pid = router_host.check_output("systemctl show -p MainPID --value vllm-router")
    assert router_host.check_output(f"ps -o user= -p {pid}") == "vllm-router"
    # vllm-router renames its process (setproctitle): read the command line systemd runs.
    unit = router_host.file("/etc/systemd/system/vllm-router.service").content_string
    assert "--vllm-pd-disaggregation" in unit and "--kv-connector nixl" in unit
    assert unit.count("--prefill http://") == 1 and unit.count("--decode http://") == 1
    assert all(secret(name) not in unit for name in ("client_api_key", "instance_api_key"))
    assert "--api-key" not in unit


def test_secret_files_are_private(router_host, prefill_host):
    keys = router_host.file("/etc/nginx/inferops-vllm-keys.map")
    assert keys.user == "root" and keys.mode == 0o600
    env = router_host.file("/etc/vllm-router/router.env")
    assert env.user == "root" and env.group == "vllm-router" and env.mode == 0o640
    inst = prefill_host.file("/etc/vllm/prefill-0.env")
    assert inst.mode == 0o640 and f"VLLM_API_KEY={secret('instance_api_key')}" in inst.content_string


def test_front_refuses_requests_without_a_valid_key(front_url):
    body = {"model": MODEL, "prompt": "Hello there, how are you", "max_tokens": 2}
    assert status_of(f"{front_url}/v1/completions", body=body) == 401
    assert status_of(f"{front_url}/v1/completions", {"Authorization": "Bearer wrong-key-0123456789"}, body) == 401
    assert status_of(f"{front_url}/v1/models") == 401
    assert status_of(f"{front_url}/v1/models", {"Authorization": f"Bearer {secret('client_api_key')}"}) == 200
    # Load balancers may probe health without a key.
    assert status_of(f"{front_url}/health") == 200


def test_instances_refuse_direct_requests_without_their_key(prefill_url, decode_url):
    for url in (prefill_url, decode_url):
        assert status_of(f"{url}/v1/models") == 401
        assert status_of(f"{url}/v1/models", {"Authorization": f"Bearer {secret('client_api_key')}"}) == 401
        assert status_of(f"{url}/v1/models", {"Authorization": f"Bearer {secret('instance_api_key')}"}) == 200


def test_openai_client_through_the_router_is_disaggregated(client, prefill_url, decode_url):
    before_p = metric_samples(f"{prefill_url}/metrics")
    before_d = metric_samples(f"{decode_url}/metrics")

    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    assert "Paris" in completion.choices[0].text
    prompt_tokens = completion.usage.prompt_tokens

    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=True)
    streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert streamed == completion.choices[0].text

    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        max_tokens=8, temperature=0,
    )
    assert "Paris" in chat.choices[0].message.content
    chat_stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        max_tokens=8, temperature=0, stream=True,
    )
    streamed_chat = "".join((c.choices[0].delta.content or "") for c in chat_stream if c.choices)
    assert streamed_chat == chat.choices[0].message.content

    after_p = metric_samples(f"{prefill_url}/metrics")
    after_d = metric_samples(f"{decode_url}/metrics")
    src = "vllm:prompt_tokens_by_source_total"

    def delta(after, before, **labels):
        key = (src, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    external = delta(after_d, before_d, source="external_kv_transfer")
    # Four requests, each handed over: decode got at least the two completions' prompts by NIXL...
    assert external >= 2 * (prompt_tokens - 1), external
    # ...and computed almost none of the prompt tokens itself (at most one per request).
    assert delta(after_d, before_d, source="local_compute") <= 4
    # Prefill computed them.
    assert delta(after_p, before_p, source="local_compute") >= 2 * (prompt_tokens - 1)
    assert after_d.get(("vllm:nixl_num_failed_transfers_total", ()), 0.0) == 0.0
