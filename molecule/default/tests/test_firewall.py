"""The nftables rules of roles/vllm_firewall on the live pair: each instance's KV transfer (NIXL side
channel) port answers the prefill/decode hosts only, its API the router and the Podman host only.
Connections are tried for real from the containers and from a throwaway container on the same network,
and by a probe that keeps trying while the rules are reloaded and changed, as the role's handler does it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from conftest import DECODE, PREFILL, ROUTER, container_ip, journal_tail, molecule_only

# The scenario's network (scripts/sandbox/up.sh's is inferops-sandbox).
NETWORK = os.environ.get("INFEROPS_NETWORK", "inferops-molecule")
IMAGE = os.environ["INFEROPS_BASE_IMAGE"]
REPO = Path(__file__).resolve().parents[3]

# (instance host, KV transfer port, API port), as the sandbox inventory sets them.
INSTANCES = [(PREFILL, 5600, 8100), (DECODE, 5700, 8200)]

CONNECT = (
    "import socket, sys\n"
    "try:\n"
    "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).close()\n"
    "except ConnectionRefusedError:\n"
    "    print('refused'); sys.exit(3)\n"
    "except OSError as exc:\n"
    "    print(type(exc).__name__, exc); sys.exit(4)\n"
    "print('connected')\n"
)


def connect_from(host, address: str, port: int) -> str:
    """Try a TCP connection from a container host (testinfra); 'connected', 'refused' or the error."""
    return host.run("python3 -c %s %s %s", CONNECT, address, str(port)).stdout.strip()


def connect_from_outsider(address: str, port: int) -> str:
    """The same from a new container on the sandbox network: an address neither peer nor router."""
    proc = subprocess.run(
        ["podman", "run", "--rm", "--network", NETWORK, IMAGE, "python3", "-c", CONNECT, address, str(port)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.stdout.strip(), proc.stderr
    return proc.stdout.strip()


@pytest.mark.parametrize("fixture", ["prefill_host", "decode_host"])
def test_rules_loaded_by_an_enabled_unit(request, fixture):
    host = request.getfixturevalue(fixture)
    unit = host.service("inferops-vllm-firewall")
    assert unit.is_enabled and unit.is_running
    rules = host.file("/etc/inferops-vllm/firewall.nft")
    assert rules.user == "root" and rules.mode == 0o644
    live = host.check_output("nft list table inet inferops_vllm")
    assert "reject with tcp reset" in live


@pytest.mark.parametrize(("name", "kv_port", "api_port"), INSTANCES)
def test_kv_port_answers_the_other_pd_host_only(prefill_host, decode_host, router_host, name, kv_port, api_port):
    address = container_ip(name)
    peer = decode_host if name == PREFILL else prefill_host
    assert connect_from(peer, address, kv_port) == "connected"
    # The router and any other address are refused.
    assert connect_from(router_host, address, kv_port) == "refused"
    assert connect_from_outsider(address, kv_port) == "refused"


@pytest.mark.parametrize(("name", "kv_port", "api_port"), INSTANCES)
def test_api_port_answers_the_router_not_others(router_host, name, kv_port, api_port):
    address = container_ip(name)
    assert connect_from(router_host, address, api_port) == "connected"
    assert connect_from_outsider(address, api_port) == "refused"


# A non-peer hammering a KV transfer port: connects to ADDRESS:PORT every few milliseconds until STOP
# exists or SECONDS have passed, and keeps OUT (JSON) up to date with its counts.
PROBE = r"""
import json, os, socket, sys, time
address, port, out, stop, seconds = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], float(sys.argv[5])
counts = {"pid": os.getpid(), "attempts": 0, "connected": 0, "refused": 0, "other": 0, "done": False}
def save():
    with open(out + ".tmp", "w") as f:
        json.dump(counts, f)
    os.replace(out + ".tmp", out)
end = time.monotonic() + seconds
saved = 0.0
while time.monotonic() < end and not os.path.exists(stop):
    counts["attempts"] += 1
    try:
        socket.create_connection((address, port), timeout=0.2).close()
        counts["connected"] += 1
    except ConnectionRefusedError:
        counts["refused"] += 1
    except OSError:
        counts["other"] += 1
    if time.monotonic() - saved > 0.05:
        save()
        saved = time.monotonic()
    time.sleep(0.002)
counts["done"] = True
save()
"""
PROBE_OUT = "/tmp/inferops-firewall-probe.json"
PROBE_STOP = "/tmp/inferops-firewall-probe.stop"
# The probe ends by itself after this long, whatever happens to the test.
PROBE_SECONDS = 25

UNIT = "inferops-vllm-firewall.service"
RULES = "/etc/inferops-vllm/firewall.nft"
# A rule change: one more KV peer (TEST-NET-1, on no sandbox network), loaded as the role's handler
# loads a changed file: the file replaced (as the template module does, by a rename), then a reload.
EXTRA_PEER = "192.0.2.1"
RELOADS = 20
CHANGES = 5
RELOAD_LOOP = f"""set -eu
peer_in() {{ nft list set inet inferops_vllm kv_peers_ipv4 | grep -qF {EXTRA_PEER}; }}
for i in $(seq {RELOADS}); do systemctl reload {UNIT}; done
cp -p {RULES} {RULES}.probe-orig
nft --check --file {RULES}.probe-changed
for i in $(seq {CHANGES}); do
  cp -p {RULES}.probe-changed {RULES}.probe-tmp && mv -f {RULES}.probe-tmp {RULES}
  systemctl reload {UNIT}
  peer_in || {{ echo "change $i was not loaded" >&2; exit 1; }}
  cp -p {RULES}.probe-orig {RULES}.probe-tmp && mv -f {RULES}.probe-tmp {RULES}
  systemctl reload {UNIT}
  if peer_in; then echo "change $i was not undone" >&2; exit 1; fi
done
"""


def probe_counts(router_host) -> dict:
    out = router_host.run(f"cat {PROBE_OUT}")
    return json.loads(out.stdout) if out.rc == 0 and out.stdout.strip() else {}


def wait_for_probe(router_host, ready, seconds: float) -> dict:
    """The probe's counts once ready(counts) holds; the last counts read if it does not within seconds."""
    deadline = time.monotonic() + seconds
    while True:
        counts = probe_counts(router_host)
        if ready(counts) or time.monotonic() > deadline:
            return counts
        time.sleep(0.1)


def test_rule_changes_open_no_window_to_a_non_peer(prefill_host, decode_host, router_host):
    """While the router (no KV peer) connects to decode-0's KV transfer port hundreds of times a second,
    the rules are reloaded 20 times, and changed and changed back 5 times as the role's handler does it:
    not one connection gets through (a stop/start would leave the port open between the two)."""
    address = container_ip(DECODE)
    kv_port = next(kv for name, kv, api in INSTANCES if name == DECODE)
    # The port listens (the peer gets in), and without the table the router gets in too: what the probe
    # is refused below is the rules' doing.
    assert connect_from(prefill_host, address, kv_port) == "connected"
    before = decode_host.check_output("nft list table inet inferops_vllm")
    try:
        decode_host.check_output("nft delete table inet inferops_vllm")
        assert connect_from(router_host, address, kv_port) == "connected"
    finally:
        decode_host.check_output(f"systemctl reload {UNIT}")
    assert connect_from(router_host, address, kv_port) == "refused"

    text = decode_host.file(RULES).content_string
    changed, found = re.subn(r"(set kv_peers_ipv4 \{[^}]*?elements = \{ )", rf"\g<1>{EXTRA_PEER}, ", text, count=1)
    assert found == 1, f"no kv_peers_ipv4 set in {RULES}:\n{text}"
    written = decode_host.run(f"cat > {RULES}.probe-changed <<'EOF'\n{changed.rstrip()}\nEOF\n")
    assert written.rc == 0, written.stderr

    router_host.run(f"rm -f {PROBE_OUT} {PROBE_OUT}.tmp {PROBE_STOP}")
    try:
        subprocess.run(
            ["podman", "exec", "--detach", ROUTER, "python3", "-c", PROBE, address, str(kv_port), PROBE_OUT,
             PROBE_STOP, str(PROBE_SECONDS)],
            check=True, capture_output=True, text=True, timeout=60,
        )
        start = wait_for_probe(router_host, lambda c: c.get("attempts", 0) >= 20, 10)
        assert start.get("attempts", 0) >= 20, f"the probe did not get going in the router container: {start}"
        began = time.monotonic()
        reloaded = decode_host.run(RELOAD_LOOP)
        took = time.monotonic() - began
        end = probe_counts(router_host)
        assert reloaded.rc == 0, f"{reloaded.stdout}{reloaded.stderr}\n{journal_tail(decode_host, UNIT)}"
    finally:
        # Stop the probe (it also ends by itself after PROBE_SECONDS), put the rules back.
        router_host.run(f"touch {PROBE_STOP}")
        final = wait_for_probe(router_host, lambda c: c.get("done"), 5)
        if final.get("pid") and not final.get("done"):
            router_host.run(f"kill {int(final['pid'])} 2>/dev/null || true")
        router_host.run(f"rm -f {PROBE_OUT} {PROBE_OUT}.tmp {PROBE_STOP}")
        decode_host.run(
            f"if [ -f {RULES}.probe-orig ]; then mv -f {RULES}.probe-orig {RULES}; systemctl reload {UNIT}; fi; "
            f"rm -f {RULES}.probe-changed {RULES}.probe-tmp"
        )

    during = end["attempts"] - start["attempts"]
    assert during >= 100, f"the probe made only {during} attempts in the {took:.1f} s of reloads: {start} -> {end}"
    assert final.get("done"), f"the probe did not stop when told: {final}"
    assert final["connected"] == 0, (
        f"the router connected {final['connected']} times to the KV transfer port of {DECODE} while the rules "
        f"were reloaded ({RELOADS} reloads, {CHANGES} changes and back in {took:.1f} s): {final}"
    )
    assert final["other"] == 0, f"connections neither refused nor accepted (dropped?): {final}"
    # Back as it was: the same rules, the unit active, the peer still let in.
    assert decode_host.check_output("nft list table inet inferops_vllm") == before
    assert decode_host.service("inferops-vllm-firewall").is_running
    assert connect_from(prefill_host, address, kv_port) == "connected"


@pytest.mark.parametrize(("fixture", "instance"), [("prefill_host", "prefill-0"), ("decode_host", "decode-0")])
def test_changes_load_in_one_transaction_and_instances_wait_for_the_rules(request, fixture, instance):
    host = request.getfixturevalue(fixture)
    # systemctl reload (the role's handler) runs nft -f, which replaces the table in one transaction.
    reload = host.check_output(f"systemctl show -p ExecReload --value {UNIT}")
    assert f"argv[]=/usr/sbin/nft -f {RULES} " in reload, reload
    head = host.file(RULES).content_string.split("table inet inferops_vllm {")[0]
    assert "\ntable inet inferops_vllm\ndelete table inet inferops_vllm\n" in head, head
    # The instance starts after the rules are loaded, and starting it loads them.
    shown = host.check_output(f"systemctl show -p After -p Wants vllm@{instance}.service")
    deps = {key: value.split() for key, value in (line.split("=", 1) for line in shown.splitlines())}
    assert UNIT in deps["After"] and UNIT in deps["Wants"], shown


def test_the_handler_reloads_never_restarts():
    """A restart runs ExecStop (nft delete table) before ExecStart: the window the reload avoids."""
    handlers = yaml.safe_load((REPO / "roles" / "vllm_firewall" / "handlers" / "main.yml").read_text())
    (handler,) = [h for h in handlers if h["name"] == "Load the vLLM firewall rules"]
    assert handler["ansible.builtin.systemd_service"]["state"] == "reloaded"


FIREWALL_ONLY = """---
- name: Gather the addresses the rules admit peers by
  hosts: prefill:decode:router:monitoring
  gather_facts: false
  tasks:
    - name: Facts
      ansible.builtin.setup:
        gather_subset: [min, network]

- name: Publish the instances, whose ports the rules open
  hosts: prefill:decode
  gather_facts: false
  tasks:
    - name: Publish each host's instances
      ansible.builtin.include_role:
        name: inferops.vllm.vllm_instance
        tasks_from: preflight

- name: Publish the router replicas (as playbooks/monitoring.yml does before the firewall)
  hosts: router
  gather_facts: false
  tasks:
    - name: Publish each router host's replicas
      ansible.builtin.include_role:
        name: inferops.vllm.vllm_router
        tasks_from: publish

- name: The vllm_firewall role alone on the decode host
  hosts: decode
  gather_facts: false
  become: true
  roles:
    - role: inferops.vllm.vllm_firewall
"""


@molecule_only
def test_disabling_the_firewall_removes_its_rules_and_enabling_it_brings_them_back(decode_host, tmp_path):
    """vllm_firewall_enabled: false on a host whose rules an earlier run loaded: the unit, the rules file and the
    table are gone, the run says the ports are not restricted, and a non-peer reaches the KV transfer port; set
    back to true, the same rules are loaded again and the non-peer is refused."""
    address = container_ip(DECODE)
    kv_port = next(kv for name, kv, api in INSTANCES if name == DECODE)
    inventory = os.path.join(os.environ["MOLECULE_EPHEMERAL_DIRECTORY"], "inventory")
    playbook = tmp_path / "firewall.yml"
    playbook.write_text(FIREWALL_ONLY)
    rules_before = decode_host.file(RULES).content_string
    table_before = decode_host.check_output("nft list table inet inferops_vllm")
    env = dict(os.environ)
    cfg = os.path.join(os.environ["MOLECULE_EPHEMERAL_DIRECTORY"], "ansible.cfg")
    if os.path.isfile(cfg):
        env["ANSIBLE_CONFIG"] = cfg

    def role(enabled: bool) -> str:
        run = subprocess.run(["ansible-playbook", "-i", inventory, str(playbook), "-e",
                              f"vllm_firewall_enabled={'true' if enabled else 'false'}"], env=env, capture_output=True,
                             text=True, timeout=600, check=False, cwd=str(REPO))
        assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
        return run.stdout

    try:
        output = role(False)
        assert "vllm_firewall is disabled on molecule-decode" in output, output[-3000:]
        assert not decode_host.file(RULES).exists
        assert not decode_host.file(f"/etc/systemd/system/{UNIT}").exists
        assert decode_host.run("nft list table inet inferops_vllm").rc != 0
        assert connect_from_outsider(address, kv_port) == "connected"
    finally:
        role(True)
    assert decode_host.file(RULES).content_string == rules_before
    assert decode_host.check_output("nft list table inet inferops_vllm") == table_before
    assert decode_host.service("inferops-vllm-firewall").is_running
    assert connect_from_outsider(address, kv_port) == "refused"
