"""Tenant isolation of the prefix cache (vllm_router_front_cache_salt_per_key, issue #25; molecule's router host
vars turn it on): through the front, a key hits the prefixes its own requests cached, on prefill and on decode,
and never another key's, not even by sending that key's salt itself. Five PD completions of ~330 prompt tokens:
~12-30 s on the sandbox (three of them compute the prompt, two read it from the cache)."""

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
QUERIES = "vllm:prefix_cache_queries_total"


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


def _counts(url: str) -> tuple[float, float]:
    """(prefix cache hits, queries) of one instance, in tokens."""
    samples = metric_samples(f"{url}/metrics")
    return (sum(v for (name, _labels), v in samples.items() if name == HITS),
            sum(v for (name, _labels), v in samples.items() if name == QUERIES))


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
    # One prefill; converge gives the decode host two instances, and two router replicas may pick either.
    urls = {"prefill": prefill_url, **instance_urls(decode_host, container_ip(DECODE))}
    key, other = secret("client_api_key"), secret("client_api_key_2")
    # A prefix no earlier request cached (the run's own id first), over two full KV blocks (128 tokens each on
    # the CPU build), within the sandbox's --max-model-len 512.
    prompt = (f"Run {uuid.uuid4().hex}. You are a careful assistant. "
              + " ".join(f"Rule {i}: answer briefly and politely about topic number {i}." for i in range(20))
              + " Question: what is two plus two?")
    served: dict[str, set[str]] = {}  # decode instances that computed or received the prompt, per salt owner

    def hits_of(k: str, owner: str, salt: str | None = None) -> dict[str, float]:
        """Per instance that served the request: its prefix cache hits (tokens); and the prompt's length."""
        before = {name: _counts(url) for name, url in urls.items()}
        tokens = _complete(front_url, k, prompt, salt)
        after = {name: _counts(url) for name, url in urls.items()}
        hits = {name: after[name][0] - before[name][0] for name in urls if after[name][1] > before[name][1]}
        assert "prefill" in hits and len(hits) == 2, f"one prefill and one decode should have served it: {hits}"
        decode = next(name for name in hits if name != "prefill")
        hits["decode_had_it"] = decode in served.get(owner, set())
        hits["decode"] = hits[decode]
        served.setdefault(owner, set()).add(decode)
        hits["tokens"] = tokens
        return hits

    cold = hits_of(key, "first")
    assert cold["prefill"] == 0 and cold["decode"] == 0, f"a new prefix hit a cache: {cold}"
    assert cold["tokens"] > 256, f"the prompt must span two KV blocks of 128 tokens: {cold}"
    warm = hits_of(key, "first")
    # The same key again: prefill reads the prompt's full blocks from its cache, and so does decode if the
    # same decode instance got it the first time.
    assert warm["prefill"] >= 128, f"one key's second request should hit the prefill's cache: {warm}"
    assert warm["decode"] >= 128 or not warm["decode_had_it"], f"... and that decode instance's: {warm}"
    # The other key: no hit anywhere (a front that set no salt, or the same for every key, fails here) ...
    plain = hits_of(other, "second-plain")
    assert plain["prefill"] == 0 and plain["decode"] == 0, f"the second key hit the first key's prefix: {plain}"
    # ... not even sending the first key's salt itself (its key id; the front puts the second key's salt first).
    first_key_salt = "inferops-k-" + hashlib.sha256(key.encode()).hexdigest()[:12]
    stolen = hits_of(other, "second", salt=first_key_salt)
    assert stolen["prefill"] == 0 and stolen["decode"] == 0, f"the second key hit the first key's prefix: {stolen}"
    # ... and its own cache works: that request cached the prompt under the second key's (and its own) salt.
    own = hits_of(other, "second", salt=first_key_salt)
    assert own["prefill"] >= 128, f"the second key's second request should hit its own cache: {own}"
    assert own["decode"] >= 128 or not own["decode_had_it"], f"... and that decode instance's: {own}"
