"""Verify the PD pair that deploy_pd.yml deployed: the service, its files, its launcher, and a
real KV handoff from prefill to decode over NIXL."""

from __future__ import annotations

import json
import re
import time

import pytest
from conftest import (
    http_json,
    inline_playbook,
    instance_auth,
    metric_samples,
    molecule_only,
    prefill_for_remote_decode,
    unit_cpu_seconds,
    vllm_child,
)

LAUNCH = "/opt/vllm/venv/bin/python /usr/local/lib/inferops-vllm/inferops_vllm_launch.py --check --config"

MODEL = "smollm2-135m-instruct"
PROMPT = "Question: what is the capital of France? Answer in one word. Answer: The capital of France is"

INSTANCES = [
    ("prefill_host", "prefill-0", 8100, 5600),
    ("decode_host", "decode-0", 8200, 5700),
    ("decode_host", "decode-1", 8201, 5701),
]


@pytest.mark.parametrize(("host_fixture", "name", "port", "side_port"), INSTANCES)
def test_unit_active_and_listening(request, host_fixture, name, port, side_port):
    host = request.getfixturevalue(host_fixture)
    svc = host.service(f"vllm@{name}")
    assert svc.is_running
    assert svc.is_enabled
    assert host.socket(f"tcp://0.0.0.0:{port}").is_listening
    # NIXL's side channel listens on the host's routable address for the peer's handshake.
    listening = host.check_output("ss -Htln")
    assert f":{side_port} " in listening, listening


@pytest.mark.parametrize(("host_fixture", "name", "port", "side_port"), INSTANCES)
def test_process_runs_as_vllm_user_without_key_in_argv(request, host_fixture, name, port, side_port):
    host = request.getfixturevalue(host_fixture)
    # The unit's main process is the launcher, which runs vLLM as its child.
    pid, launcher, child = vllm_child(host, f"vllm@{name}")
    assert host.check_output(f"ps -o user= -p {pid}") == "vllm"
    assert launcher[1] == "/usr/local/lib/inferops-vllm/inferops_vllm_launch.py", launcher
    assert host.check_output(f"ps -o user= -p {child}") == "vllm"
    argv = host.file(f"/proc/{child}/cmdline").content_string.split("\0")
    # The venv's python running the venv's `vllm serve` entry point, with this instance's port.
    # (the interpreter is the one of the versioned venv the /opt/vllm/venv link points at: python_venv)
    assert re.fullmatch(r"/opt/vllm/venv(\.d/[0-9a-f]+)?/bin/python3(\.\d+)?", argv[0]), argv
    assert argv[1:3] == ["/opt/vllm/venv/bin/vllm", "serve"], argv
    assert argv[argv.index("--port") + 1] == str(port), argv
    assert "--api-key" not in argv and "--api-key" not in launcher
    assert "--kv-transfer-config" in argv


@pytest.mark.parametrize(("host_fixture", "name", "port", "side_port"), INSTANCES)
def test_config_files_modes_and_owners(request, host_fixture, name, port, side_port):
    host = request.getfixturevalue(host_fixture)
    d = host.file("/etc/vllm")
    assert d.is_directory and d.user == "root" and d.group == "vllm" and d.mode == 0o750
    for suffix in ("toml", "env"):
        f = host.file(f"/etc/vllm/{name}.{suffix}")
        assert f.is_file and f.user == "root" and f.group == "vllm" and f.mode == 0o640, suffix
    launcher = host.file("/usr/local/lib/inferops-vllm/inferops_vllm_launch.py")
    assert launcher.user == "root" and launcher.mode == 0o755
    # The TOML's schema and what vLLM accepts, the modules the controller's preflight imports, beside the launcher
    # (which imports the schema by name from its directory).
    schema = host.file("/usr/local/lib/inferops-vllm/_vllm_instance_schema.py")
    assert schema.user == "root" and schema.mode == 0o644 and "def validate(" in schema.content_string
    vocabulary = host.file("/usr/local/lib/inferops-vllm/_vllm_vocabulary.py")
    assert vocabulary.user == "root" and vocabulary.mode == 0o644 and "KV_CACHE_DTYPES" in vocabulary.content_string
    venv = host.file("/opt/vllm/venv")
    assert venv.user == "root"
    unit = host.file("/etc/systemd/system/vllm@.service")
    assert unit.mode == 0o644
    assert "ProtectSystem=strict" in unit.content_string
    assert "KillMode=mixed" in unit.content_string


def test_config_maps_roles_to_kv_roles(prefill_host, decode_host):
    p = prefill_host.file("/etc/vllm/prefill-0.toml").content_string
    d = decode_host.file("/etc/vllm/decode-0.toml").content_string
    assert 'role = "prefill"' in p and 'role = "decode"' in d
    for text in (p, d):
        for section in ("[server]", "[model]", "[kv_cache]", "[pd_disaggregation]"):
            assert section in text
        assert 'kv_transfer_backend = "nixl"' in text
    # No peer lists: only the router needs them, and a new peer host must restart no instance.
    assert "prefill_instances" not in p + d and "decode_instances" not in p + d
    # The weights each side loads (issue #24): the same copy, whose marker is in the model directory the instances
    # load, and no copy left half made beside it.
    identities = {re.search(r'^identity = "copy ([0-9a-f]{64})"$', text, re.MULTILINE).group(1) for text in (p, d)}
    assert len(identities) == 1, identities
    (fingerprint,) = identities
    for host, text in ((prefill_host, p), (decode_host, d)):
        model_dir = re.search(r'^name = "([^"]+)"$', text, re.MULTILINE).group(1)
        assert host.file(f"{model_dir}/.inferops-model-{fingerprint}").exists
        assert not host.file(f"{model_dir}.inferops-copy").exists
        assert not host.file(f"{model_dir}.inferops-previous").exists
    check = prefill_host.run(f"{LAUNCH} /etc/vllm/prefill-0.toml")
    assert check.rc == 0, check.stderr
    assert '"kv_role":"kv_producer"' in check.stdout
    assert "kv_load_failure_policy" not in check.stdout
    check = decode_host.run(f"{LAUNCH} /etc/vllm/decode-0.toml")
    assert check.rc == 0, check.stderr
    assert '"kv_role":"kv_consumer"' in check.stdout
    # Decode recomputes a prompt whose KV failed to load instead of answering 500.
    assert '"kv_load_failure_policy":"recompute"' in check.stdout
    # Stop drains: vLLM refuses new requests and gives running ones the shutdown timeout, and systemd
    # waits that long plus the launcher's reaping.
    for host, name in ((prefill_host, "prefill-0"), (decode_host, "decode-0")):
        out = host.run(f"{LAUNCH} /etc/vllm/{name}.toml").stdout
        timeout = int(out.split("--shutdown-timeout ", 1)[1].split()[0])
        assert timeout > 0, out
        shown = host.check_output(f"systemctl show -p TimeoutStopUSec --value vllm@{name}")
        assert _seconds(shown) == timeout + 15, (name, shown, timeout)


def test_the_sandbox_carries_kv_over_tcp_as_its_inventory_says(prefill_host, decode_host):
    """vllm_instance_kv_transport: tcp (inventories/sandbox): each config says so in [kv_fabric], and the launcher
    sets no UCX variable, so UCX picks TCP itself as on the verified handoff (no RDMA in the containers)."""
    for host, name in ((prefill_host, "prefill-0"), (decode_host, "decode-0")):
        config = host.file(f"/etc/vllm/{name}.toml").content_string
        assert '[kv_fabric]\n' in config and '\ntransport = "tcp"\n' in config, config
        check = host.run(f"{LAUNCH} /etc/vllm/{name}.toml")
        assert check.rc == 0, check.stderr
        assert "env: UCX_" not in check.stdout, check.stdout


def _seconds(shown: str) -> int:
    """systemd's "1min 15s" (or "75s", "2min") in seconds."""
    minutes = re.search(r"(\d+)min", shown)
    seconds = re.search(r"(\d+)s\b", shown)
    return (int(minutes.group(1)) * 60 if minutes else 0) + (int(seconds.group(1)) if seconds else 0)


def test_launcher_rejects_a_broken_config_on_the_host(prefill_host):
    bad = (
        '[server]\nhost = "0.0.0.0"\nport = 8100\n'
        '[model]\nname = "/var/lib/vllm/models/x"\n'
        '[kv_cache]\nquant_dtype = "2bit"\nswap_space = 4\n'
        '[pd_disaggregation]\nenabled = true\nrole = "prefill"\nkv_transfer_backend = "nccl"\n'
        'side_channel_host = "10.0.0.1"\nkv_transfer_port = 5600\n'
    )
    prefill_host.run(f"cat > /tmp/broken.toml <<'EOF'\n{bad}EOF")
    res = prefill_host.run(f"{LAUNCH} /tmp/broken.toml")
    assert res.rc == 2
    for expected in ("kv_cache.quant_dtype", "kv_cache.swap_space", "pd_disaggregation.kv_transfer_backend", "nixl"):
        assert expected in res.stderr, res.stderr


def test_health_version_and_model(prefill_url, decode_url):
    for url in (prefill_url, decode_url):
        assert http_json(f"{url}/version", headers=instance_auth())["version"] == "0.32.0"
        models = [m["id"] for m in http_json(f"{url}/v1/models", headers=instance_auth())["data"]]
        assert models == [MODEL]


def test_pd_handoff_moves_kv_from_prefill_to_decode(prefill_url, decode_url):
    before_p = metric_samples(f"{prefill_url}/metrics")
    before_d = metric_samples(f"{decode_url}/metrics")

    # Step 1, as a PD proxy does it: prefill computes the prompt and keeps its KV for decode.
    first = prefill_for_remote_decode(prefill_url, MODEL, PROMPT)
    params = first["kv_transfer_params"]
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert prompt_tokens > 8

    # Step 2: decode pulls that KV over NIXL and generates.
    second = http_json(f"{decode_url}/v1/completions", {
        "model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "kv_transfer_params": params,
    }, headers=instance_auth())
    pd_text = second["choices"][0]["text"]

    after_p = metric_samples(f"{prefill_url}/metrics")
    after_d = metric_samples(f"{decode_url}/metrics")

    def delta(after, before, name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    src = "vllm:prompt_tokens_by_source_total"
    # Decode received the prompt's KV from prefill and recomputed (almost) nothing itself.
    external = delta(after_d, before_d, src, source="external_kv_transfer")
    local_d = delta(after_d, before_d, src, source="local_compute")
    assert external >= prompt_tokens - 1, (external, local_d, prompt_tokens)
    assert local_d <= 1, (external, local_d, prompt_tokens)
    # Prefill computed the prompt.
    assert delta(after_p, before_p, src, source="local_compute") >= prompt_tokens - 1
    # NIXL moved it, without failures.
    assert delta(after_d, before_d, "vllm:nixl_xfer_time_seconds_count") >= 1
    assert after_d.get(("vllm:nixl_num_failed_transfers_total", ()), 0.0) == 0.0

    # The disaggregated answer equals the answer of a colocated request.
    direct = http_json(f"{decode_url}/v1/completions", {
        "model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
    }, headers=instance_auth())
    assert pd_text == direct["choices"][0]["text"]
    assert "Paris" in pd_text


# roles/vllm_install's default on the cpu variant (vllm_install_nixl_progress_delay_us).
NIXL_DELAY_US = 1000
NIXL_API = "/opt/vllm/venv/lib/python3.11/site-packages/nixl_cu12/_api.py"
IDLE_SECONDS = 20
# One core is 1.0. An idle worker whose NIXL progress thread spins without pause uses 0.45-1.0 of a
# core on our machines; with the delay the whole instance measured ~0.07.
IDLE_BOUND = 0.25


def test_nixl_progress_delay_is_set_in_the_pinned_nixl(prefill_host, decode_host):
    for host in (prefill_host, decode_host):
        lines = [line.strip() for line in host.file(NIXL_API).content_string.splitlines() if "pthrDelay =" in line]
        assert lines == [f"agent_config.pthrDelay = {NIXL_DELAY_US}  # set by inferops.vllm "
                         "(vllm_install_nixl_progress_delay_us)"], lines


# Every thread of every process systemd counts in a unit, with the CPUs it may run on, read in the host.
_UNIT_AFFINITY_SCRIPT = r"""
import json, os, subprocess, sys
unit, seen = sys.argv[1], {}
for line in subprocess.run(["ps", "-eo", "pid=,unit="], capture_output=True, text=True, check=True).stdout.splitlines():
    pid, _, owner = line.strip().partition(" ")
    if owner.strip() != unit:
        continue
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            seen[f"{pid}/{tid} {name}"] = sorted(os.sched_getaffinity(int(tid)))
        except OSError:
            continue
print(json.dumps(seen))
"""
NIXL_WORKER = ("/opt/vllm/venv/lib/python3.11/site-packages/"
               "vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py")


def test_vllms_nixl_core_reservation_keeps_to_the_instances_cores(prefill_host, decode_host):
    for host in (prefill_host, decode_host):
        lines = [line.strip() for line in host.file(NIXL_WORKER).content_string.splitlines()
                 if "os.sched_setaffinity(0," in line]
        assert len(lines) == 1 and lines[0].endswith("# set by inferops.vllm (vllm_install_nixl_honour_cpu_binding)")
        assert "os.sched_getaffinity(0)" in lines[0], lines


def test_every_thread_of_an_instance_runs_on_its_cpus(prefill_host, decode_host):
    """The instances' cpus (inventories/sandbox: prefill-0 core 0, decode-0 core 1; molecule's decode-1 core 0, beside
    decode-0 on its host): vLLM's NIXL connector used to move the model's thread to the host's last core, and the
    API server and engine core floated over every core."""
    instances = (("vllm@prefill-0.service", prefill_host, [0]), ("vllm@decode-0.service", decode_host, [1]),
                 ("vllm@decode-1.service", decode_host, [0]))
    for unit, host, cpus in instances:
        threads = json.loads(host.check_output("python3 -c %s %s", _UNIT_AFFINITY_SCRIPT, unit))
        assert len(threads) > 20, (unit, threads)  # the launcher, API server, engine core and worker, with threads
        elsewhere = {name: got for name, got in threads.items() if got != cpus}
        assert not elsewhere, f"{unit}: threads not on CPUs {cpus}: {elsewhere}"


def test_idle_instances_give_their_cores_back(prefill_host, decode_host):
    """The delay reached the running workers: idle instances sampled over the same window stay far
    below one core each (NIXL's own zero delay keeps a core per worker busy)."""
    units = {"prefill-0": prefill_host, "decode-0": decode_host}
    before = {name: unit_cpu_seconds(host, f"vllm@{name}.service") for name, host in units.items()}
    start = time.monotonic()
    time.sleep(IDLE_SECONDS)
    after = {name: unit_cpu_seconds(host, f"vllm@{name}.service") for name, host in units.items()}
    elapsed = time.monotonic() - start
    usage = {name: (after[name] - before[name]) / elapsed for name in units}
    assert all(before.values()), f"no CPU time read for the instances' processes: {before}"
    assert all(u <= IDLE_BOUND for u in usage.values()), f"idle CPU per instance (1.0 = one core): {usage}"


STALE_CHECK = """
- name: Which running decode instances started before their files last changed (check mode, no mark written)
  hosts: decode
  gather_facts: false
  become: true
  tasks:
    - name: Ask the module the role runs
      inferops.vllm.vllm_instance_stale:
        instances:
          - name: decode-0
            files: [/etc/vllm/decode-0.toml, /etc/vllm/decode-0.env]
        common_files: [/etc/systemd/system/vllm@.service]
        pending_dir: /var/lib/inferops-vllm/restart-pending
      check_mode: true
      register: stale

    - name: Say what it found
      ansible.builtin.debug:
        msg: >-
          STALE={{ stale.stale | to_json }} MARKED={{ stale.marked | to_json }}
          NOT_STARTED={{ stale.not_started | to_json }}
"""


@molecule_only
def test_a_config_newer_than_its_running_instance_is_found_stale(decode_host, tmp_path):
    """The mark an interrupted run would lose (a config written, the run stopped before its handler): derived from
    the real unit's start time and the real file's modification time. The converged decode-0 is not stale; with its
    config.toml's modification time moved past its start it is, and would be marked. Check mode: the config's time
    is put back and no mark is written."""
    decode = decode_host
    config = "/etc/vllm/decode-0.toml"
    mtime = decode.check_output(f"stat -c %Y {config}").strip()

    def found() -> str:
        run = inline_playbook(STALE_CHECK, tmp_path)
        assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
        return re.search(r"STALE=(\[.*?\]) MARKED=(\[.*?\]) NOT_STARTED=(\[.*?\])", run.stdout).group(0)

    # decode-0 runs, enabled: nothing for the role to start (it enables and starts only what the module returns).
    assert found() == 'STALE=[] MARKED=[] NOT_STARTED=[]'
    try:
        decode.check_output(f"touch {config}")
        assert found() == 'STALE=["decode-0"] MARKED=["decode-0"] NOT_STARTED=[]'
    finally:
        decode.check_output(f"touch -d @{mtime} {config}")
    assert not decode.file("/var/lib/inferops-vllm/restart-pending/decode-0").exists
