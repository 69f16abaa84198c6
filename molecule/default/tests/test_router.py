"""Verify the router host: vllm-router behind the authenticating front, answering real clients
(the official openai package, over TLS checked against the scenario's CA) with disaggregated
prefill/decode, keys enforced exactly, admin routes unreachable, limits answered with 429."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import ssl
import time
import urllib.error
import urllib.request

import openai
import pytest
from conftest import DECODE, PREFILL, ROUTER, container_ip, front_ca, journal_tail, metric_samples, secret

MODEL = "smollm2-135m-instruct"
PROMPT = "Question: what is the capital of France? Answer in one word. Answer: The capital of France is"
# vllm-router's routes that must never reach clients (its admin API has no authentication).
ADMIN_ROUTES = [
    ("POST", "/remove_worker?url=http://127.0.0.1:1"),
    ("POST", "/add_worker?url=http://127.0.0.1:1"),
    ("GET", "/list_workers"),
    ("GET", "/workers"),
    ("GET", "/get_loads"),
    ("POST", "/flush_cache"),
    ("GET", "/readiness"),
    ("GET", "/liveness"),
    ("GET", "/metrics"),
    ("GET", "/get_server_info"),
    ("GET", "/v1/../workers"),
]


def _context() -> ssl.SSLContext | None:
    ca = front_ca()
    return ssl.create_default_context(cafile=ca) if ca else None


def request(url: str, headers: dict | None = None, body: dict | None = None, method: str | None = None):
    """(status, headers, body) of one request; errors are answers too."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120, context=_context() if url.startswith("https") else None) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def status_of(url: str, headers: dict | None = None, body: dict | None = None, method: str | None = None) -> int:
    return request(url, headers, body, method)[0]


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def client(front_url):
    ca = front_ca()
    http_client = openai.DefaultHttpxClient(verify=ca) if ca else None
    return openai.OpenAI(base_url=f"{front_url}/v1", api_key=secret("client_api_key"), timeout=300, max_retries=0,
                         http_client=http_client)


def test_router_units_and_sockets(router_host, prefill_url, decode_urls):
    # Two vllm-router replicas (the role's default) behind nginx.
    for unit in ("vllm-router@0", "vllm-router@1", "nginx"):
        svc = router_host.service(unit)
        assert svc.is_running and svc.is_enabled, unit
    assert not router_host.file("/etc/systemd/system/vllm-router.service").exists
    # vllm-router and its metrics only on loopback; the front on all addresses.
    for port in (8300, 8301, 29000, 29001):
        assert router_host.socket(f"tcp://127.0.0.1:{port}").is_listening, port
        assert not router_host.socket(f"tcp://0.0.0.0:{port}").is_listening, port
    assert router_host.socket("tcp://0.0.0.0:8000").is_listening
    # The nginx package's default site (a welcome page on port 80) is gone.
    assert not router_host.socket("tcp://0.0.0.0:80").is_listening
    for replica in (0, 1):
        pid = router_host.check_output(f"systemctl show -p MainPID --value vllm-router@{replica}")
        assert router_host.check_output(f"ps -o user= -p {pid}") == "vllm-router"
    # nginx knows both replicas and passes a request on to the next one when one refuses it.
    site = router_host.file("/etc/nginx/sites-available/inferops-vllm.conf").content_string
    assert "server 127.0.0.1:8300 max_fails=0;" in site and "server 127.0.0.1:8301 max_fails=0;" in site
    proxy = router_host.file("/etc/nginx/inferops-vllm-proxy.conf").content_string
    assert "proxy_next_upstream error http_500 http_502 http_503 non_idempotent;" in proxy
    # vllm-router renames its process (setproctitle): read the command line systemd runs.
    unit = router_host.file("/etc/systemd/system/vllm-router@.service").content_string
    assert "--vllm-pd-disaggregation" in unit and "--kv-connector nixl" in unit
    # Every instance of the inventory, each once: the prefill and both decode instances of converge.
    assert unit.count("--prefill http://") == 1 and f"--prefill {prefill_url} none" in unit
    assert unit.count("--decode http://") == len(decode_urls) == 2
    assert all(f"--decode {url} " in unit for url in decode_urls.values()), unit
    assert all(secret(name) not in unit for name in ("client_api_key", "instance_api_key"))
    assert "--api-key" not in unit


def test_secret_files_are_private(router_host, prefill_host):
    for path in ("/etc/nginx/inferops-vllm-keys.map", "/etc/nginx/inferops-vllm-proxy.conf"):
        f = router_host.file(path)
        assert f.user == "root" and f.mode == 0o600, path
    # The keys file holds ids and case-sensitive patterns, the site and its proxy file no client key.
    assert "~^Bearer " in router_host.file("/etc/nginx/inferops-vllm-keys.map").content_string
    site = router_host.file("/etc/nginx/sites-available/inferops-vllm.conf").content_string
    assert secret("client_api_key") not in site
    env = router_host.file("/etc/vllm-router/router.env")
    assert env.user == "root" and env.group == "vllm-router" and env.mode == 0o640
    # The instance key: in the keys file the instances' middleware reads (0640 root:vllm), not in their env files.
    keys = prefill_host.file("/etc/vllm/api-keys")
    assert keys.user == "root" and keys.group == "vllm" and keys.mode == 0o640
    assert [line for line in keys.content_string.splitlines() if line and not line.startswith("#")] == \
        [secret("instance_api_key")]
    assert secret("instance_api_key") not in prefill_host.file("/etc/vllm/prefill-0.env").content_string


def test_front_refuses_requests_without_a_valid_key(front_url):
    key = secret("client_api_key")
    body = {"model": MODEL, "prompt": "Hello there, how are you", "max_tokens": 2}
    assert status_of(f"{front_url}/v1/completions", body=body) == 401
    assert status_of(f"{front_url}/v1/completions", bearer("wrong-key-0123456789"), body) == 401
    assert status_of(f"{front_url}/v1/models") == 401
    assert status_of(f"{front_url}/v1/models", bearer(key)) == 200
    # Compared exactly: nginx matches plain map strings case-insensitively, the front must not.
    assert key.swapcase() != key
    assert status_of(f"{front_url}/v1/models", bearer(key.swapcase())) == 401
    flipped = next(i for i, c in enumerate(key) if c.isalpha())
    one_letter = key[:flipped] + key[flipped].swapcase() + key[flipped + 1:]
    assert status_of(f"{front_url}/v1/models", bearer(one_letter)) == 401
    assert status_of(f"{front_url}/v1/models", bearer(key + "x")) == 401
    assert status_of(f"{front_url}/v1/models", bearer(key[:-1])) == 401
    assert status_of(f"{front_url}/v1/models", {"Authorization": f"Bearer  {key}"}) == 401
    # A method the route does not serve.
    assert status_of(f"{front_url}/v1/completions", bearer(key)) == 405


@pytest.mark.parametrize(("method", "path"), ADMIN_ROUTES)
def test_front_hides_the_routers_admin_routes_whatever_the_key(front_url, method, path):
    for headers in (bearer(secret("client_api_key")), bearer(secret("instance_api_key")), {}):
        status, _headers, body = request(f"{front_url}{path}", headers, {} if method == "POST" else None, method)
        assert status == 404, (path, status, body[:200])
        assert b"worker" not in body.lower() and b"http://" not in body, body[:200]


def test_remove_worker_through_the_front_changes_nothing(router_host, front_url):
    decode = f"http://{container_ip(DECODE)}"
    request(f"{front_url}/remove_worker?url={decode}:8200", bearer(secret("client_api_key")), {}, "POST")
    # Every router replica (on loopback, where only the roles reach them; nginx spreads over both) still has
    # decode-0 and the prefill.
    for port in (8300, 8301):
        out = router_host.check_output("python3 -c %s", "import urllib.request;print(urllib.request.urlopen("
                                       f"'http://127.0.0.1:{port}/workers').read().decode())")
        urls = {w["url"] for w in json.loads(out)["workers"]}
        assert f"{decode}:8200" in urls and f"http://{container_ip(PREFILL)}:8100" in urls, (port, urls)


def test_health_for_load_balancers_reveals_nothing(front_url):
    status, headers, body = request(f"{front_url}/health")
    assert status == 200, body
    lowered = {k.lower(): v for k, v in headers.items()}
    assert "x-request-id" not in lowered and "nginx/" not in lowered.get("server", "")
    assert b"http" not in body and b"prefill" not in body and b"decode" not in body and len(body) < 64, body
    assert status_of(f"{front_url}/health", method="POST", body={}) == 405


def test_front_answers_429_over_the_rate_limit_per_key(router_host, front_url):
    """One key's burst over its limit gets 429s; another key's few requests sent among them all pass: the limit is
    per key (a shared limit would refuse some of them)."""
    key, other = secret("client_api_key"), secret("client_api_key_2")
    site = router_host.file("/etc/nginx/sites-available/inferops-vllm.conf").content_string
    rate = int(site.split("rate=", 1)[1].split("r/s", 1)[0])
    burst = int(site.split("burst=", 1)[1].split()[0])
    attempts = 3 * (rate + burst) + 10
    others = list(range(0, attempts, attempts // max(1, burst // 2)))[:max(1, burst // 2)]
    keys = [other if n in others else key for n in range(attempts)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda k: request(f"{front_url}/v1/models", bearer(k)), keys))
    codes = [a[0] for a, k in zip(answers, keys, strict=True) if k == key]
    assert codes.count(429) > 0 and codes.count(200) > 0, codes
    assert set(codes) <= {200, 429}, codes
    assert [a[0] for a, k in zip(answers, keys, strict=True) if k == other] == [200] * len(others), answers
    limited = next(a for a in answers if a[0] == 429)
    assert {k.lower(): v for k, v in limited[1].items()}.get("retry-after") == "1"
    assert b"rate_limit" in limited[2]
    # The key's bucket refills at `rate` per second: the next tests (the same key, no retries) must not meet
    # the burst's tail. A refill that never comes fails here, by name, rather than in an unrelated test.
    assert _refilled(front_url, key, rate, burst, deadline=time.monotonic() + 3 * (burst / rate + 2)), \
        "the key stayed limited"


def _refilled(front_url: str, key: str, rate: int, burst: int, deadline: float) -> bool:
    """True once the key's bucket is whole again: after burst / rate seconds (+ 1) without a request of that key, one
    request passes. Probing with several requests would spend what it measures: the earlier probe (5 in a row
    answered 200) left nginx's bucket full again (limit_req counts each passed request), and the next test's first
    request got 429 (the fresh-clone run of 2026-12-02)."""
    while time.monotonic() < deadline:
        time.sleep(burst / rate + 1)
        if status_of(f"{front_url}/v1/models", bearer(key)) == 200:
            return True
    return False


def test_front_speaks_tls_only_and_verifiably(front_url):
    ca = front_ca()
    if not ca:
        pytest.skip("plain HTTP front (up.sh's sandbox, vllm_router_front_allow_plaintext); molecule tests TLS")
    host = container_ip(ROUTER)
    # Plain HTTP on the TLS port is refused, not served or redirected.
    status, _headers, body = request(f"http://{host}:8000/v1/models", bearer(secret("client_api_key")))
    assert status == 400 and b"https" in body, (status, body)
    # The certificate verifies against the scenario's CA, and only against it.
    with socket.create_connection((host, 8000), timeout=10) as raw:
        with ssl.create_default_context(cafile=ca).wrap_socket(raw, server_hostname=host) as tls:
            assert tls.version() in ("TLSv1.2", "TLSv1.3")
    with pytest.raises(ssl.SSLCertVerificationError):
        with socket.create_connection((host, 8000), timeout=10) as raw:
            ssl.create_default_context().wrap_socket(raw, server_hostname=host)


def test_prompts_stay_out_of_the_logs(router_host, client):
    marker = f"inferops-marker-{int(time.time())}"
    client.completions.create(model=MODEL, prompt=f"{marker} tells a story about", max_tokens=2, temperature=0)
    messages = [{"role": "user", "content": f"{marker} says hello"}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    journal = router_host.run("journalctl -u 'vllm-router@*' -u nginx --no-pager -o cat").stdout
    logs = router_host.run("cat /var/log/nginx/inferops-vllm.access.log /var/log/nginx/inferops-vllm.error.log").stdout
    assert marker not in journal, journal_tail(router_host, "vllm-router@0")
    assert marker not in logs
    for name in ("client_api_key", "instance_api_key"):
        assert secret(name) not in journal and secret(name) not in logs, name


def test_instances_refuse_direct_requests_without_their_key(prefill_url, decode_urls):
    for url in (prefill_url, *decode_urls.values()):
        assert status_of(f"{url}/v1/models") == 401
        assert status_of(f"{url}/v1/models", {"Authorization": f"Bearer {secret('client_api_key')}"}) == 401
        assert status_of(f"{url}/v1/models", {"Authorization": f"Bearer {secret('instance_api_key')}"}) == 200


def decode_samples(decode_urls) -> dict:
    """The decode pool's samples, summed over its instances (the router may pick any of them)."""
    out: dict = {}
    for url in decode_urls.values():
        for key, value in metric_samples(f"{url}/metrics").items():
            out[key] = out.get(key, 0.0) + value
    return out


def test_openai_client_through_the_router_is_disaggregated(client, prefill_url, decode_urls):
    before_p = metric_samples(f"{prefill_url}/metrics")
    before_d = decode_samples(decode_urls)

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
    after_d = decode_samples(decode_urls)
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
