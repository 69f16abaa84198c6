"""Verify what the deployment exposes: the units' sandboxing as systemd scores it, no key in the
output of a `--check --diff` run that changes every key, every route of the running vLLM behind the
instance key (but /health), Prometheus scraping with it (issue #25)."""

from __future__ import annotations

import json
import os
import re
import secrets
import ssl
import subprocess
import urllib.error
import urllib.request

import pytest
from conftest import DECODE, PREFILL, ROUTER, container_ip, front_ca, instance_auth, secret, task_blocks, task_result

# `systemd-analyze security` exposure bounds (0 = locked down, 10 = everything allowed).
BOUNDS = [
    (PREFILL, "vllm@prefill-0.service", 2.0),
    (DECODE, "vllm@decode-0.service", 2.0),
    (PREFILL, "inferops-vllm-firewall.service", 2.0),
    (DECODE, "inferops-vllm-firewall.service", 2.0),
    (ROUTER, "vllm-router@0.service", 2.0),
    # The distribution's nginx (9.6 without our drop-in): its master keeps root to bind and drop privileges.
    (ROUTER, "nginx.service", 5.0),
]


@pytest.mark.parametrize(("container", "unit", "bound"), BOUNDS)
def test_unit_exposure_is_under_its_bound(request, container, unit, bound):
    host = request.getfixturevalue({PREFILL: "prefill_host", DECODE: "decode_host", ROUTER: "router_host"}[container])
    assert host.service(unit).is_running or host.service(unit).is_enabled, unit
    out = host.check_output(f"systemd-analyze security --no-pager {unit}")
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out)
    assert match, out[-500:]
    assert float(match.group(1)) <= bound, f"{unit} on {container}: {match.group(1)} > {bound}\n" + "\n".join(
        line for line in out.splitlines() if line.startswith("✗")
    )


# The instance role's task that writes the keys file.
INSTANCE_KEYS_TASK = ("vllm_instance : Accept the instance key (first, beside the keys accepted now while a rotation "
                      "runs)")


def test_a_check_diff_run_that_changes_every_key_shows_none(router_host):
    """deploy_pd.yml in check mode with --diff and new keys: the files that carry keys would change, and
    neither the old nor the new keys may appear in the output."""
    project = os.environ.get("MOLECULE_PROJECT_DIRECTORY")
    inventory = os.environ.get("MOLECULE_INVENTORY_FILE")
    if not (project and inventory):
        pytest.skip("runs inside molecule only (needs its inventory)")
    new_instance_key = "inst" + secrets.token_hex(16)
    new_client_key = "client" + secrets.token_hex(16)
    env = dict(os.environ)
    ephemeral_cfg = os.path.join(os.environ.get("MOLECULE_EPHEMERAL_DIRECTORY", ""), "ansible.cfg")
    if os.path.isfile(ephemeral_cfg):
        env["ANSIBLE_CONFIG"] = ephemeral_cfg
    run = subprocess.run(
        [
            "ansible-playbook", "-i", inventory, os.path.join(project, "playbooks", "deploy_pd.yml"),
            "--check", "--diff",
            "-e", f"vllm_instance_api_key={new_instance_key}",
            "-e", f'{{"vllm_router_api_keys": ["{new_client_key}"]}}',
        ],
        cwd=project, env=env, capture_output=True, text=True, timeout=900, check=False,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    # The run did see each key-bearing file change (or there would be nothing to hide)...
    for task, host in (("vllm_router : Write the front's client keys, upstream settings (with the instances' key), "
                        "njs module and site", ROUTER),
                       ("vllm_router : Install the router's environment file (with the instances' key), systemd unit "
                        "and each replica's ports (one unit per replica)", ROUTER),
                       (INSTANCE_KEYS_TASK, PREFILL),
                       (INSTANCE_KEYS_TASK, DECODE)):
        assert task_result(output, task, host) == "changed", (task, host, output[-3000:])
    # The front's task writes both key-bearing files among others: its diff says that each changes, without its text.
    (front,) = task_blocks(output, "inferops.vllm.vllm_router : Write the front's client keys, upstream settings (with "
                                   "the instances' key), njs module and site")
    (instances,) = task_blocks(output, f"inferops.vllm.{INSTANCE_KEYS_TASK}")
    (router,) = task_blocks(output, "inferops.vllm.vllm_router : Install the router's environment file (with the "
                                    "instances' key), systemd unit and each replica's ports (one unit per replica)")
    for path, block in (("/etc/nginx/inferops-vllm-keys.map", front), ("/etc/nginx/inferops-vllm-proxy.conf", front),
                        ("/etc/vllm/api-keys", instances), ("/etc/vllm-router/router.env", router)):
        assert (f"+++ after: {path}\n@@ -1 +1 @@\n-(secret: not shown)\n+(secret, changed: not shown)\n"
                in block), (path, block[-3000:])
    # ...and showed no key, old or new.
    for name, key in (("new instance key", new_instance_key), ("new client key", new_client_key),
                      ("instance key", secret("instance_api_key")), ("client key", secret("client_api_key"))):
        assert key not in output, f"{name} in the --check --diff output"
    # Nothing was changed for real: the front still takes the old key only.
    keys = router_host.file("/etc/nginx/inferops-vllm-keys.map").content_string
    assert "k-" in keys and new_client_key[:8] not in keys


# --------------------------------------------------------------------------- every instance route needs the key (#25)

# Routes FastAPI serves that its schema does not list (the schema itself, the docs pages), and the metrics mount.
UNLISTED = [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/docs/oauth2-redirect"), ("GET", "/redoc"),
            ("GET", "/metrics"), ("GET", "/metrics/"), ("GET", "/no-such-route"), ("POST", "/no-such-route")]
OPEN = {("GET", "/health"), ("HEAD", "/health")}


def _status(url: str, method: str, headers: dict | None = None, body: bytes | None = None) -> tuple[int, bytes]:
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=body, method=method, headers=all_headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _routes(url: str) -> list[tuple[str, str]]:
    """(method, path) of every operation the running vLLM's schema lists, read with the key (the schema itself
    needs it), path parameters filled in; and the routes the schema leaves out."""
    status, body = _status(f"{url}/openapi.json", "GET", instance_auth())
    assert status == 200, f"{url}/openapi.json with the key: {status} {body[:200]!r}"
    paths = json.loads(body)["paths"]
    out = []
    for path, operations in paths.items():
        concrete = re.sub(r"\{[^}]+\}", "x", path)
        for method in operations:
            if method.upper() in ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"):
                out.append((method.upper(), concrete))
    return out + UNLISTED


@pytest.mark.parametrize("which", ["prefill", "decode"])
def test_every_route_of_the_running_vllm_needs_the_instance_key(request, which):
    """The routes come from the running vLLM at test time: a route a later vLLM adds is checked too."""
    url = request.getfixturevalue(f"{which}_url")
    routes = _routes(url)
    # What vLLM 0.32 is known to serve without its own --api-key check: they must be in the list.
    for known in [("POST", "/invocations"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/version"),
                  ("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/health")]:
        assert known in routes, f"{known} not served by {url}? its schema lists {sorted(routes)[:60]}"
    answers = {}
    for method, path in routes:
        if (method, path) in OPEN:
            continue
        body = b"{}" if method in ("POST", "PUT", "PATCH") else None
        answers[(method, path)] = (_status(f"{url}{path}", method, None, body)[0],
                                   _status(f"{url}{path}", method, {"Authorization": "Bearer wrong-key-0123456789"},
                                           body)[0])
    print(f"{url}: {len(answers)} routes without a key / with a wrong key:")
    for (method, path), statuses in sorted(answers.items(), key=lambda kv: kv[0][1]):
        print(f"  {method:7} {path:45} {statuses[0]} / {statuses[1]}")
    open_ones = {route: st for route, st in answers.items() if st != (401, 401)}
    assert not open_ones, f"answered without the key (or with a wrong one): {open_ones}"
    assert _status(f"{url}/health", "GET")[0] == 200
    # The key opens what it guards (read-only routes only: no POST with the key here).
    assert _status(f"{url}/version", "GET", instance_auth())[0] == 200
    assert _status(f"{url}/metrics", "GET", instance_auth())[0] == 200


@pytest.mark.parametrize(("container", "unit"),
                         [(PREFILL, "vllm@prefill-0.service"), (DECODE, "vllm@decode-0.service")])
def test_vllm_runs_with_the_key_middleware_and_no_media_domain(request, container, unit):
    host = request.getfixturevalue({PREFILL: "prefill_host", DECODE: "decode_host"}[container])
    log = host.check_output(f"journalctl -u {unit} --no-pager -o cat | grep 'inferops-vllm-launch: exec:' | tail -1")
    assert "--middleware inferops_vllm_auth.InstanceKeyMiddleware" in log, log
    assert "--allowed-media-domains media-urls-disabled.invalid" in log, log
    mode = host.file("/usr/local/lib/inferops-vllm/inferops_vllm_auth.py")
    assert mode.user == "root" and mode.mode == 0o644


def test_prometheus_scrapes_the_instances_with_their_key(router_host):
    """Prometheus (on the router host here) reads /metrics of every instance with the key from its 0640 file."""
    key_file = router_host.file("/etc/prometheus/inferops-vllm/vllm-instance.key")
    if not router_host.file("/etc/prometheus/inferops-vllm/prometheus.yml").exists:
        pytest.skip("no Prometheus in this scenario")
    assert key_file.mode == 0o640 and key_file.user == "root" and key_file.group == "prometheus"
    config = router_host.file("/etc/prometheus/inferops-vllm/prometheus.yml").content_string
    assert "credentials_file" in config and secret("instance_api_key") not in config


# --------------------------------------------------------------------------- no instance address to clients (#25)


def test_no_instance_address_in_any_answer_of_the_front(front_url):
    """Every body and header the front answers in a run of ordinary and failing requests: none holds an
    instance's address or vllm-router's id format (cmpl-___prefill_addr_<ip:port>...)."""
    ca = front_ca()
    ctx = ssl.create_default_context(cafile=ca) if ca else None
    key = {"Authorization": f"Bearer {secret('client_api_key')}"}
    model = "smollm2-135m-instruct"
    calls = [
        ("POST", "/v1/completions", {"model": model, "prompt": "The capital of France is", "max_tokens": 4}),
        ("POST", "/v1/completions", {"model": model, "prompt": "Count: one, two,", "max_tokens": 4, "stream": True}),
        ("POST", "/v1/chat/completions", {"model": model, "max_tokens": 4,
                                          "messages": [{"role": "user", "content": "Say hi."}]}),
        ("POST", "/v1/chat/completions", {"model": model, "max_tokens": 4, "stream": True,
                                          "messages": [{"role": "user", "content": "Say hi."}]}),
        ("GET", "/v1/models", None),
        ("POST", "/tokenize", {"model": model, "prompt": "Paris"}),
        ("POST", "/v1/completions", {"model": "no-such-model", "prompt": "x", "max_tokens": 1}),
        ("POST", "/v1/completions", {"model": model, "prompt": "x", "max_tokens": -1}),
        ("POST", "/v1/completions", b"not json"),
        ("GET", "/health", None),
        ("GET", "/workers", None),
    ]
    seen, ids = [], []
    for method, path, body in calls:
        data = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(f"{front_url}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json", **key})
        try:
            with urllib.request.urlopen(req, timeout=180, context=ctx) as resp:
                status, headers, raw = resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as exc:
            status, headers, raw = exc.code, dict(exc.headers), exc.read()
        seen.append(f"{method} {path} -> {status} {json.dumps(headers)}\n".encode() + raw)
        ids += re.findall(rb'"id"\s*:\s*"((?:chat)?cmpl-[^"]*)"', raw)
    text = b"\n".join(seen)
    for name in (PREFILL, DECODE):
        address = container_ip(name).encode()
        assert address not in text, f"{name}'s address {address!r} in an answer of the front:\n" + text.decode()[:3000]
    assert b"_addr_" not in text
    assert ids and all(re.fullmatch(rb"(?:chat)?cmpl-[0-9a-f]{32}", i) for i in ids), ids


@pytest.mark.parametrize("which", ["prefill_host", "decode_host"])
def test_model_files_are_readable_by_the_vllm_group_only(request, which):
    host = request.getfixturevalue(which)
    models = host.file("/var/lib/vllm/models")
    assert models.user == "root" and models.group == "vllm" and models.mode == 0o750
    denied = host.run("runuser -u nobody -- sh -c 'ls /var/lib/vllm/models; cat /var/lib/vllm/models/*/config.json'")
    assert denied.rc != 0 and "Permission denied" in denied.stderr, denied.stdout[:200]
    readable = host.run("runuser -u vllm -- sh -c 'cat /var/lib/vllm/models/*/config.json' >/dev/null")
    assert readable.rc == 0, readable.stderr
