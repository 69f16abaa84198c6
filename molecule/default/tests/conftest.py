"""Shared helpers for the molecule verify step: hosts through `podman exec` (fast, unlike one
ansible process per check) and plain HTTP from the controller to the containers' addresses."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import testinfra
from prometheus_client.parser import text_string_to_metric_families

# The tests import the benchmarks' helpers (bench_load, sandbox_faults, prom_report) from here.
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

# Overridable so that the same checks run against the sandbox of scripts/sandbox/up.sh.
PREFILL = os.environ.get("INFEROPS_PREFILL_HOST", "molecule-prefill")
DECODE = os.environ.get("INFEROPS_DECODE_HOST", "molecule-decode")
ROUTER = os.environ.get("INFEROPS_ROUTER_HOST", "molecule-router")
# Tests that run a playbook on molecule's own inventory (not against the sandbox of up.sh).
molecule_only = pytest.mark.skipif(not os.environ.get("MOLECULE_EPHEMERAL_DIRECTORY"),
                                   reason="runs inside molecule only (its inventory)")


def pytest_collection_modifyitems(config, items):
    """Tests that change the deployment run after those that only read it, whatever their file names, in the
    order their mark gives (`changes_deployment(order=N)`, pytest.ini): the day-2 operations (order 1) leave the
    deployment as the front's fallback tests (order 2) expect it. A stable sort: within one order, as written."""
    def key(item):
        mark = item.get_closest_marker("changes_deployment")
        if mark is None:
            return (0, 0)
        order = mark.kwargs.get("order", mark.args[0] if mark.args else None)
        assert isinstance(order, int), f"{item.nodeid}: changes_deployment needs order=N (pytest.ini)"
        return (1, order)
    items.sort(key=key)
    # scripts/test.sh --skip NAME (INFEROPS_VERIFY_SKIP: test file names without test_ and .py, space-separated,
    # e.g. "day2 fallback"): the fast path for a change those files do not concern. CI runs everything.
    skip = set(os.environ.get("INFEROPS_VERIFY_SKIP", "").split())
    if skip:
        left_out = [item for item in items if item.path.stem.removeprefix("test_") in skip]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [item for item in items if item not in left_out]
            print(f"\nINFEROPS_VERIFY_SKIP={' '.join(sorted(skip))}: {len(left_out)} tests left out")


def front_ca() -> str | None:
    """The CA of the front's certificate: molecule's prepare step makes one (TLS on); the sandbox of
    up.sh serves plain HTTP (none), unless INFEROPS_FRONT_CA names one."""
    ephemeral = os.environ.get("MOLECULE_EPHEMERAL_DIRECTORY", "/nonexistent")
    path = os.environ.get("INFEROPS_FRONT_CA") or os.path.join(ephemeral, "tls", "ca.pem")
    return path if os.path.isfile(path) else None


def front_health(front_url: str) -> tuple[int, str]:
    """(status, body) of the front's key-less /health: 200 "ok" / "degraded" or 503 "unavailable" (issue #24)."""
    import ssl
    import urllib.error
    import urllib.request

    ca = front_ca()
    context = ssl.create_default_context(cafile=ca) if ca else None
    try:
        with urllib.request.urlopen(f"{front_url}/health", timeout=10, context=context) as resp:
            return resp.status, resp.read().decode(errors="replace").strip()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace").strip()


def secret(name: str) -> str:
    """A sandbox key, as the inventory's password lookups made it (scripts/sandbox/lib.sh)."""
    with open(os.path.join(os.environ["INFEROPS_SECRETS_DIR"], name)) as f:
        return f.read().split()[0]


# The only variable of scripts/sandbox/lib.sh's environment that the sandbox inventory reads (its group_vars/all/
# sandbox.yml derives every controller path from it, with a default): issue #28.
INVENTORY_ENVIRONMENT = ("INFEROPS_CACHE_DIR",)


def playbook_environment() -> dict[str, str]:
    """This process's environment without the INFEROPS_* variables scripts/test.sh exports for the tests and
    molecule.yml: a playbook run with it proves that the sandbox's group_vars need none of them, as when a user runs
    `ansible-playbook playbooks/<x>.yml -i inventories/sandbox` in a new shell after up.sh. Molecule's own
    variables (its inventory's addresses) and PATH stay."""
    return {key: value for key, value in os.environ.items()
            if not key.startswith("INFEROPS_") or key in INVENTORY_ENVIRONMENT}


def deploy_playbook(inventory: str, name: str, *args: str, timeout: int = 1800) -> subprocess.CompletedProcess:
    """ansible-playbook of this checkout's playbooks/NAME (NAME with a slash: that path in the checkout, e.g.
    molecule/default/cloud.yml) with molecule's ansible.cfg, output captured, in
    playbook_environment() (no INFEROPS_* variable but the cache directory). Each run's output also goes to
    INFEROPS_TEST_LOG_DIR (scripts/test.sh sets it) with its wall time, so that the test run ends with every
    playbook's task-timing recap, passing or not."""
    project = os.environ.get("MOLECULE_PROJECT_DIRECTORY", "")
    env = playbook_environment()
    cfg = os.path.join(os.environ.get("MOLECULE_EPHEMERAL_DIRECTORY", "/nonexistent"), "ansible.cfg")
    if os.path.isfile(cfg):
        env["ANSIBLE_CONFIG"] = cfg
    started = time.monotonic()
    path = os.path.join(project, name) if "/" in name else os.path.join(project, "playbooks", name)
    run = subprocess.run(["ansible-playbook", "-i", inventory, path, *args],
                         cwd=project, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    log_dir = os.environ.get("INFEROPS_TEST_LOG_DIR")
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
        number = len([f for f in os.listdir(log_dir) if f.endswith(".log")]) + 1
        with open(os.path.join(log_dir, f"{number:02d}-{os.path.basename(name)}.log"), "w") as log:
            log.write(f"# ansible-playbook {name} {' '.join(args)}: rc {run.returncode}, "
                      f"{time.monotonic() - started:.0f} s\n{run.stdout}{run.stderr}")
    return run


def task_blocks(output: str, name: str, kind: str = "TASK") -> list[str]:
    """What a task (``kind`` TASK) or a handler (``RUNNING HANDLER``) named ``name`` (``inferops.vllm.role : Name``
    for a role's) reported in an ansible-playbook output: one block per time it ran, each up to the next task or
    handler, with its lines per host and item."""
    blocks = re.split(r"\n(?=(?:TASK|RUNNING HANDLER) \[)", "\n" + output)
    return [block.partition("\n")[2] for block in blocks if block.startswith(f"{kind} [{name}]")]


def task_result(output: str, task: str, host: str) -> str | None:
    """What a task of this collection's roles (``role : Name``) reported for a host: changed, ok, skipping, ... or
    None. A looped task counts as changed when any item changed."""
    results = set()
    for block in task_blocks(output, f"inferops.vllm.{task}"):
        results |= set(re.findall(rf"^(\w+): \[{re.escape(host)}\]", block, re.M))
    return "changed" if "changed" in results else (min(results) if results else None)


def inline_playbook(text: str, tmp_path, *args: str) -> subprocess.CompletedProcess:
    """A playbook of the test's own (YAML `text`) against molecule's inventory, as deploy_playbook runs ours."""
    path = tmp_path / "inline.yml"
    path.write_text(text)
    env = playbook_environment()
    cfg = os.path.join(os.environ.get("MOLECULE_EPHEMERAL_DIRECTORY", "/nonexistent"), "ansible.cfg")
    if os.path.isfile(cfg):
        env["ANSIBLE_CONFIG"] = cfg
    inventory = os.path.join(os.environ.get("MOLECULE_EPHEMERAL_DIRECTORY", "/nonexistent"), "inventory")
    return subprocess.run(["ansible-playbook", "-i", inventory, str(path), *args],
                          cwd=os.environ.get("MOLECULE_PROJECT_DIRECTORY", None), env=env, capture_output=True,
                          text=True, timeout=600, check=False)


def cloud_deployed(timeout: float = 1800) -> str:
    """The directory of the test "cloud" (molecule/default/cloud.yml: its CA, key and fallbacks.yml) once its
    deployment finished; prepare.yml starts it in the background, a run against another inventory deploys it
    here. Fails with the deployment's log when it failed."""
    project = os.environ.get("MOLECULE_PROJECT_DIRECTORY", "")
    ephemeral = os.environ.get("MOLECULE_EPHEMERAL_DIRECTORY", "")
    cloud_dir = os.path.join(ephemeral, "cloud")
    rc_file, log_file = os.path.join(cloud_dir, "deploy.rc"), os.path.join(cloud_dir, "deploy.log")
    if not os.path.exists(log_file):  # not started by prepare.yml: now
        env = dict(os.environ)
        cfg = os.path.join(ephemeral, "ansible.cfg")
        if os.path.isfile(cfg):
            env["ANSIBLE_CONFIG"] = cfg
        os.makedirs(cloud_dir, mode=0o700, exist_ok=True)
        with open(log_file, "w") as log:
            playbook = os.path.join(project, "molecule", "default", "cloud.yml")
            rc = subprocess.run(["ansible-playbook", "-i", os.path.join(ephemeral, "inventory"), playbook,
                                 "-e", f"cloud_dir={cloud_dir}"],
                                cwd=project, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                                check=False).returncode
        with open(rc_file, "w") as f:
            f.write(f"{rc}\n")
    deadline = time.monotonic() + timeout
    while not os.path.exists(rc_file):
        assert time.monotonic() < deadline, f"molecule/default/cloud.yml not finished within {timeout} s"
        time.sleep(5)
    with open(rc_file) as f, open(log_file) as log:
        assert f.read().strip() == "0", log.read()[-8000:]
    return cloud_dir


# Written by the first deploy_pd.yml run that gave the front the cloud as its fallback (the day-2 run does,
# under load); the fallback tests deploy it themselves when no run did (a run that skips the day-2 file).
FALLBACKS_DEPLOYED = "front-has-fallbacks"


def container_ip(name: str) -> str:
    out = subprocess.run(
        ["podman", "inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", name],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    assert out, f"container {name} has no IP address"
    return out


def http_json(url: str, body: dict | None = None, timeout: float = 180, headers: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def instance_auth(key: str | None = None) -> dict:
    """The header the instances require on every route but /health (roles/vllm_instance's inferops_vllm_auth.py):
    the sandbox's instance key unless ``key`` is given."""
    return {"Authorization": f"Bearer {key or secret('instance_api_key')}"}


def prefill_for_remote_decode(prefill_url: str, model: str, prompt: str) -> dict:
    """Step 1 of a handoff, as a PD proxy does it: prefill computes the prompt (one token) and keeps its KV for a
    decode instance. Returns prefill's answer; its `kv_transfer_params` go with the request to decode."""
    first = http_json(f"{prefill_url}/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                               "remote_block_ids": None, "remote_host": None, "remote_port": None},
    }, headers=instance_auth())
    params = first.get("kv_transfer_params")
    assert params and params.get("do_remote_prefill") is True, first
    return first


def metric_samples(url: str, key: str | None = None) -> dict[tuple[str, tuple], float]:
    """All samples of an instance's /metrics page (sent with the instance key, or ``key``), keyed by (name,
    sorted labels without model/engine)."""
    with urllib.request.urlopen(urllib.request.Request(url, headers=instance_auth(key)), timeout=30) as resp:
        text = resp.read().decode()
    out: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine")))
            out[(s.name, labels)] = out.get((s.name, labels), 0.0) + s.value
    return out


# CPU seconds (user + system) of every process that systemd counts in a unit, read in the host.
_UNIT_CPU_SCRIPT = r"""
import os, subprocess, sys
unit = sys.argv[1]
ticks = 0
for line in subprocess.run(["ps", "-eo", "pid=,unit="], capture_output=True, text=True, check=True).stdout.splitlines():
    pid, _, owner = line.strip().partition(" ")
    if owner.strip() != unit:
        continue
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        continue
    ticks += int(fields[11]) + int(fields[12])
print(ticks / os.sysconf("SC_CLK_TCK"))
"""


def unit_cpu_seconds(host, unit: str) -> float:
    return float(host.check_output("python3 -c %s %s", _UNIT_CPU_SCRIPT, unit))


def unit_start(host, unit: str) -> tuple[str, str]:
    """(MainPID, ActiveEnterTimestampMonotonic) of a unit: both change when it restarts."""
    out = host.check_output(f"systemctl show -p MainPID -p ActiveEnterTimestampMonotonic {unit}")
    values = dict(line.split("=", 1) for line in out.splitlines())
    return values["MainPID"], values["ActiveEnterTimestampMonotonic"]


def vllm_child(host, unit: str) -> tuple[str, list[str], str]:
    """(MainPID, its argv, the pid of its one child) of an instance's unit: the launcher is the unit's main
    process and runs vLLM as its only child (it reaps what vLLM leaves behind when it stops)."""
    pid = host.check_output(f"systemctl show -p MainPID --value {unit}")
    assert pid != "0", unit
    launcher = host.file(f"/proc/{pid}/cmdline").content_string.split("\0")
    children = host.check_output(f"ps -o pid= --ppid {pid}").split()
    assert len(children) == 1, children
    return pid, launcher, children[0]


def router_workers(router_host) -> list[dict]:
    """Each vllm-router replica's worker list (its admin route /workers on the router host's loopback)."""
    out = []
    for port in (8300, 8301):
        body = router_host.check_output(
            f"python3 -c \"import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:{port}/workers').read().decode())\"")
        out.append(json.loads(body))
    return out


def journal_tail(host, unit: str, lines: int = 60) -> str:
    """The unit's last journal lines, for the message of a failed test."""
    return host.run(f"journalctl -u {unit} -n {lines} --no-pager -o cat").stdout


@pytest.fixture(scope="session")
def prefill_host():
    return testinfra.get_host(f"podman://{PREFILL}")


@pytest.fixture(scope="session")
def decode_host():
    return testinfra.get_host(f"podman://{DECODE}")


@pytest.fixture(scope="session")
def router_host():
    return testinfra.get_host(f"podman://{ROUTER}")


@pytest.fixture(scope="session")
def front_url():
    return f"{'https' if front_ca() else 'http'}://{container_ip(ROUTER)}:8000"


@pytest.fixture(scope="session")
def prefill_url():
    return f"http://{container_ip(PREFILL)}:8100"


@pytest.fixture(scope="session")
def decode_url():
    return f"http://{container_ip(DECODE)}:8200"


def instance_urls(host, address: str) -> dict[str, str]:
    """{instance name: API URL} of every instance the host runs (its /etc/vllm/*.toml, as the role wrote them):
    converge gives the decode host two, and the front may send a request to either."""
    out = {}
    for path in sorted(host.check_output("ls /etc/vllm").split()):
        if path.endswith(".toml"):
            port = re.search(r"^port = (\d+)$", host.file(f"/etc/vllm/{path}").content_string, re.M)
            assert port, f"/etc/vllm/{path} has no port"
            out[path[:-len(".toml")]] = f"http://{address}:{port.group(1)}"
    assert out, "no instance config in /etc/vllm"
    return out


@pytest.fixture
def decode_urls(decode_host):
    """Every decode instance's URL (read afresh: the day-2 tests change the pool)."""
    return instance_urls(decode_host, container_ip(DECODE))
