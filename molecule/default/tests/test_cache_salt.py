"""Tenant isolation of the prefix cache (vllm_router_front_cache_salt_per_key, issue #25; molecule's router host
vars turn it on): through the front, a key hits the prefixes its own requests cached, on prefill and on decode,
and never another key's, not even by sending that key's salt itself. Four PD completions of ~330 prompt tokens:
~10-25 s on the sandbox (two of them compute the prompt, two read it from the cache)."""

from __future__ import annotations

import hashlib
import json
import os
import ssl
import urllib.request
import uuid

import pytest
from conftest import DECODE, container_ip, front_ca, instance_urls, metric_samples, secret

MODEL = "smollm2-135m-instruct"
HITS = "vllm:prefix_cache_hits_total"


def _complete(front_url: str, key: str, prompt: str, salt: str | None = None) -> int:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    req = urllib.request.Request(f"{front_url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    ca = front_ca()
    context = ssl.create_default_context(cafile=ca) if ca and front_url.startswith("https") else None
    with urllib.request.urlopen(req, timeout=300, context=context) as resp:
        return json.loads(resp.read())["usage"]["prompt_tokens"]


def _hits(urls: list[str]) -> float:
    """Prefix cache hits (tokens) summed over the instances."""
    return sum(v for url in urls for (name, _labels), v in metric_samples(f"{url}/metrics").items() if name == HITS)


@pytest.fixture(scope="module")
def salted(router_host):
    site = router_host.file("/etc/nginx/sites-available/inferops-vllm.conf").content_string
    on = "proxy_set_body $inferops_vllm_salted_body;" in site
    if os.environ.get("MOLECULE_EPHEMERAL_DIRECTORY"):
        assert on, "molecule/default/host_vars/molecule-router.yml turns vllm_router_front_cache_salt_per_key on"
    elif not on:
        pytest.skip("this deployment's front leaves cache_salt to the clients (vllm_router_front_cache_salt_per_key)")
    return on


def test_a_key_hits_only_its_own_cached_prefixes(salted, front_url, prefill_url, decode_host):
    prefill = [prefill_url]
    decode = list(instance_urls(decode_host, container_ip(DECODE)).values())
    key, other = secret("client_api_key"), secret("client_api_key_2")
    # A prefix no earlier request cached (the run's own id first), over two full KV blocks (128 tokens each on
    # the CPU build), within the sandbox's --max-model-len 512.
    prompt = (f"Run {uuid.uuid4().hex}. You are a careful assistant. "
              + " ".join(f"Rule {i}: answer briefly and politely about topic number {i}." for i in range(20))
              + " Question: what is two plus two?")

    def hits_of(k: str, salt: str | None = None) -> tuple[float, float, int]:
        before = _hits(prefill), _hits(decode)
        tokens = _complete(front_url, k, prompt, salt)
        return _hits(prefill) - before[0], _hits(decode) - before[1], tokens

    cold = hits_of(key)
    assert cold[0] == 0, f"a new prefix hit the prefill's cache: {cold}"
    assert cold[2] > 256, f"the prompt must span two KV blocks of 128 tokens: {cold[2]} tokens"
    warm = hits_of(key)
    # The same key again: prefill and decode both read the prompt's full blocks from their caches.
    assert warm[0] >= 128 and warm[1] >= 128, f"one key's second request should hit its cache: {warm}"
    # The other key, even sending the first key's salt itself (its key id; the front puts the second key's salt
    # first): no hit.
    first_key_salt = "inferops-k-" + hashlib.sha256(key.encode()).hexdigest()[:12]
    stolen = hits_of(other, salt=first_key_salt)
    assert stolen[0] == 0 and stolen[1] == 0, f"the second key hit the first key's cached prefix: {stolen}"
    # ... and its own cache works: that request cached the prompt under the second key's (and its own) salt.
    own = hits_of(other, salt=first_key_salt)
    assert own[0] >= 128 and own[1] >= 128, f"the second key's second request should hit its own cache: {own}"
