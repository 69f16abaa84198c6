"""Day-2 operations under steady client load (`vllm bench serve`, the real client): a decode
instance added, the decode pool rolled with playbooks/rolling_restart.yml, a one-instance pool
refused, a decode instance killed with SIGKILL.

These tests change the deployment (they add decode-1, a third vLLM process, to the decode host), so
this file's name sorts it after the others; the tests run in the order written. The second decode
instance lives on the existing decode host, on the same core as decode-0: a second container
would add minutes of provisioning for the same property (the other instances' files, and so their
processes, do not change when the pool grows).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import tomllib
import yaml
from conftest import DECODE, PREFILL, container_ip, front_ca, secret

PROJECT = os.environ.get("MOLECULE_PROJECT_DIRECTORY", "")
EPHEMERAL = os.environ.get("MOLECULE_EPHEMERAL_DIRECTORY", "")
sys.path.insert(0, os.path.join(PROJECT, "benchmarks"))

from bench_load import BenchLoad, summary  # noqa: E402

pytestmark = pytest.mark.skipif(not (PROJECT and EPHEMERAL), reason="runs inside molecule only (its inventory)")

MODEL = "smollm2-135m-instruct"
DECODE_1 = {"name": "decode-1", "port": 8201, "kv_transfer_port": 5701, "cpus": "1"}
# The load covers an operation when no stretch of it went without a request sent for this long: a chain
# of bench runs that broke leaves holes of 30 s and more; at 0.5 req/s on 2 cores busy starting a vLLM
# the client itself was measured sending nothing for 11.5 s.
MAX_GAP = 20
HEALTH_8200 = "python3 -c \"import urllib.request; urllib.request.urlopen('http://127.0.0.1:8200/health', timeout=5)\""


def unit_start(host, unit: str) -> tuple[str, str]:
    """(MainPID, ActiveEnterTimestampMonotonic) of a unit: both change when it restarts."""
    out = host.check_output(f"systemctl show -p MainPID -p ActiveEnterTimestampMonotonic {unit}")
    values = dict(line.split("=", 1) for line in out.splitlines())
    return values["MainPID"], values["ActiveEnterTimestampMonotonic"]


def router_workers(router_host) -> list[dict]:
    """Each router replica's worker list (its admin route on the router's loopback)."""
    out = []
    for port in (8300, 8301):
        body = router_host.check_output(
            f"python3 -c \"import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:{port}/workers').read().decode())\"")
        out.append(json.loads(body))
    return out


@pytest.fixture(scope="module")
def inventory(tmp_path_factory):
    """Molecule's inventory with decode-1 added to the decode host's instances."""
    src = os.path.join(EPHEMERAL, "inventory")
    dst = tmp_path_factory.mktemp("inventory") / "inventory"
    shutil.copytree(src, dst, symlinks=False)
    # The decode group's instances (group_vars/decode.yml, unless the host sets its own) plus decode-1.
    host_vars = dst / "host_vars" / f"{DECODE}.yml"
    data = yaml.safe_load(host_vars.read_text()) or {}
    instances = data.get("vllm_instance_instances") or \
        yaml.safe_load((dst / "group_vars" / "decode.yml").read_text())["vllm_instance_instances"]
    assert DECODE_1["name"] not in [i["name"] for i in instances]
    data["vllm_instance_instances"] = instances + [DECODE_1]
    host_vars.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(dst)


def playbook(inventory: str, name: str, *args: str, timeout: int = 1800) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    cfg = os.path.join(EPHEMERAL, "ansible.cfg")
    if os.path.isfile(cfg):
        env["ANSIBLE_CONFIG"] = cfg
    return subprocess.run(["ansible-playbook", "-i", inventory, os.path.join(PROJECT, "playbooks", name), *args],
                          cwd=PROJECT, env=env, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def load_factory(prefill_host, front_url):
    """A steady load from the prefill container's vLLM venv (its `vllm bench serve`) through the front."""
    config = tomllib.loads(prefill_host.file("/etc/vllm/prefill-0.toml").content_string)
    tokenizer = config["model"]["name"]

    def make() -> BenchLoad:
        # Shorter runs than the benchmark's: after an operation the test waits for the runs still
        # sending, up to one window.
        return BenchLoad(PREFILL, front_url, MODEL, tokenizer, secret("client_api_key"), ca_file=front_ca(),
                         window=70, overlap=30)
    return make


def health_settings(router_host) -> tuple[int, int, int]:
    unit = router_host.file("/etc/systemd/system/vllm-router@.service").content_string
    values = [int(re.search(rf"--{flag} (\d+)", unit).group(1))
              for flag in ("health-check-interval-secs", "health-failure-threshold", "health-check-timeout-secs")]
    return values[0], values[1], values[2]


def test_a_decode_instance_is_added_under_load_without_restarting_the_others(
        inventory, load_factory, prefill_host, decode_host, router_host):
    before = {("prefill", "prefill-0"): unit_start(prefill_host, "vllm@prefill-0"),
              ("decode", "decode-0"): unit_start(decode_host, "vllm@decode-0")}
    load = load_factory()
    start = load.start()
    run = playbook(inventory, "deploy_pd.yml")
    end = time.perf_counter()
    result = load.stop()
    print(f"scale-out: {summary(result, start, end)}")
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert result.failed == 0, result.errors()[:5]
    assert result.largest_gap(start, end) < MAX_GAP, "the load did not cover the whole run"
    # The instances that ran were not restarted: their files did not change.
    assert unit_start(prefill_host, "vllm@prefill-0") == before[("prefill", "prefill-0")]
    assert unit_start(decode_host, "vllm@decode-0") == before[("decode", "decode-0")]
    assert decode_host.service("vllm@decode-1").is_running
    # Both router replicas know the new instance, and count it healthy.
    decode_1 = f"http://{container_ip(DECODE)}:8201"
    for workers in router_workers(router_host):
        urls = {w["url"]: w for w in workers["workers"]}
        assert decode_1 in urls and urls[decode_1]["is_healthy"], workers


def test_the_decode_pool_rolls_under_load_with_no_failed_request(inventory, load_factory, prefill_host, decode_host):
    before = {name: unit_start(decode_host, f"vllm@{name}") for name in ("decode-0", "decode-1")}
    prefill_before = unit_start(prefill_host, "vllm@prefill-0")
    load = load_factory()
    start = load.start()
    run = playbook(inventory, "rolling_restart.yml", "-e", '{"vllm_rollout_instances": ["decode-0", "decode-1"]}')
    end = time.perf_counter()
    result = load.stop()
    print(f"rolling restart of decode-0 and decode-1: {summary(result, start, end)}")
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    # The bench JSON: no failed request, and requests all along the roll.
    assert result.failed == 0, result.errors()[:5]
    assert result.completed > 0
    assert result.largest_gap(start, end) < MAX_GAP, "the load did not cover the whole roll"
    for name, was in before.items():
        assert unit_start(decode_host, f"vllm@{name}") != was, f"{name} was not restarted"
        assert f"{name} rolled" in output, output[-3000:]
    assert unit_start(prefill_host, "vllm@prefill-0") == prefill_before
    # Each was proven with a request handed over directly before it went back.
    assert output.count("Prove that the instance hands KV over") == 2, output[-3000:]


def test_a_changed_setting_rolls_through_deploy_pd_under_load(inventory, load_factory, prefill_host, decode_host):
    """Re-running deploy_pd.yml with a setting changed for decode-1 only: decode-1 is marked while it runs and
    rolled at the end of the run (out of the routers, drained, restarted, proven, put back), nothing else
    restarts, no request fails, and no mark is left."""
    host_vars = os.path.join(inventory, "host_vars", f"{DECODE}.yml")
    with open(host_vars) as f:
        data = yaml.safe_load(f)
    for inst in data["vllm_instance_instances"]:
        if inst["name"] == "decode-1":
            inst["overrides"] = {"shutdown_timeout": 45}
    with open(host_vars, "w") as f:
        yaml.safe_dump(data, f, sort_keys=False)
    before = {name: unit_start(decode_host, f"vllm@{name}") for name in ("decode-0", "decode-1")}
    prefill_before = unit_start(prefill_host, "vllm@prefill-0")
    load = load_factory()
    start = load.start()
    run = playbook(inventory, "deploy_pd.yml")
    end = time.perf_counter()
    result = load.stop()
    print(f"deploy_pd.yml with decode-1's shutdown_timeout changed: {summary(result, start, end)}")
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    assert result.failed == 0, result.errors()[:5]
    assert result.largest_gap(start, end) < MAX_GAP, "the load did not cover the whole run"
    assert "decode-1 rolled" in output and "decode-0 rolled" not in output, output[-3000:]
    assert unit_start(decode_host, "vllm@decode-1") != before["decode-1"]
    assert unit_start(decode_host, "vllm@decode-0") == before["decode-0"]
    assert unit_start(prefill_host, "vllm@prefill-0") == prefill_before
    assert "shutdown_timeout = 45" in decode_host.file("/etc/vllm/decode-1.toml").content_string
    assert decode_host.run("ls /var/lib/inferops-vllm/restart-pending").stdout.strip() == ""


def test_a_rollout_stops_at_the_first_instance_that_fails_and_says_why(inventory, decode_host):
    """The routers unreachable (a wrong port): the first instance's first step fails, the rollout stops there
    with the instance, the step and the reason, and no instance was restarted."""
    before = {name: unit_start(decode_host, f"vllm@{name}") for name in ("decode-0", "decode-1")}
    run = playbook(inventory, "rolling_restart.yml", "-e", '{"vllm_rollout_instances": ["decode-0", "decode-1"]}',
                   "-e", "vllm_router_port=9")
    output = run.stdout + run.stderr
    assert run.returncode != 0
    assert "The rolling restart stopped at decode-0" in output, output[-3000:]
    assert "Take the instance out of the routers' rotation" in output and "127.0.0.1:9" in output
    assert "decode-1 rolled" not in output and "decode-0 rolled" not in output
    assert {name: unit_start(decode_host, f"vllm@{name}") for name in before} == before


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


def test_a_killed_decode_instance_costs_a_bounded_number_of_requests(load_factory, decode_host, router_host):
    interval, threshold, timeout = health_settings(router_host)
    load = load_factory()
    start = load.start()
    pid_before, _since = unit_start(decode_host, "vllm@decode-0")
    killed_at = time.perf_counter()
    decode_host.run("systemctl kill -s KILL vllm@decode-0")
    # systemd starts it again (Restart=on-failure): wait for the new process to answer /health and
    # for both routers to count it healthy again.
    decode_0 = f"http://{container_ip(DECODE)}:8200"
    deadline = time.monotonic() + 600
    while True:
        pid, _since = unit_start(decode_host, "vllm@decode-0")
        healthy = pid not in ("0", pid_before) and decode_host.run(HEALTH_8200).rc == 0
        states = [{w["url"]: w["is_healthy"] for w in r["workers"]}.get(decode_0) for r in router_workers(router_host)]
        if healthy and all(states):
            break
        assert time.monotonic() < deadline, f"decode-0 not back in rotation after 600 s: pid {pid}, routers {states}"
        time.sleep(2)
    recovered_at = time.perf_counter()
    time.sleep(15)  # requests right after its return count too
    end = time.perf_counter()
    result = load.stop()
    failed = [r for r in result.between(start, end) if r[2]]
    print(f"kill -9 of decode-0: back in rotation after {recovered_at - killed_at:.0f} s; "
          f"{len(failed)} failed requests: {[r[2][:120] for r in failed][:5]}; {summary(result, start, end)}")
    # Bounded: at most what was in flight on decode-0 when it died plus what the routers sent it before
    # their health checks took it out (interval x threshold + timeout), at the load's rate.
    window = interval * threshold + timeout
    bound = load.max_concurrency + load.rate * window
    assert len(failed) <= bound, f"{len(failed)} failed > {bound:.1f} (health window {window} s)"
    # And none after it came back.
    assert not [r for r in failed if r[0] > recovered_at]
