"""One key, local first, a cloud as fallback (issue #13), against a real "cloud": a plain vLLM instance that
this collection deploys without PD in its own container (the `cloud` group), under another served model
name, with its own key, behind TLS with a CA of its own (molecule/default/cloud.yml). The router host's front
gets it as its fallback through a deploy_pd.yml re-run; then, through the front with the client's key:

- with the PD pool healthy, the answer comes from the local pool; a client error (400) is answered locally
  and never sent to the cloud;
- a stream that the local pool started is not switched to the cloud when decode dies under it;
- with every decode instance stopped, the same client calls (plain and streamed) succeed from the cloud, under
  the model name the client asked for, without the cloud's key in any answer, each counted in the front's
  fallback counter and in the cloud's own request counter;
- back to local when decode returns (one decode instance started again);
- a roll of that one decode instance, the other still stopped, refused before any change;
- last, an upgrade of the cloud itself (another install fingerprint): the new venv beside the running one, the
  instance restarted at once (its `vllm_instance_restart_strategy: immediate`), the old version pruned (issue #23
  point 4).

The cloud's request counter (vLLM's vllm:request_success_total on the cloud instance) is the ground truth of
what reached the cloud; the front's header and counter are checked against it.

This changes the deployment (the front's settings, decode stopped and started, the cloud's venv), so it carries the
`changes_deployment` mark and runs after the tests that only read it.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import time
import urllib.error
import urllib.request

import pytest
import testinfra
import yaml
from conftest import (
    DECODE,
    FALLBACKS_DEPLOYED,
    ROUTER,
    cloud_deployed,
    container_ip,
    deploy_playbook,
    front_ca,
    front_health,
    inline_playbook,
    metric_samples,
    router_workers,
    secret,
    task_blocks,
    unit_start,
    vllm_child,
)
from sandbox_faults import kill_vllm_command

PROJECT = os.environ.get("MOLECULE_PROJECT_DIRECTORY", "")
EPHEMERAL = os.environ.get("MOLECULE_EPHEMERAL_DIRECTORY", "")
CLOUD = os.environ.get("INFEROPS_CLOUD_HOST", "molecule-cloud")

pytestmark = [pytest.mark.skipif(not (PROJECT and EPHEMERAL), reason="runs inside molecule only (its inventory)"),
              pytest.mark.changes_deployment(order=2)]

MODEL = "smollm2-135m-instruct"
CLOUD_MODEL = "cloud-smollm"
SERVED_BY = "X-Inferops-Served-By"


def _context() -> ssl.SSLContext | None:
    ca = front_ca()
    return ssl.create_default_context(cafile=ca) if ca else None


def _call(url: str, body: dict, key: str, timeout: float = 300) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one POST; an HTTP error is an answer too."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=_context() if url.startswith("https") else None) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def _chat(front_url: str, stream: bool = False, max_tokens: int = 8, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream, **extra}


def _sse_models(body: bytes) -> tuple[set[str], bool]:
    """The model names of an SSE answer's chunks, and whether it ended with [DONE]."""
    models, done = set(), False
    for line in body.decode().splitlines():
        if line.startswith("data: [DONE]"):
            done = True
        elif line.startswith("data: "):
            models.add(json.loads(line[6:])["model"])
    return models, done


def _podman_exec(host: str, command: str) -> str:
    return subprocess.run(["podman", "exec", host, "sh", "-c", command], check=True, capture_output=True,
                          text=True, timeout=120).stdout


def fallback_counts() -> dict[str, float]:
    """inferops_vllm_front_fallbacks_total by (fallback, reason), from the front's loopback metrics page."""
    text = _podman_exec(ROUTER, "python3 -c \"import urllib.request; print(urllib.request.urlopen("
                                "'http://127.0.0.1:8090/fallback_metrics', timeout=10).read().decode())\"")
    out = {}
    for line in text.splitlines():
        if line.startswith("inferops_vllm_front_fallbacks_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels[len("inferops_vllm_front_fallbacks_total"):]] = float(value)
    return out


def cloud_requests() -> float:
    """Requests the cloud's vLLM finished (its own counter: what really reached the cloud)."""
    with open(os.path.join(EPHEMERAL, "cloud", "api_key")) as f:
        cloud_key = f.read().split()[0]
    samples = metric_samples(f"http://{container_ip(CLOUD)}:8100/metrics", key=cloud_key)
    return sum(value for (name, _labels), value in samples.items() if name == "vllm:request_success_total")


def decode_units() -> list[str]:
    out = _podman_exec(DECODE, "systemctl list-units --all --plain --no-legend 'vllm@*.service' | awk '{print $1}'")
    return sorted(unit for unit in out.split() if unit)


def _wait(what: str, check, timeout: float = 300, every: float = 3):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
            if value:
                return value
        except (OSError, subprocess.CalledProcessError, urllib.error.URLError):
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout} s")
        time.sleep(every)


@pytest.fixture(scope="module")
def cloud():
    """The cloud deployed (cloud.yml, in the background since prepare.yml) and the front given it as its fallback:
    by the day-2 file's deploy_pd.yml run (under load, with its other changes), else here."""
    cloud_dir = cloud_deployed()
    with open(os.path.join(cloud_dir, "api_key")) as f:
        cloud_key = f.read().split()[0]
    # The inventory the deployment was last made from: the day-2 file's (it wrote its path there), else molecule's.
    marker = os.path.join(cloud_dir, FALLBACKS_DEPLOYED)
    inventory = os.path.join(EPHEMERAL, "inventory")
    if os.path.exists(marker):
        with open(marker) as f:
            inventory = f.read().strip()
    else:
        deploy = deploy_playbook(inventory, "deploy_pd.yml", "-e", f"@{cloud_dir}/fallbacks.yml")
        assert deploy.returncode == 0, deploy.stdout[-8000:] + deploy.stderr[-3000:]
        # The cloud's key is nowhere in what the deploy printed.
        assert cloud_key not in deploy.stdout + deploy.stderr
    return {"key": cloud_key, "dir": cloud_dir, "inventory": inventory}


def test_the_cloud_is_a_real_vllm_behind_tls_with_its_own_key(cloud):
    """The endpoint itself: TLS verified with its CA only, its own key required, its own model name."""
    url = f"https://{container_ip(CLOUD)}:8443/v1/models"
    with pytest.raises(urllib.error.URLError):  # not trusted without its CA
        urllib.request.urlopen(url, timeout=30)
    ctx = ssl.create_default_context(cafile=os.path.join(cloud["dir"], "ca.pem"))
    ours = urllib.request.Request(url, headers={"Authorization": f"Bearer {secret('client_api_key')}"})
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(ours, timeout=30, context=ctx)
    assert exc.value.code == 401
    assert _cloud_models(cloud) == [CLOUD_MODEL]


def test_healthy_pool_answers_locally_and_a_client_error_is_not_retried(cloud, front_url):
    key = secret("client_api_key")
    before_cloud, before_front = cloud_requests(), fallback_counts()
    status, headers, body = _call(f"{front_url}/v1/chat/completions", _chat(front_url), key)
    assert status == 200, body[:500]
    assert headers.get(SERVED_BY) == "local"
    assert json.loads(body)["model"] == MODEL
    # A client error: answered by the local side as it is, never sent to the cloud.
    status, headers, body = _call(f"{front_url}/v1/chat/completions", _chat(front_url, max_tokens=-1), key)
    assert 400 <= status < 500 and status != 429, (status, body[:500])
    assert headers.get(SERVED_BY) == "local"
    assert cloud_requests() == before_cloud
    assert fallback_counts() == before_front


def test_a_started_stream_is_not_switched_when_decode_dies_under_it(cloud, front_url):
    """SIGKILL of every decode instance's vLLM after the first streamed tokens: the answer stays the local one (it
    may end short), the cloud gets nothing. Then decode is stopped for the next test."""
    key = secret("client_api_key")
    units = decode_units()
    assert units, "no vllm@ unit on the decode host"
    before_cloud, before_front = cloud_requests(), fallback_counts()
    body = _chat(front_url, stream=True, max_tokens=300, ignore_eos=True)
    req = urllib.request.Request(f"{front_url}/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    lines: list[bytes] = []
    with urllib.request.urlopen(req, timeout=300, context=_context() if front_url.startswith("https") else None) as r:
        assert r.headers.get(SERVED_BY) == "local"
        while sum(line.startswith(b"data: ") for line in lines) < 3:  # a few chunks of the local answer
            line = r.readline()
            assert line, lines
            lines.append(line)
        _podman_exec(DECODE, f"{kill_vllm_command(units)}; systemctl stop {' '.join(units)}")
        try:
            while line := r.readline():
                lines.append(line)
        except (OSError, ValueError):
            pass  # the connection cut short is one of the allowed ends
    received = b"".join(lines)
    models, _done = _sse_models(received)
    assert models == {MODEL}
    # Cut short, or ended if the kill came after the last token; never a second answer after it.
    assert received.count(b"data: [DONE]") <= 1
    assert received.count(b'"role":"assistant"') <= 1, received[-2000:]
    assert cloud_requests() == before_cloud
    assert fallback_counts() == before_front


def test_with_decode_stopped_the_same_calls_succeed_from_the_cloud(cloud, front_url, router_host):
    key = secret("client_api_key")
    for unit in decode_units():
        assert _podman_exec(DECODE, f"systemctl is-active {unit} || true").strip() != "active", unit
    # No decode instance left: the front's /health tells load balancers (503), while the fallback still answers.
    _wait("the front's /health to say unavailable", lambda: front_health(front_url) == (503, "unavailable"),
          timeout=30, every=2)
    before_cloud, before_front = cloud_requests(), fallback_counts()
    status, headers, body = _call(f"{front_url}/v1/chat/completions", _chat(front_url), key)
    assert status == 200, body[:1000]
    assert headers.get(SERVED_BY) == "fallback"
    answer = json.loads(body)
    assert answer["model"] == MODEL and answer["choices"][0]["message"]["content"]
    status, headers, body = _call(f"{front_url}/v1/chat/completions", _chat(front_url, stream=True), key)
    assert status == 200, body[:1000]
    assert headers.get(SERVED_BY) == "fallback"
    models, done = _sse_models(body)
    assert models == {MODEL} and done, body[-1000:]
    for text in (json.dumps(headers), body.decode(errors="replace")):
        assert cloud["key"] not in text
    _wait("the cloud's counter to count both requests", lambda: cloud_requests() == before_cloud + 2, timeout=30)
    after = fallback_counts()
    added = {labels: after[labels] - before_front.get(labels, 0) for labels in after}
    assert sum(added.values()) == 2, (before_front, after)
    assert all('fallback="cloud"' in labels for labels, value in added.items() if value), added
    logs = router_host.run("cat /var/log/nginx/*.log /var/log/nginx/inferops-vllm-* 2>/dev/null").stdout
    assert cloud["key"] not in logs


def test_with_decode_stopped_only_mapped_models_reach_the_cloud_and_no_query_string(cloud, front_url):
    """Issue #25: a model the endpoint does not map gets vLLM's 404 shape and costs nothing; a query string
    never reaches the cloud; the cloud's own headers pass by an allow-list; the answer's id is the cloud's."""
    key = secret("client_api_key")
    before_cloud = cloud_requests()
    body = _chat(front_url)
    body["model"] = "gpt-4o-not-served-here"
    status, headers, answer = _call(f"{front_url}/v1/chat/completions", body, key)
    assert status == 404, answer[:500]
    error = json.loads(answer)["error"]
    assert error["type"] == "NotFoundError" and error["code"] == 404 and "gpt-4o-not-served-here" in error["message"]
    status, headers, answer = _call(f"{front_url}/v1/chat/completions?api-version=1&debug=1", _chat(front_url), key)
    assert status == 200 and headers.get(SERVED_BY) == "fallback", answer[:500]
    assert not [h for h in headers if h.lower().startswith(("x-ratelimit", "openai-", "set-cookie", "x-request-id"))]
    _wait("the cloud's counter to count one request", lambda: cloud_requests() == before_cloud + 1, timeout=30)


def prometheus(path: str) -> dict:
    """The router host's Prometheus API (it listens on the host's loopback)."""
    return json.loads(_podman_exec(ROUTER, "python3 -c \"import urllib.request; print(urllib.request.urlopen("
                                           f"'http://127.0.0.1:9090{path}', timeout=10).read().decode())\""))


def test_prometheus_scrapes_the_fallbacks_and_loads_their_alerts(cloud):
    """The monitoring role on the router host scrapes the front's counter (job nginx-fallback) and loads the
    fallback alerts once the front has fallbacks (deploy_pd.yml renders both)."""
    want = sum(value for labels, value in fallback_counts().items() if 'fallback="cloud"' in labels)
    assert want >= 2

    def scraped():
        result = prometheus("/api/v1/query?query=sum(inferops_vllm_front_fallbacks_total"
                            "%7Bjob%3D%22nginx-fallback%22,fallback%3D%22cloud%22%7D)")["data"]["result"]
        return result and float(result[0]["value"][1]) >= want

    _wait("Prometheus to scrape the front's fallback counter", scraped, timeout=120, every=5)
    names = {rule["name"] for group in prometheus("/api/v1/rules")["data"]["groups"] for rule in group["rules"]}
    assert {"InferopsFrontFallingBack", "InferopsFrontFallbackExhausted"} <= names


def test_back_to_local_when_decode_returns(cloud, front_url):
    """One decode instance started again (the first; a second vLLM start on the two cores would cost a minute and
    show nothing more): the front serves locally again, nothing reaches the cloud, and its /health says degraded
    (200) while the other stays stopped. (That /health goes back to ok once every instance is healthy again is the
    day-2 kill test's.)"""
    key = secret("client_api_key")
    units = decode_units()
    assert len(units) >= 2, units
    back, stopped = units[0], units[1:]
    _podman_exec(DECODE, f"systemctl start {back}")
    _wait(f"{back} to run", lambda: _podman_exec(DECODE, f"systemctl is-active {back} || true").strip() == "active",
          timeout=120)

    def served_locally():
        status, headers, _body = _call(f"{front_url}/v1/chat/completions", _chat(front_url), key)
        return status == 200 and headers.get(SERVED_BY) == "local"

    # vLLM starting on the CPU, then the router's health check seeing it. Requests that fell back while the
    # router had not yet seen decode return are allowed until then.
    _wait("the front to serve locally again", served_locally, timeout=600, every=5)
    before_cloud, before_front = cloud_requests(), fallback_counts()
    for _request in range(3):
        status, headers, body = _call(f"{front_url}/v1/chat/completions", _chat(front_url), key)
        assert status == 200 and headers.get(SERVED_BY) == "local", (status, body[:500])
    # From then on, nothing reaches the cloud and nothing is counted as a fallback.
    assert fallback_counts() == before_front
    assert cloud_requests() == before_cloud
    # And the front's /health: 200, degraded, with one decode instance healthy and the others stopped.
    for unit in stopped:
        assert _podman_exec(DECODE, f"systemctl is-active {unit} || true").strip() != "active", unit
    _wait("the front's /health to say degraded", lambda: front_health(front_url) == (200, "degraded"), timeout=120,
          every=2)


def test_a_rollout_does_not_take_out_the_last_healthy_instance_of_a_pool(
        cloud, front_url, decode_host, router_host):
    """Issue #23 point 4: with the other decode instance stopped (the previous test leaves one running), rolling the
    one that serves is refused before any change, although the inventory's pool has two instances (so it is not
    the pool-of-one refusal of the plan): every router would be left without a healthy decode worker. The
    instance is not restarted and stays in both router replicas; the front still serves locally. (The same
    refusal stops a vllm_rollout_serial batch that would take a whole pool out; unit-tested on fake routers.)"""
    units = decode_units()
    back, stopped = units[0], units[1:]
    name = back.removeprefix("vllm@").removesuffix(".service")
    assert name == "decode-0", units  # converge's and the day-2 file's first decode instance, on port 8200
    url = f"http://{container_ip(DECODE)}:8200"
    for unit in stopped:
        assert _podman_exec(DECODE, f"systemctl is-active {unit} || true").strip() != "active", unit
    started_before = unit_start(decode_host, back)
    instances = json.dumps({"vllm_rollout_instances": [name]})
    run = deploy_playbook(cloud["inventory"], "rolling_restart.yml", "-e", instances,
                          "-e", "vllm_rollout_allow_downtime=false")
    output = " ".join((run.stdout + run.stderr).split())
    assert run.returncode != 0, output[-3000:]
    assert f"The rolling restart stopped at {name}" in output, output[-3000:]
    assert f"Taking {url} out would leave a router without a healthy worker of its kind" in output, output[-3000:]
    assert f"{name} rolled" not in output
    assert unit_start(decode_host, back) == started_before
    for workers in router_workers(router_host):
        assert url in {w["url"] for w in workers["workers"] if w["is_healthy"]}, workers
    status, headers, body = _call(f"{front_url}/v1/chat/completions", _chat(front_url), secret("client_api_key"))
    assert status == 200 and headers.get(SERVED_BY) == "local", (status, body[:500])


PRUNE = """\
- name: Prune the cloud's vLLM venvs, keeping the live one only
  hosts: cloud
  gather_facts: false
  become: true
  tasks:
    - name: Remove old versions of the vLLM venv
      ansible.builtin.include_role:
        name: inferops.vllm.vllm_install
        tasks_from: prune
      vars:
        vllm_install_keep_previous: 0
"""


def _cloud_process(cloud_host) -> tuple[str, str, list[str]]:
    """(MainPID, its start, the vLLM child's argv) of the cloud's instance vllm-0."""
    pid, since = unit_start(cloud_host, "vllm@vllm-0")
    child = vllm_child(cloud_host, "vllm@vllm-0")[2]
    return pid, since, cloud_host.file(f"/proc/{child}/cmdline").content_string.split("\0")


def _cloud_models(cloud) -> list[str]:
    request = urllib.request.Request(f"https://{container_ip(CLOUD)}:8443/v1/models",
                                     headers={"Authorization": f"Bearer {cloud['key']}"})
    context = ssl.create_default_context(cafile=os.path.join(cloud["dir"], "ca.pem"))
    with urllib.request.urlopen(request, timeout=30, context=context) as r:
        return [m["id"] for m in json.loads(r.read())["data"]]


def test_an_upgrade_installs_beside_the_running_vllm_restarts_it_at_once_and_prunes(cloud, tmp_path):
    """Issue #23 point 4, an upgrade end to end and `vllm_instance_restart_strategy: immediate` after a change, on
    the cloud (cloud.yml sets the strategy: no rolling_restart.yml runs for the cloud), last because it restarts the
    cloud's vLLM. cloud.yml re-run with another install fingerprint (the index instead of the wheelhouse, as a new
    pin would give): the new venv is installed in a version directory beside the running one, which stays as it
    was; the link switches; the running instance restarts within the run (the role waits for its /health) onto
    the new venv's Python; no restart mark is left; then the prune entry point removes the old version and not the
    live one, under the running instance, which still answers. With `rolling` the run would have marked it and
    left it running (the handler's choice, tests/unit/test_instance_restarts.py; deploy_pd.yml's roll is the day-2
    run's); the mechanics of the version directories are unit-tested on small venvs (test_python_venv_versions.py)."""
    cloud_host = testinfra.get_host(f"podman://{CLOUD}")
    old = cloud_host.check_output("readlink -f /opt/vllm/venv")
    old_marker = cloud_host.file(f"{old}/.inferops-vllm-install.json").content_string
    assert json.loads(old_marker)["source"] == "wheelhouse", old_marker
    pid_before, since_before, argv = _cloud_process(cloud_host)
    assert argv[0].startswith(old + "/bin/python"), (old, argv)
    # The cloud's install from molecule's package index instead of the wheelhouse, with the decode host's settings
    # (its host_vars: the index, its credentials, its CA).
    with open(os.path.join(os.path.dirname(__file__), "..", "host_vars", f"{DECODE}.yml")) as f:
        index = {k: v for k, v in yaml.safe_load(f).items() if k.startswith("vllm_install_")}
    assert index["vllm_install_source"] == "index", index
    upgrade = tmp_path / "upgrade.yml"
    upgrade.write_text(yaml.safe_dump(index))
    run = deploy_playbook(os.path.join(EPHEMERAL, "inventory"), "molecule/default/cloud.yml",
                          "-e", f"cloud_dir={cloud['dir']}", "-e", f"@{upgrade}")
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    assert cloud["key"] not in output and secret("index-password") not in output
    new = cloud_host.check_output("readlink -f /opt/vllm/venv")
    assert new != old and os.path.dirname(new) == os.path.dirname(old) == "/opt/vllm/venv.d", (old, new)
    assert json.loads(cloud_host.file(f"{new}/.inferops-vllm-install.json").content_string)["source"] == "index"
    # The running install was left as it was (a process still running from it keeps its files).
    assert cloud_host.file(f"{old}/.inferops-vllm-install.json").content_string == old_marker
    # The role's handler restarted the instance within the run (the task's own output, up to the next one).
    restarted = task_blocks(output, "inferops.vllm.vllm_instance : Restart the instances that do not run or roll",
                            kind="RUNNING HANDLER")
    assert restarted, output[-4000:]
    assert any(f"changed: [{CLOUD}] => (item=vllm-0)" in block for block in restarted), restarted
    pid, since, argv = _cloud_process(cloud_host)
    assert pid != pid_before and since != since_before, (pid_before, pid)
    assert argv[0].startswith(new + "/bin/python"), (new, argv)
    assert cloud_host.run("ls /var/lib/inferops-vllm/restart-pending").stdout.strip() == ""
    assert _cloud_models(cloud) == [CLOUD_MODEL]  # healthy before the run ended: the role waited
    # A process of the vLLM user still running from the old version (as an instance marked for a restart that has
    # not rolled would, its argv[0] the old directory's Python): the prune keeps that directory and names it. In the
    # container, root cannot read another user's maps (no CAP_SYS_PTRACE): its command line is what shows it.
    straggler = "import time; time.sleep(600)  # inferops-prune-straggler"
    subprocess.run(["podman", "exec", "--detach", "--user", "vllm", CLOUD, f"{old}/bin/python3", "-c", straggler],
                   check=True, capture_output=True, text=True, timeout=60)
    try:
        holder = cloud_host.check_output("pgrep -u vllm -f inferops-prune-straggler")
        pruned = inline_playbook(PRUNE, tmp_path)
        said = " ".join((pruned.stdout + pruned.stderr).split())
        assert pruned.returncode == 0, said[-3000:]
        assert f"vLLM: live {new}; removed nothing;" in said, said[-3000:]
        assert f"kept {old}, in use by pid {holder} (python3" in said, said[-3000:]
        assert f"command line {old}/bin/python3)" in said, said[-3000:]
        assert "checked by their command lines only: their files and maps cannot be read without CAP_SYS_PTRACE" \
            in said, said[-3000:]
        assert cloud_host.file(f"{old}/bin/python3").exists
    finally:
        cloud_host.run("pkill -u vllm -f inferops-prune-straggler")
    # Once nothing uses it: the old version goes, the live one stays, the instance keeps running and answering.
    for _attempt in range(50):
        if cloud_host.run("pgrep -u vllm -f inferops-prune-straggler").rc != 0:
            break
        time.sleep(0.1)
    pruned = inline_playbook(PRUNE, tmp_path)
    said = " ".join((pruned.stdout + pruned.stderr).split())
    assert pruned.returncode == 0, said[-3000:]
    assert f"vLLM: live {new}; removed {old}; kept no previous install" in said, said[-3000:]
    assert not cloud_host.file(old).exists and cloud_host.file(f"{new}/bin/python").exists
    assert unit_start(cloud_host, "vllm@vllm-0") == (pid, since)
    assert _cloud_models(cloud) == [CLOUD_MODEL]
