"""Day-2 operations under steady client load: one deploy_pd.yml run that scales the decode pool in (decode-1
leaves) and out (decode-2 joins), rolls decode-0 whose setting changed and gives the front its fallback, all at
once; the decode pool rolled with playbooks/rolling_restart.yml; a failing rollout stopped; a one-instance pool
refused, and rolled with the downtime allowed (proven against every decode instance first); a handoff with the KV
path refused (kv_load_failure_policy recompute) before the decode pool's roll, which heals that path; a decode
instance killed with SIGKILL (its vLLM process).

One load runs through the whole file (module fixture `load`): streaming completions sent from this process
through the front (benchmarks/bench_load.py FrontLoad: no vLLM import on the two busy cores, every request's
start, TTFT and error recorded, stopped at once). Each operation records its time window; the last test judges
every window (no failed request, requests sent all along; for the kill, a bound), and that no request failed
outside them. An answer that the front's fallback served counts as failed: the local pool must not fail.

Converge gives the decode host two instances (host_vars/molecule-decode.yml), so the pool a roll without
downtime needs is there from the start. These tests change the deployment, so they carry the
`changes_deployment(order=1)` mark (pytest.ini): conftest.py runs them after every read-only test and before
the fallback tests (order 2); within this file, in the order written.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import socket
import ssl
import string
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import pytest
import yaml
from bench_load import FrontLoad, summary  # benchmarks/, put on sys.path by conftest.py
from conftest import (
    DECODE,
    FALLBACKS_DEPLOYED,
    PREFILL,
    ROUTER,
    cloud_deployed,
    container_ip,
    deploy_playbook,
    front_ca,
    front_health,
    http_json,
    instance_auth,
    journal_tail,
    metric_samples,
    prefill_for_remote_decode,
    router_workers,
    secret,
    unit_start,
)
from sandbox_faults import kill_vllm_command, peer_block_rules

PROJECT = os.environ.get("MOLECULE_PROJECT_DIRECTORY", "")
EPHEMERAL = os.environ.get("MOLECULE_EPHEMERAL_DIRECTORY", "")

pytestmark = [pytest.mark.skipif(not (PROJECT and EPHEMERAL), reason="runs inside molecule only (its inventory)"),
              pytest.mark.changes_deployment(order=1)]

MODEL = "smollm2-135m-instruct"
CLOUD = os.environ.get("INFEROPS_CLOUD_HOST", "molecule-cloud")
DECODE_1 = "decode-1"  # in converge's pool; leaves it in the day-2 run
DECODE_2 = {"name": "decode-2", "port": 8202, "kv_transfer_port": 5702, "cpus": "1"}  # joins it
DECODE_0_CHANGE = {"shutdown_timeout": 45}
POOL = ["decode-0", "decode-2"]  # the decode pool after the day-2 run
# The client keys the day-2 run leaves: the load's key stays, client_api_key_2 (used by the read-only tests
# before this file only) is dropped and client_api_key_3 added, in the same run. The front's certificate is
# rotated to the second one prepare.yml made.
CLIENT_KEYS = ["client_api_key", "client_api_key_3"]
NEXT_CERTIFICATE = "front-next"
# The load covers an operation when no stretch of it went without a request sent for this long: at 0.5
# requests/s with at most 4 in flight, a gap this long means every slot hung on a stalled pool.
MAX_GAP = 20
# A stop of an instance with nothing running must not hang: vLLM exits in about a second, the launcher reaps what
# it leaves behind (the unit's TimeoutStopSec is the drain plus 15 s).
STOP_BOUND_SECONDS = 25
HEALTH_8200 = "python3 -c \"import urllib.request; urllib.request.urlopen('http://127.0.0.1:8200/health', timeout=5)\""


@pytest.fixture(scope="module")
def inventory(tmp_path_factory):
    """Molecule's inventory with the decode host's pool changed (decode-1 gone, decode-2 added, decode-0's
    shutdown_timeout changed) and the router's client keys and TLS certificate rotated."""
    src = os.path.join(EPHEMERAL, "inventory")
    dst = tmp_path_factory.mktemp("inventory") / "inventory"
    shutil.copytree(src, dst, symlinks=False)
    host_vars = dst / "host_vars" / f"{DECODE}.yml"
    data = yaml.safe_load(host_vars.read_text()) or {}
    instances = data["vllm_instance_instances"]
    assert [i["name"] for i in instances] == ["decode-0", DECODE_1], "converge's decode pool changed: see host_vars"
    instances = [{**i, "overrides": {**i.get("overrides", {}), **DECODE_0_CHANGE}} if i["name"] == "decode-0" else i
                 for i in instances if i["name"] != DECODE_1]
    data["vllm_instance_instances"] = [*instances, DECODE_2]
    host_vars.write_text(yaml.safe_dump(data, sort_keys=False))
    router_vars = dst / "host_vars" / f"{ROUTER}.yml"
    data = yaml.safe_load(router_vars.read_text()) or {}
    assert len(data["vllm_router_api_keys"]) == 2, "molecule's client keys changed: see host_vars"
    # As a site's vault would hold them: the keys by the same lookup, the certificate by its path.
    data["vllm_router_api_keys"] = [
        f"{{{{ lookup('ansible.builtin.password', inferops_sandbox_secrets_dir ~ '/{name}', "
        f"chars=['ascii_letters', 'digits'], length=40) }}}}" for name in CLIENT_KEYS]
    tls = os.path.join(EPHEMERAL, "tls")
    data["vllm_router_tls_certificate"] = os.path.join(tls, f"{NEXT_CERTIFICATE}.pem")
    data["vllm_router_tls_key"] = os.path.join(tls, f"{NEXT_CERTIFICATE}.key")
    router_vars.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(dst)


def playbook(inventory: str, name: str, *args: str) -> subprocess.CompletedProcess:
    return deploy_playbook(inventory, name, *args)


@dataclass
class Operation:
    """What ran under the load, when (CLOCK_MONOTONIC, as the bench results), and what it may cost."""
    name: str
    start: float
    end: float
    max_failed: float = 0
    # Requests sent after this moment must not fail (the killed instance is back in rotation).
    quiet_after: float | None = None


OPERATIONS: list[Operation] = []


@pytest.fixture(scope="module")
def load(front_url):
    """One steady load for the whole file, from this process through the front over TLS; the last test stops it
    and judges what it saw."""
    front = FrontLoad(front_url, MODEL, secret("client_api_key"), ca_file=front_ca(), rate=0.5)
    front.start()
    yield front
    if not front.stopped:
        front.stop()


def measured(load: FrontLoad, name: str, action, max_failed: float = 0):
    """Run `action()` under the load and record its window; returns what the action returned."""
    start = time.perf_counter()
    value = action()
    OPERATIONS.append(Operation(name, start, time.perf_counter(), max_failed))
    return value


def health_settings(router_host) -> tuple[int, int, int]:
    unit = router_host.file("/etc/systemd/system/vllm-router@.service").content_string
    values = [int(re.search(rf"--{flag} (\d+)", unit).group(1))
              for flag in ("health-check-interval-secs", "health-failure-threshold", "health-check-timeout-secs")]
    return values[0], values[1], values[2]


def rotate_instance_key() -> str:
    """A new instance key where the inventory's password lookup reads it (the sandbox's secrets directory, as a
    site would put a new one in its vault); returns the old one."""
    path = os.path.join(os.environ["INFEROPS_SECRETS_DIR"], "instance_api_key")
    old = secret("instance_api_key")
    new = "".join(secrets.choice(string.ascii_letters + string.digits) for _position in range(40))
    with open(path + ".tmp", "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(new + "\n")
    os.replace(path + ".tmp", path)
    return old


def instance_status(url: str, key: str) -> int:
    req = urllib.request.Request(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def front_status(front_url: str, key: str) -> int:
    """The front's answer to /v1/models with this client key."""
    req = urllib.request.Request(f"{front_url}/v1/models", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=30, context=ssl.create_default_context(cafile=front_ca())) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def served_certificate(front_url: str) -> bytes:
    """The certificate the front presents now (DER), verified against molecule's CA."""
    host, port = front_url.split("://", 1)[1].rsplit(":", 1)
    context = ssl.create_default_context(cafile=front_ca())
    with socket.create_connection((host, int(port)), timeout=30) as sock, \
            context.wrap_socket(sock, server_hostname=host) as tls:
        return tls.getpeercert(binary_form=True)


def nginx_pid(router_host) -> str:
    return router_host.check_output("systemctl show -p MainPID --value nginx.service").strip()


def accepted_keys(host) -> list[str]:
    return [line for line in host.file("/etc/vllm/api-keys").content_string.splitlines()
            if line.strip() and not line.startswith("#")]


def test_a_shared_setting_change_is_refused_before_any_host_changes(prefill_host, decode_host):
    """The KV cache dtype changed on the running deployment: prefill and decode must agree on it, and the rollout
    would restart them one at a time, so deploy_pd.yml refuses in its host checks, names the running instances with
    the old and new value and the ways (restart together, a second deployment), and no host changed."""
    before = {"prefill": unit_start(prefill_host, "vllm@prefill-0"), "decode": unit_start(decode_host, "vllm@decode-0")}
    toml = decode_host.file("/etc/vllm/decode-0.toml").content_string
    run = deploy_playbook(os.path.join(EPHEMERAL, "inventory"), "deploy_pd.yml", "-e",
                          "vllm_instance_kv_cache_dtype=fp8_e5m2")
    output = " ".join((run.stdout + run.stderr).split())
    assert run.returncode != 0, output[-3000:]
    assert "[parity] molecule-decode: vllm_instance_kv_cache_dtype: changes on running instances (decode-0 'auto' -> " \
           "'fp8_e5m2'; decode-1 'auto' -> 'fp8_e5m2')" in output, output[-3000:]
    assert "vllm_instance_restart_strategy=immediate" in output and "second deployment" in output
    assert not re.search(r"changed=[1-9]", output), output[-2000:]
    assert unit_start(prefill_host, "vllm@prefill-0") == before["prefill"]
    assert unit_start(decode_host, "vllm@decode-0") == before["decode"]
    assert decode_host.file("/etc/vllm/decode-0.toml").content_string == toml


def test_other_weights_in_the_same_model_directory_are_refused_before_any_host_changes(tmp_path, decode_host):
    """Issue #24: a controller model directory with other files (here one file more, the others hard links) keeps the
    directory's name on the hosts, so [model] name does not change; its copy's fingerprint ([model] identity) does,
    and a roll would have decode continue KV that prefill computed with other weights: refused before any change,
    and nothing copied."""
    cache = os.environ.get("INFEROPS_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.environ["HOME"], ".cache"), "inferops-vllm")
    model = os.path.realpath(os.path.join(cache, "sandbox", "model"))
    other = tmp_path / os.path.basename(model)
    subprocess.run(["cp", "-al", model, str(other)], check=True)
    (other / "README.other-weights").write_text("one file more: another copy\n")
    toml = decode_host.file("/etc/vllm/decode-0.toml").content_string
    before = decode_host.check_output("ls -a /var/lib/vllm/models")
    run = deploy_playbook(os.path.join(EPHEMERAL, "inventory"), "deploy_pd.yml", "-e", f"vllm_instance_model={other}")
    output = " ".join((run.stdout + run.stderr).split())
    assert run.returncode != 0, output[-3000:]
    found = re.search(r"\[parity\] molecule-decode: vllm_instance_model, vllm_instance_model_revision: changes on "
                      r"running instances \(decode-0 'copy ([0-9a-f]{64})' -> 'copy ([0-9a-f]{64})'; decode-1 ", output)
    assert found and found.group(1) != found.group(2), output[-3000:]
    assert f'identity = "copy {found.group(1)}"' in toml
    assert not re.search(r"changed=[1-9]", output), output[-2000:]
    assert decode_host.file("/etc/vllm/decode-0.toml").content_string == toml
    assert decode_host.check_output("ls -a /var/lib/vllm/models") == before


def test_one_deploy_pd_run_scales_in_and_out_rolls_a_changed_instance_rotates_the_keys_and_adds_fallbacks(
        inventory, load, prefill_host, decode_host, router_host, prefill_url, front_url):
    """deploy_pd.yml with decode-1 gone, decode-2 added, decode-0's shutdown_timeout changed, a new instance key, a
    client key dropped and one added, a new TLS certificate for the front and the cloud as the front's fallback, in
    one run (each deploy_pd.yml run under load costs minutes on 2 cores):
    decode-1 is taken out of every router replica and drained before anything changes, then stopped and its files
    removed; decode-2 starts and joins both replicas; decode-0 is marked while the run changes it and rolled at the
    end (out of the routers, drained, restarted, proven, put back); prefill is not restarted; no mark is left; the
    instances accept the new key beside the old one until the routers present it, then the new one only (no
    instance restarts for it); nginx reloads for the client keys and the certificate (its master process stays) and
    then serves the new certificate, refuses the dropped key and takes the added one; the front has the fallback. No
    request fails or is served by the fallback all along."""
    cloud_dir = cloud_deployed()
    prefill_before = unit_start(prefill_host, "vllm@prefill-0")
    nginx_before = nginx_pid(router_host)
    dropped_client_key = secret("client_api_key_2")
    certificate_before = served_certificate(front_url)
    decode_0_before = unit_start(decode_host, "vllm@decode-0")
    old_key = rotate_instance_key()
    new_key = secret("instance_api_key")
    run = measured(load, "deploy_pd.yml: decode-1 out, decode-2 in, decode-0 rolled (a changed setting), instance "
                         "key rotated, fallbacks",
                   lambda: playbook(inventory, "deploy_pd.yml", "-e", f"@{cloud_dir}/fallbacks.yml"))
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    # The rotation: the new key alone is accepted now, on every instance, and no key is in the output.
    for host in (prefill_host, decode_host):
        assert accepted_keys(host) == [new_key], host
    assert instance_status(prefill_url, old_key) == 401 and instance_status(prefill_url, new_key) == 200
    assert old_key not in output and new_key not in output
    # The client keys and the certificate: a graceful reload, the new ones in effect, none of them printed.
    client_keys = [secret(name) for name in CLIENT_KEYS]
    assert nginx_pid(router_host) == nginx_before, "nginx restarted for a key or certificate change: reload only"
    with open(os.path.join(EPHEMERAL, "tls", f"{NEXT_CERTIFICATE}.pem")) as f:
        next_certificate = ssl.PEM_cert_to_DER_cert(f.read())
    assert certificate_before != next_certificate and served_certificate(front_url) == next_certificate
    assert [front_status(front_url, key) for key in [*client_keys, dropped_client_key]] == [200, 200, 401]
    assert not [key for key in [*client_keys, dropped_client_key] if key in output]
    said = " ".join(output.split())  # the YAML callback folds long messages
    assert "the instances accept vllm_instance_api_key only (the 1 key(s) of before the rotation" in said
    # Its proof (verify.yml, the run's last part) names the KV transport the sandbox declares (tcp) and judges the
    # NIXL throughput against tcp's floor (vllm_verify_min_kv_throughput_mib_s).
    found = re.search(r"KV transport: tcp, throughput ([0-9.]+) MiB/s, floor ([0-9.]+) MiB/s: OK\.",
                      " ".join(output.split()))
    assert found and float(found.group(1)) >= float(found.group(2)) > 0, output[-4000:]
    with open(os.path.join(cloud_dir, FALLBACKS_DEPLOYED), "w") as f:
        f.write(inventory + "\n")
    assert unit_start(prefill_host, "vllm@prefill-0") == prefill_before
    # decode-0 rolled (a changed setting); decode-2 started new, so nothing to roll.
    assert "decode-0 rolled" in output and "decode-2 rolled" not in output, output[-3000:]
    assert unit_start(decode_host, "vllm@decode-0") != decode_0_before
    assert "shutdown_timeout = 45" in decode_host.file("/etc/vllm/decode-0.toml").content_string
    assert decode_host.service("vllm@decode-2").is_running
    assert decode_host.run("ls /var/lib/inferops-vllm/restart-pending").stdout.strip() == ""
    # decode-1: out of the routers first, then stopped and its files gone.
    decode_1 = f"http://{container_ip(DECODE)}:8201"
    assert "Left the inventory and taken out of" in output and decode_1 in output, output[-3000:]
    assert output.index("Left the inventory and taken out of") < \
        output.index("TASK [inferops.vllm.vllm_instance : Stop and disable instances no longer in the inventory]")
    assert not decode_host.file("/etc/vllm/decode-1.toml").exists
    # Its stop was bounded (drained out of rotation first, nothing to wait for), clean and left no process.
    shown = dict(line.split("=", 1) for line in decode_host.check_output(
        "systemctl show -p ActiveState -p Result -p ActiveExitTimestampMonotonic -p InactiveEnterTimestampMonotonic "
        "vllm@decode-1.service").splitlines())
    assert shown["ActiveState"] == "inactive" and shown["Result"] == "success", shown
    stop_seconds = (int(shown["InactiveEnterTimestampMonotonic"]) - int(shown["ActiveExitTimestampMonotonic"])) / 1e6
    assert 0 <= stop_seconds < STOP_BOUND_SECONDS, (stop_seconds, journal_tail(decode_host, "vllm@decode-1"))
    assert not decode_host.run("ps -eo unit= | grep -Fx vllm@decode-1.service").stdout.strip()
    # Both router replicas count decode-0 and decode-2 healthy, and no longer know decode-1.
    urls = {f"http://{container_ip(DECODE)}:{port}" for port in (8200, 8202)}
    for workers in router_workers(router_host):
        healthy = {w["url"] for w in workers["workers"] if w["is_healthy"]}
        assert urls <= healthy, workers
        assert decode_1 not in {w["url"] for w in workers["workers"]}, workers
    # The front has its fallback now (the fallback tests, order 2, use it): the site sends to the cloud's address.
    site = router_host.file("/etc/nginx/sites-enabled/inferops-vllm.conf").content_string
    assert f'set $inferops_fallback_upstream_0 "{container_ip(CLOUD)}:8443";' in site, site[-3000:]


def test_a_rollout_goes_decode_first_stops_at_the_first_failure_and_keeps_the_marks(inventory, decode_host):
    """The routers unreachable (a wrong port): asked for prefill-0, decode-0 and decode-2 in that order, the rollout
    starts with the decode pool (decode before prefill, whatever the order asked), its first instance's first step
    fails, the rollout stops there with the instance, the step and the reason, and no instance was restarted. A
    restart mark (as deploy_pd.yml's handler writes it for a changed running instance) survives the failed run."""
    mark = "/var/lib/inferops-vllm/restart-pending/decode-0"
    decode_host.run(f"mkdir -p {os.path.dirname(mark)} && echo 'decode-0: its configuration, environment, unit or "
                    f"runtime changed while it ran' > {mark}")
    before = {name: unit_start(decode_host, f"vllm@{name}") for name in POOL}
    run = playbook(inventory, "rolling_restart.yml", "-e",
                   json.dumps({"vllm_rollout_instances": ["prefill-0", *POOL]}), "-e", "vllm_router_port=9")
    output = run.stdout + run.stderr
    assert run.returncode != 0
    assert "The rolling restart stopped at decode-0" in output, output[-3000:]
    assert "Take the instance out of the routers' rotation" in output and "127.0.0.1:9" in output
    assert not re.search(r"(prefill-0|decode-0|decode-2) rolled", output), output[-3000:]
    assert {name: unit_start(decode_host, f"vllm@{name}") for name in before} == before
    assert decode_host.file(mark).exists, "the restart mark did not survive the failed run"


# The prefill host refuses every TCP connection from the decode host (a reset, as from a peer that went away).
# Dropped packets instead only look like a slow transfer to NIXL: chaos.py's kv-block waited ~46 s for the path.
RECOMPUTE_PROMPT = "Question: which river flows through Paris? Answer in one word. Answer: The river is called"


def test_a_refused_kv_path_is_recomputed_on_decode_and_the_request_answers(prefill_host, decode_host):
    """Issue #23 point 4, `kv_load_failure_policy: recompute` (the role's default for decode): with the KV path
    refused between the pair, a handoff to decode-0 still answers, decode-0 computed the prompt itself and NIXL
    counted the failed transfer. With the policy `fail` the request would fail; with the path open the KV
    would move and no transfer would fail.

    vLLM 0.32's NIXL keeps a peer that failed once disconnected: decode-0 (and decode-2 if the load reached it
    during the block) recompute every prompt after the path is open again, until they restart (docs/day2.md, a
    broken KV path). The next test rolls both decode instances and proves each one's handoff before it takes
    traffic again. (Not right before the prefill roll: prefill-0 keeps the KV blocks decode never read until
    their lease runs out, ~30 s, and its drain waits for them; on the sandbox a stop right after took 30.9 s
    instead of 6.7 s, in molecule the prefill roll 120 s instead of 74-88 s.)"""
    prefill_url = f"http://{container_ip(PREFILL)}:8100"
    decode_url = f"http://{container_ip(DECODE)}:8200"  # decode-0
    first = prefill_for_remote_decode(prefill_url, MODEL, RECOMPUTE_PROMPT)
    params = first["kv_transfer_params"]
    prompt_tokens = first["usage"]["prompt_tokens"]
    before = metric_samples(f"{decode_url}/metrics")
    rules = peer_block_rules("inferops_test_kv_block", container_ip(DECODE), "reject")
    blocked = prefill_host.run(f"printf '%s' {shlex.quote(rules)} | nft -f -")
    assert blocked.rc == 0, blocked.stderr
    try:
        second = http_json(f"{decode_url}/v1/completions", {
            "model": MODEL, "prompt": RECOMPUTE_PROMPT, "max_tokens": 4, "temperature": 0, "kv_transfer_params": params,
        }, headers=instance_auth(), timeout=120)
    finally:
        removed = prefill_host.run("nft delete table inet inferops_test_kv_block")
    assert removed.rc == 0, removed.stderr
    after = metric_samples(f"{decode_url}/metrics")

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert second["choices"][0]["text"], second
    assert second["usage"]["prompt_tokens"] == prompt_tokens, second
    # Decode computed the whole prompt itself (the load's requests in the window may add to these counters).
    assert delta("vllm:prompt_tokens_by_source_total", source="local_compute") >= prompt_tokens - 1, (before, after)
    assert delta("vllm:nixl_num_failed_transfers_total") >= 1, journal_tail(decode_host, "vllm@decode-0")


def test_the_decode_pool_rolls_under_load(inventory, load, prefill_host, decode_host):
    before = {name: unit_start(decode_host, f"vllm@{name}") for name in POOL}
    prefill_before = unit_start(prefill_host, "vllm@prefill-0")
    run = measured(load, f"rolling_restart.yml of {' and '.join(POOL)}", lambda: playbook(
        inventory, "rolling_restart.yml", "-e", json.dumps({"vllm_rollout_instances": POOL})))
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    for name, was in before.items():
        assert unit_start(decode_host, f"vllm@{name}") != was, f"{name} was not restarted"
        assert f"{name} rolled" in output, output[-3000:]
    assert unit_start(prefill_host, "vllm@prefill-0") == prefill_before
    # Each was proven with a request handed over directly before it went back.
    # (Task headers only: molecule's profile_tasks callback repeats task names in its recap.)
    assert output.count("TASK [inferops.vllm.vllm_rollout : Prove that the instance hands KV over") == 2, output[-3000:]
    # The mark the failed run left (previous test) is gone: this run rolled its instance.
    assert decode_host.run("ls /var/lib/inferops-vllm/restart-pending").stdout.strip() == ""


def test_a_pool_of_one_instance_is_refused_without_allow_downtime(inventory, prefill_host):
    before = unit_start(prefill_host, "vllm@prefill-0")
    # The sandbox's group_vars allow downtime (one instance per pool there); a site does not.
    run = playbook(inventory, "rolling_restart.yml", "-e", '{"vllm_rollout_instances": ["prefill-0"]}',
                   "-e", "vllm_rollout_allow_downtime=false")
    output = run.stdout + run.stderr
    assert run.returncode != 0
    assert "prefill-0 is the only prefill instance" in output, output[-3000:]
    assert "vllm_rollout_allow_downtime=true" in output
    assert unit_start(prefill_host, "vllm@prefill-0") == before


def test_a_restarted_prefill_is_proven_against_every_decode_before_it_takes_traffic(inventory, load, prefill_host):
    """Issue #24 point 4: the sandbox's only prefill instance rolled with vllm_rollout_allow_downtime (an outage: the
    load's requests fail or fall back meanwhile, bounded by the outage's length): restarted, then proven with direct
    handoffs to each decode instance, each judged against the KV throughput floor (the proof fails below it), before
    it is put back into the routers; nothing fails once it is back."""
    before = unit_start(prefill_host, "vllm@prefill-0")
    start = time.perf_counter()
    run = playbook(inventory, "rolling_restart.yml", "-e", '{"vllm_rollout_instances": ["prefill-0"]}',
                   "-e", "vllm_rollout_allow_downtime=true")
    end = time.perf_counter()
    OPERATIONS.append(Operation("rolling_restart.yml of prefill-0, the pool of one (an outage)", start, end,
                                max_failed=load.max_concurrency + load.rate * (end - start), quiet_after=end))
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    assert unit_start(prefill_host, "vllm@prefill-0") != before
    assert "prefill-0 rolled" in output, output[-3000:]
    # After its restart and before it went back: one proof per decode instance (task headers and their items only:
    # the profile_tasks recap repeats task names).
    rolled = output[output.index("TASK [inferops.vllm.vllm_rollout : Restart the instance prefill-0]"):]
    rolled = rolled[:rolled.index("TASK [inferops.vllm.vllm_rollout : Put the instance back")]
    proof = rolled[rolled.index("TASK [inferops.vllm.vllm_rollout : Prove that the instance hands KV over"):]
    assert sorted(re.findall(r"\(item=(decode-\d+)\)", proof)) == sorted(POOL), proof[-2000:]


def test_a_killed_decode_instance_comes_back_into_rotation(load, decode_host, router_host, front_url):
    interval, threshold, timeout = health_settings(router_host)
    pid_before, _since = unit_start(decode_host, "vllm@decode-0")
    # Requests in flight on decode-0 when it dies started a little before the kill.
    start = max(OPERATIONS[-1].end if OPERATIONS else 0.0, time.perf_counter() - 15)
    killed_at = time.perf_counter()
    killed = decode_host.run(kill_vllm_command(["vllm@decode-0.service"]))
    assert killed.rc == 0, killed.stderr
    # systemd starts it again (Restart=on-failure): wait for the new process to answer /health and
    # for both routers to count it healthy again.
    decode_0 = f"http://{container_ip(DECODE)}:8200"
    deadline = time.monotonic() + 600
    # The front's /health meanwhile (issue #24): decode-2 still serves, so a load balancer must keep the front.
    answers = []
    while True:
        answers.append(front_health(front_url))
        pid, _since = unit_start(decode_host, "vllm@decode-0")
        healthy = pid not in ("0", pid_before) and decode_host.run(HEALTH_8200).rc == 0
        states = [{w["url"]: w["is_healthy"] for w in r["workers"]}.get(decode_0) for r in router_workers(router_host)]
        if healthy and all(states):
            break
        assert time.monotonic() < deadline, f"decode-0 not back in rotation after 600 s: pid {pid}, routers {states}"
        time.sleep(2)
    recovered_at = time.perf_counter()
    print(f"front /health while decode-0 was out: {sorted(set(answers))} ({len(answers)} probes)")
    assert (200, "degraded") in answers, answers
    assert {status for status, _body in answers} == {200}, answers
    assert front_health(front_url) == (200, "ok")
    time.sleep(15)  # requests right after its return count too
    print(f"kill -9 of decode-0: back in rotation after {recovered_at - killed_at:.0f} s")
    # Bounded: at most what was in flight on decode-0 when it died plus what the routers sent it before
    # their health checks took it out (interval x threshold + timeout), at the load's rate; none once it
    # is back. Judged with the other windows in the last test.
    window = interval * threshold + timeout
    OPERATIONS.append(Operation(f"kill -9 of decode-0 (health window {window} s)", start, time.perf_counter(),
                                max_failed=load.max_concurrency + load.rate * window, quiet_after=recovered_at))


def test_the_load_lost_no_request_beyond_what_each_operation_may_cost(load):
    """The bench results of the whole file, judged per operation: no failed request during a scale-out,
    a scale-in or a roll, requests sent all along each one, the kill's failures bounded and none after its
    recovery, and no failed request outside the operations."""
    assert OPERATIONS, "no operation ran under the load"
    result = load.stop()
    problems = []
    for op in OPERATIONS:
        failed = [r for r in result.between(op.start, op.end) if r[2]]
        print(f"{op.name}: {summary(result, op.start, op.end)}; failed: {[r[2][:120] for r in failed][:5]}")
        if len(failed) > op.max_failed:
            problems.append(f"{op.name}: {len(failed)} failed requests (at most {op.max_failed:g}): "
                            f"{[r[2][:200] for r in failed][:3]}")
        if op.quiet_after is not None and [r for r in failed if r[0] > op.quiet_after]:
            problems.append(f"{op.name}: requests failed after the instance was back in rotation")
        gap = result.largest_gap(op.start, op.end)
        if gap >= MAX_GAP:
            problems.append(f"{op.name}: the load sent nothing for {gap:.1f} s (bench runs broke?)")
    outside = [r for r in result.requests if r[2] and not any(op.start <= r[0] <= op.end for op in OPERATIONS)]
    if outside:
        problems.append(f"{len(outside)} requests failed outside the operations: {[r[2][:200] for r in outside][:3]}")
    print(f"whole load: {result.completed} completed, {result.failed} failed")
    assert result.completed > 0
    assert not problems, problems
