"""roles/vllm_monitoring's scrape configuration, exporters' arguments, the firewall and nginx pieces it needs,
its preflight and its report of unreachable targets, through the real ansible-playbook on localhost.

A small inventory (a prefill host, a decode host with two instances, a router host that is the monitoring
host) runs the roles' own entry points: vllm_instance's preflight publishes the instances, vllm_router's
publish entry point the replicas, vllm_monitoring's preflight checks the shape; then the role's own template
tasks write into a temporary directory (Prometheus' configuration validated by `promtool check config`, the
firewall's rules by `nft --check`, which must be installed). Nothing outside that directory is touched.
"""

from __future__ import annotations

import http.server
import json
import re
import shutil
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml
from monitoring_support import ANSIBLE_PLAYBOOK, REPO, ROLE, config_files_task, promtool, role_task, run_playbook

pytestmark = pytest.mark.skipif(ANSIBLE_PLAYBOOK is None, reason="ansible-playbook is not installed")

FIREWALL = REPO / "roles" / "vllm_firewall"
ROUTER = REPO / "roles" / "vllm_router"
ADDRESSES = {"p1": "10.0.0.11", "d1": "10.0.0.21", "r1": "10.0.0.5", "r2": "10.0.0.6"}
PROMETHEUS_TASK = (
    "Write Prometheus' alert rules, the instances' key and the configuration (scrape targets from the inventory)"
)
# The entries of that task the renders write, by key, and the file each goes to in the render's directory.
PROMETHEUS_FILES = {"rules": "rules.yml", "instance_key": "vllm-instance.key", "config": "prometheus.yml"}


def inventory(monitoring: list[str], routers: tuple[str, ...] = ("r1",), **extra: Any) -> dict[str, Any]:
    def host(name: str, **more: Any) -> dict[str, Any]:
        return {"vllm_instance_host_address": ADDRESSES[name], **more}

    return {
        "all": {
            "vars": {
                "vllm_install_variant": "cpu",
                "vllm_instance_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
                "vllm_instance_model_revision": "0123456789abcdef0123456789abcdef01234567",
                "vllm_instance_kv_cache_memory_bytes": 1073741824,
                "vllm_instance_kv_buffer_device": "cpu",
                "vllm_instance_max_model_len": 512,
                "vllm_router_allow_unauthenticated": True,
                **extra,
            }
        },
        "prefill": {"hosts": {"p1": host("p1")}},
        "decode": {
            "hosts": {
                "d1": host(
                    "d1",
                    vllm_instance_instances=[
                        {"name": "decode-0", "port": 8200, "kv_transfer_port": 5700},
                        {"name": "decode-1", "port": 8201, "kv_transfer_port": 5701},
                    ],
                )
            }
        },
        "router": {"hosts": {r: {} for r in routers}},
        "monitoring": {"hosts": {m: {} for m in monitoring}},
    }


def _firewall_task(name: str, **changes: Any) -> dict[str, Any]:
    (task,) = [
        t
        for path in sorted((FIREWALL / "tasks").glob("*.yml"))
        for t in yaml.safe_load(path.read_text(encoding="utf-8"))
        if t.get("name") == name
    ]
    task = {k: v for k, v in task.items() if k not in ("notify", "tags", "register")}
    (module,) = [k for k in task if k.startswith("ansible.builtin.")]
    args = {k: v for k, v in task[module].items() if k not in ("owner", "group")}
    args.update({k: v for k, v in changes.items() if v is not None})
    for k in [k for k, v in changes.items() if v is None]:
        args.pop(k, None)
    if "src" in args:
        args["src"] = str(FIREWALL / "templates" / args["src"])
    task[module] = args
    return task


def plays(out: Path, nft: bool) -> list[dict[str, Any]]:
    host_dir = str(out) + "/{{ inventory_hostname }}"
    return [
        {
            "name": "Addresses for the firewall (what gathered facts hold)",
            "hosts": "all",
            "gather_facts": False,
            "tasks": [
                {
                    "name": "Facts",
                    "ansible.builtin.set_fact": {
                        "all_ipv4_addresses": ["{{ " + json.dumps(ADDRESSES) + "[inventory_hostname] }}"],
                        "all_ipv6_addresses": [],
                        "cacheable": True,
                    },
                },
                {"name": "Directory", "ansible.builtin.file": {"path": host_dir, "state": "directory", "mode": "0700"}},
            ],
        },
        {
            "name": "Publish the instances",
            "hosts": "prefill:decode",
            "gather_facts": False,
            "tasks": [
                {
                    "name": "vllm_instance's preflight",
                    "ansible.builtin.include_role": {"name": "inferops.vllm.vllm_instance", "tasks_from": "preflight"},
                },
            ],
        },
        {
            "name": "Publish the routers, render the front",
            "hosts": "router",
            "gather_facts": False,
            "tasks": [
                {
                    "name": "vllm_router's publish",
                    "ansible.builtin.include_role": {
                        "name": "inferops.vllm.vllm_router",
                        "tasks_from": "publish",
                        "public": True,
                    },
                },
                {
                    "name": "The front's site",
                    "ansible.builtin.template": {
                        "src": str(ROUTER / "templates" / "nginx-site.conf.j2"),
                        "dest": host_dir + "/nginx-site.conf",
                        "mode": "0600",
                    },
                },
            ],
        },
        {
            "name": "The firewall of the prefill/decode hosts",
            "hosts": "prefill:decode",
            "gather_facts": False,
            "tasks": [
                {"name": "Firewall defaults", "ansible.builtin.include_vars": str(FIREWALL / "defaults" / "main.yml")},
                _firewall_task("Check vllm_firewall_api_sources (IP addresses or CIDRs)"),
                _firewall_task("Work out the ports and who may reach them"),
                # The rules only (validated by nft --check as on a host, unless nft is False), not the unit.
                config_files_task(
                    "configure.yml",
                    "Write the nftables rules and the unit that loads them at boot",
                    f"'{out}/' ~ inventory_hostname ~ '/firewall.nft'",
                    role=FIREWALL,
                    keys=("rules",),
                    changes=None if nft else {"validate": None},
                ),
                _firewall_task("Show what is allowed"),
            ],
        },
        {
            "name": "Monitoring",
            "hosts": "prefill:decode:router:monitoring",
            "gather_facts": False,
            "tasks": [
                {
                    "name": "vllm_monitoring's preflight",
                    "ansible.builtin.include_role": {
                        "name": "inferops.vllm.vllm_monitoring",
                        "tasks_from": "preflight",
                        "public": True,
                    },
                },
                config_files_task(
                    "install.yml",
                    "Write the arguments of the monitoring services, and point the distribution's units at them"
                    " (hardened drop-ins)",
                    f"'{out}/' ~ inventory_hostname ~ '/' ~ f.key ~ ('.env' if f.path.endswith('.env') else '.conf')",
                ),
                {
                    # The rules, the instances' key (absent without one) and prometheus.yml, each promtool-checked.
                    **config_files_task(
                        "configure.yml",
                        PROMETHEUS_TASK,
                        f"'{out}/' ~ inventory_hostname ~ '/' ~ " + json.dumps(PROMETHEUS_FILES) + "[f.key]",
                        keys=tuple(PROMETHEUS_FILES),
                    ),
                    "when": "_vllm_monitoring_is_prometheus | bool",
                },
                {
                    "name": "What the host installs",
                    "ansible.builtin.copy": {
                        "dest": host_dir + "/packages.json",
                        "mode": "0600",
                        "content": "{{ {'packages': _vllm_monitoring_packages, 'units': _vllm_monitoring_units}"
                        " | to_json }}",
                    },
                },
            ],
        },
    ]


def _nft_usable() -> bool:
    """The rendered rules are validated by `nft --check` as the role does on a host: nft must be usable here
    (scripts/sandbox/setup.sh installs nftables); a test that silently dropped the validation could not fail."""
    assert shutil.which("nft"), "nft is not installed: apt-get install nftables (scripts/sandbox/setup.sh does)"
    check = subprocess.run(["nft", "--check", "--file", "/dev/null"], capture_output=True, text=True, check=False)
    assert check.returncode == 0, f"nft --check does not work here: {check.stderr}"
    return True


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("monitoring-config")
    out = tmp / "out"
    out.mkdir()
    run = run_playbook(
        tmp, "render", plays(out, _nft_usable()), inventory(["r1"]), extra={"_vllm_monitoring_promtool": promtool()}
    )
    assert run.returncode == 0, run.stdout + run.stderr
    (out / "run.log").write_text(run.stdout, encoding="utf-8")
    return out


FALLBACK = {"name": "cloud-a", "url": "https://api.example.com/v1", "api_key": "sk-test-fallback-key-0001",
            "models": {"smollm2-135m-instruct": "gpt-4o-mini"}}
INSTANCE_KEY = "instance-key-for-monitoring-0001"


@pytest.fixture(scope="module")
def rendered_with_fallbacks_and_key(tmp_path_factory) -> Path:
    """The same inventory with a fallback endpoint on the router (vllm_router_front_fallbacks) and an instance key
    (vllm_instance_api_key: the instances require it on /metrics). One render for both (each render is ~20 s of
    the unit stage); what each adds is checked against the plain render."""
    tmp = tmp_path_factory.mktemp("monitoring-fallback-key")
    out = tmp / "out"
    out.mkdir()
    run = run_playbook(
        tmp, "render", plays(out, False), inventory(["r1"], vllm_instance_api_key=INSTANCE_KEY),
        extra={"_vllm_monitoring_promtool": promtool(), "vllm_router_front_fallbacks": [FALLBACK],
               # promtool checks that the credentials file exists: the one this render writes.
               "_vllm_monitoring_instance_key_file": str(out) + "/{{ inventory_hostname }}/vllm-instance.key"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert FALLBACK["api_key"] not in run.stdout + run.stderr
    assert INSTANCE_KEY not in run.stdout + run.stderr
    return out


def test_prometheus_scrapes_the_instances_with_their_key_from_a_file(rendered, rendered_with_fallbacks_and_key):
    """Issue #25: /metrics of an instance needs its key; Prometheus sends it (authorization.credentials_file),
    and the key is only in that file (0640 root:prometheus), never in prometheus.yml."""
    def job(out, name):
        config = yaml.safe_load((out / "r1" / "prometheus.yml").read_text(encoding="utf-8"))
        return {j["job_name"]: j for j in config["scrape_configs"]}[name]

    keyed = job(rendered_with_fallbacks_and_key, "vllm")
    key_file = rendered_with_fallbacks_and_key / "r1" / "vllm-instance.key"
    assert keyed["authorization"] == {"type": "Bearer", "credentials_file": str(key_file)}
    assert key_file.read_text(encoding="utf-8") == INSTANCE_KEY + "\n"
    assert INSTANCE_KEY not in (rendered_with_fallbacks_and_key / "r1" / "prometheus.yml").read_text(encoding="utf-8")
    # Only the instances' job: the router, nginx, node exporters and the front's fallback counter have no such key.
    for other in ("node", "nginx", "vllm-router", "nginx-fallback"):
        assert "authorization" not in job(rendered_with_fallbacks_and_key, other), other
    assert "authorization" not in job(rendered, "vllm")
    assert not (rendered / "r1" / "vllm-instance.key").exists()
    (task,) = [t for t in yaml.safe_load((REPO / "roles" / "vllm_monitoring" / "tasks" / "configure.yml").read_text())
               if t["name"] == PROMETHEUS_TASK]
    (entry,) = [f for f in task["inferops.vllm.config_files"]["files"] if f.get("key") == "instance_key"]
    assert (entry["mode"], entry["group"], entry["secret"]) == ("0640", "prometheus", True)


def test_fallback_counters_are_scraped_when_the_front_has_fallbacks(rendered, rendered_with_fallbacks_and_key):
    def jobs(out):
        config = yaml.safe_load((out / "r1" / "prometheus.yml").read_text(encoding="utf-8"))
        return {j["job_name"]: j for j in config["scrape_configs"]}

    assert "nginx-fallback" not in jobs(rendered)
    job = jobs(rendered_with_fallbacks_and_key)["nginx-fallback"]
    assert job["metrics_path"] == "/fallback_metrics"
    assert job["static_configs"] == [{"targets": ["127.0.0.1:8090"], "labels": {"host": "r1", "role": "router"}}]
    # The page it scrapes is on the front's loopback stub_status server.
    site = (rendered_with_fallbacks_and_key / "r1" / "nginx-site.conf").read_text(encoding="utf-8")
    status_server = site[site.index("listen 127.0.0.1:8090;"):]
    assert "location = /fallback_metrics {\n        js_content inferops.metrics;" in status_server


def test_scrape_targets_come_from_the_inventory(rendered):
    config = yaml.safe_load((rendered / "r1" / "prometheus.yml").read_text(encoding="utf-8"))
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert set(jobs) == {"prometheus", "vllm", "vllm-router", "nginx", "node"}

    def targets(job):
        return {t: sc["labels"] for sc in jobs[job]["static_configs"] for t in sc["targets"]}

    assert targets("vllm") == {
        "10.0.0.11:8100": {"host": "p1", "role": "prefill", "instance_name": "prefill-0"},
        "10.0.0.21:8200": {"host": "d1", "role": "decode", "instance_name": "decode-0"},
        "10.0.0.21:8201": {"host": "d1", "role": "decode", "instance_name": "decode-1"},
    }
    # vllm-router's two replicas (vllm_router_replicas' default) on loopback, the router's own ports.
    assert targets("vllm-router") == {
        "127.0.0.1:29000": {"host": "r1", "role": "router", "instance_name": "vllm-router@0"},
        "127.0.0.1:29001": {"host": "r1", "role": "router", "instance_name": "vllm-router@1"},
    }
    assert targets("nginx") == {"127.0.0.1:9113": {"host": "r1", "role": "router"}}
    # Node exporter: on the instances' address on prefill/decode hosts, on loopback on this host.
    assert targets("node") == {
        "10.0.0.11:9100": {"host": "p1", "role": "prefill"},
        "10.0.0.21:9100": {"host": "d1", "role": "decode"},
        "127.0.0.1:9100": {"host": "r1", "role": "router"},
    }
    assert targets("prometheus") == {"127.0.0.1:9090": {"host": "r1", "role": "monitoring"}}
    assert config["rule_files"] == ["/etc/prometheus/inferops-vllm/rules/*.yml"]
    assert "alerting" not in config


def test_router_workers_are_labelled_with_their_pool_and_name(rendered):
    """vllm-router labels its per-worker series with the worker URL only; the relabelling names them, and its
    regular expressions match the URLs the router was given (as Prometheus' RE2 would, anchored)."""
    import re

    config = yaml.safe_load((rendered / "r1" / "prometheus.yml").read_text(encoding="utf-8"))
    (router,) = [j for j in config["scrape_configs"] if j["job_name"] == "vllm-router"]
    rules = router["metric_relabel_configs"]
    urls = {
        "http://10.0.0.11:8100": ("prefill", "prefill-0"),
        "http://10.0.0.21:8200": ("decode", "decode-0"),
        "http://10.0.0.21:8201": ("decode", "decode-1"),
    }
    for url, (pool, name) in urls.items():
        for value in (url, url + "/"):
            got = {r["target_label"]: r["replacement"] for r in rules if re.fullmatch(r["regex"], value)}
            assert got == {"worker_role": pool, "worker_name": name}, value
    # decode-1's URL does not match decode-0's rule, and no rule matches a stranger.
    assert not [r for r in rules if re.fullmatch(r["regex"], "http://10.0.0.21:82011")]
    unit = (ROUTER / "templates" / "vllm-router@.service.j2").read_text(encoding="utf-8")
    assert "{{ i.url }}" in unit, "the router's --prefill/--decode URLs are no longer the published i.url"


def test_exporters_listen_where_they_should(rendered):
    assert 'ARGS="--web.listen-address=10.0.0.11:9100"' in (rendered / "p1" / "node-exporter.env").read_text()
    assert 'ARGS="--web.listen-address=10.0.0.21:9100"' in (rendered / "d1" / "node-exporter.env").read_text()
    assert 'ARGS="--web.listen-address=127.0.0.1:9100"' in (rendered / "r1" / "node-exporter.env").read_text()
    nginx = (rendered / "r1" / "nginx-exporter.env").read_text()
    assert "-nginx.scrape-uri=http://127.0.0.1:8090/stub_status -web.listen-address=127.0.0.1:9113" in nginx
    prometheus = (rendered / "r1" / "prometheus.env").read_text()
    assert "--web.listen-address=127.0.0.1:9090" in prometheus
    assert "--config.file=/etc/prometheus/inferops-vllm/prometheus.yml" in prometheus
    packages = {h: json.loads((rendered / h / "packages.json").read_text()) for h in ("p1", "d1", "r1")}
    assert packages["p1"]["packages"] == ["prometheus-node-exporter"]
    assert packages["d1"]["packages"] == ["prometheus-node-exporter"]
    assert packages["r1"]["packages"] == ["prometheus-node-exporter", "prometheus-nginx-exporter", "prometheus"]
    assert not (rendered / "p1" / "prometheus.yml").exists()


def test_units_are_pointed_at_the_arguments_and_hardened(rendered):
    for host, names in {"p1": ["node-exporter"], "r1": ["node-exporter", "nginx-exporter", "prometheus"]}.items():
        for name in names:
            dropin = (rendered / host / f"{name}.conf").read_text()
            assert f"EnvironmentFile=\nEnvironmentFile=/etc/inferops-vllm/monitoring/{name}.env\n" in dropin
            for line in (
                "NoNewPrivileges=yes",
                "ProtectSystem=strict",
                "ProtectKernelTunables=yes",
                "ProtectControlGroups=yes",
                "CapabilityBoundingSet=\n",
                "SystemCallFilter=@system-service",
            ):
                assert line in dropin, f"{host} {name}: {line!r}"
    prometheus = (rendered / "r1" / "prometheus.conf").read_text()
    assert "ConditionPathExists=/etc/prometheus/inferops-vllm/prometheus.yml" in prometheus
    assert "ReadWritePaths=/var/lib/prometheus/metrics2" in prometheus
    # Node exporter reads the whole host's /proc: no ProcSubset=pid there.
    assert "\nProcSubset=" not in (rendered / "p1" / "node-exporter.conf").read_text()


def test_the_firewall_admits_the_monitoring_hosts(rendered):
    for host, api_ports in (("p1", "8100"), ("d1", "8200, 8201")):
        rules = (rendered / host / "firewall.nft").read_text()
        # The API: router and monitoring hosts (here one host), node exporter: the monitoring hosts only.
        assert "set api_clients_ipv4 {\n\t\ttype ipv4_addr\n\t\tflags interval\n\t\telements = { 10.0.0.5 }" in rules
        assert "set monitoring_ipv4 {\n\t\ttype ipv4_addr\n\t\tflags interval\n\t\telements = { 10.0.0.5 }" in rules
        assert f"ip saddr @api_clients_ipv4 tcp dport {{ {api_ports} }} accept" in rules
        assert "ip saddr @monitoring_ipv4 tcp dport { 9100 } accept" in rules
        assert f"{api_ports}, 9100 }} reject with tcp reset" in rules
    said = " ".join((rendered / "run.log").read_text().split())
    assert (
        "API ports 8200, 8201 to the router and monitoring hosts and sources (10.0.0.5) and loopback; node exporter "
        "port 9100 to the monitoring hosts (10.0.0.5) and loopback; other connections" in said
    )


def test_the_front_serves_stub_status_on_loopback_only(rendered):
    site = (rendered / "r1" / "nginx-site.conf").read_text()
    server = site[site.index("# nginx's connection and request counters") :]
    assert "listen 127.0.0.1:8090;" in server
    assert "location = /stub_status {\n        stub_status;\n    }" in server
    assert site.count("listen ") == 2


def test_without_monitoring_nothing_changes_for_the_firewall_and_the_front(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    inv = inventory([])
    del inv["monitoring"]
    # p1 had vllm_monitoring's node exporter when the group had hosts (what the role's stat finds); d1 never had it.
    inv["prefill"]["hosts"]["p1"]["__vllm_firewall_left_exporter"] = {"stat": {"exists": True}}
    run = run_playbook(tmp_path, "plain", plays(out, _nft_usable())[:4], inv)
    assert run.returncode == 0, run.stdout + run.stderr
    site = (out / "r1" / "nginx-site.conf").read_text()
    assert "stub_status" not in site and site.count("listen ") == 1
    rules = (out / "d1" / "firewall.nft").read_text()
    assert "@monitoring" not in rules and "9100" not in rules
    assert "tcp dport { 5700, 5701, 8200, 8201 } reject with tcp reset" in rules
    # The exporter left on p1 keeps its port closed to all but loopback (issue #24: it was open to every address).
    rules = (out / "p1" / "firewall.nft").read_text()
    assert "@monitoring" not in rules
    assert "tcp dport { 5600, 8100, 9100 } reject with tcp reset" in rules
    said = " ".join(run.stdout.split())
    assert "node exporter port 9100 to the monitoring hosts (none) and loopback" in said


# The preflight cases: each refused with its own message. The instances are published as vllm_instance's
# preflight publishes them (tested above), set directly here to keep these runs short.
PUBLISHED = {
    "p1": {
        "pd_role": "prefill",
        "address": "10.0.0.11",
        "settings": {},
        "instances": [{"name": "prefill-0", "port": 8100, "kv_transfer_port": 5600}],
    },
    "d1": {
        "pd_role": "decode",
        "address": "10.0.0.21",
        "settings": {},
        "instances": [
            {"name": "decode-0", "port": 8200, "kv_transfer_port": 5700},
            {"name": "decode-1", "port": 8201, "kv_transfer_port": 5701},
        ],
    },
}
BAD = {
    "router_outside": ({"routers": ("r1", "r2")}, {},
                       "[monitoring] r2: groups['monitoring']: the router host is not in the monitoring group"),
    "duration": (
        {},
        {"vllm_monitoring_slo_window": "5 minutes"},
        "vllm_monitoring_slo_window: must be Prometheus durations: vllm_monitoring_slo_window ('5 minutes')",
    ),
    "timeout": (
        {},
        {"vllm_monitoring_scrape_timeout": "30s"},
        "vllm_monitoring_scrape_timeout: is 30s, longer than vllm_monitoring_scrape_interval (15s)",
    ),
    "threshold": (
        {},
        {"vllm_monitoring_kv_cache_usage_threshold": 90},
        "vllm_monitoring_kv_cache_usage_threshold: is 90, not a share above 0 and at most 1",
    ),
    "port": (
        {},
        {"vllm_monitoring_node_exporter_port": 8200},
        "[monitoring] d1: vllm_monitoring_prometheus_port, vllm_monitoring_node_exporter_port, "
        "vllm_monitoring_nginx_exporter_port: the host already serves 8200",
    ),
    "remote": (
        {},
        {"vllm_monitoring_prometheus_listen_address": "0.0.0.0"},
        "[monitoring] r1: vllm_monitoring_prometheus_listen_address: is '0.0.0.0': Prometheus' API and UI answer "
        "anyone",
    ),
    "good": ({}, {}, None),
}


def _preflight(tmp_path, name: str) -> subprocess.CompletedProcess[str]:
    shape, extra, _expected = BAD[name]
    inv = inventory(["r1"], **shape)
    for group in ("prefill", "decode"):
        for host in inv[group]["hosts"]:
            inv[group]["hosts"][host]["vllm_instance_published"] = PUBLISHED[host]
    return run_playbook(
        tmp_path,
        name,
        plays(tmp_path / name, False)[2:3]
        + [
            {
                "name": "Monitoring preflight",
                "hosts": "prefill:decode:router:monitoring",
                "gather_facts": False,
                "tasks": [
                    {
                        "name": "vllm_monitoring's preflight",
                        "ansible.builtin.include_role": {
                            "name": "inferops.vllm.vllm_monitoring",
                            "tasks_from": "preflight",
                        },
                    }
                ],
            },
        ],
        inv,
        extra=extra,
    )


@pytest.fixture(scope="module")
def preflights(tmp_path_factory) -> dict[str, subprocess.CompletedProcess[str]]:
    tmp = tmp_path_factory.mktemp("monitoring-preflight")
    for name in BAD:
        for host in ("r1", "r2"):
            (tmp / name / host).mkdir(parents=True)
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_preflight, tmp, name) for name in BAD}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("case", sorted(BAD))
def test_the_preflight_refuses_bad_settings_and_shapes(preflights, case):
    run = preflights[case]
    output = " ".join((run.stdout + run.stderr).split())
    expected = BAD[case][2]
    if expected is None:
        assert run.returncode == 0, output
        assert "changed=0" in output
        return
    assert run.returncode != 0, output
    assert expected in output, output


# --------------------------------------------------------------------------- unreachable targets


class FakePrometheus(http.server.BaseHTTPRequestHandler):
    targets: list[dict[str, Any]] = []
    rule_groups: list[str] = ["inferops-vllm-pd"]

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path.startswith("/api/v1/targets"):
            data = {"activeTargets": self.targets, "droppedTargets": []}
        elif self.path.startswith("/api/v1/rules"):
            data = {"groups": [{"name": name, "rules": []} for name in self.rule_groups]}
        else:  # /-/ready
            data = {}
        body = json.dumps({"status": "success", "data": data}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _target(job, host, url, health, error="", instance_name=None):
    labels = {"job": job, "host": host, "instance": url.split("/")[2]}
    if instance_name:
        labels["instance_name"] = instance_name
    return {"labels": labels, "scrapeUrl": url, "health": health, "lastError": error}


# The third case's targets are all up (no wait for a down one's grace): its rules are what it checks.
@pytest.mark.parametrize(("require", "rules_loaded"), [(True, True), (False, True), (True, False)])
def test_a_target_prometheus_cannot_reach_is_named(tmp_path, require, rules_loaded):
    """The role's check of Prometheus (inferops.vllm.prometheus_status and the checks of what it returns) against a
    fake Prometheus: a target it cannot scrape is named, and fails the run unless vllm_monitoring_require_targets_up
    is false; alert rules it did not load fail the run."""
    FakePrometheus.rule_groups = ["inferops-vllm-pd"] if rules_loaded else ["some-other-group"]
    FakePrometheus.targets = [
        _target("vllm", "p1", "http://10.0.0.11:8100/metrics", "up", instance_name="prefill-0"),
        _target(
            "node",
            "d1",
            "http://10.0.0.21:9100/metrics",
            "down",
            'Get "http://10.0.0.21:9100/metrics": dial tcp 10.0.0.21:9100: connect: connection refused',
        ),
    ][: 2 if rules_loaded else 1]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakePrometheus)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        tasks = [
            role_task(
                "service.yml",
                "Wait until Prometheus is ready and scraped every target (each up or given its chances), and read its"
                " alert rules",
            )
        ]
        tasks += [
            {**role_task("service.yml", n), "when": w}
            for n, w in (
                ("Check that Prometheus reaches every target", "vllm_monitoring_require_targets_up | bool"),
                ("Warn about the targets Prometheus cannot scrape", "not vllm_monitoring_require_targets_up | bool"),
            )
        ]
        tasks.append(role_task("service.yml", "Check that Prometheus loaded the alert rules"))
        run = run_playbook(
            tmp_path,
            "targets",
            [
                {
                    "name": "The role's check of its targets",
                    "hosts": "localhost",
                    "gather_facts": False,
                    "tasks": [
                        {"name": "Defaults", "ansible.builtin.include_vars": str(ROLE / "defaults" / "main.yml")},
                        *tasks,
                    ],
                }
            ],
            extra={
                "_vllm_monitoring_prometheus_url": f"http://127.0.0.1:{server.server_port}",
                "vllm_monitoring_scrape_interval": "1s",
                "vllm_monitoring_require_targets_up": require,
            },
        )
    finally:
        server.shutdown()
    output = " ".join((run.stdout + run.stderr).split())
    named = (
        "Prometheus cannot scrape 1 of 2 targets: node on d1 (http://10.0.0.21:9100/metrics): Get "
        '\\"http://10.0.0.21:9100/metrics\\": dial tcp 10.0.0.21:9100: connect: connection refused'
    )
    assert (named.replace('\\"', '"') in output.replace('\\"', '"')) == rules_loaded, output
    assert run.returncode != 0 if require or not rules_loaded else run.returncode == 0, output
    refused = 'Prometheus did not load the alert rule group inferops-vllm-pd'
    assert (refused in output) == (not rules_loaded), output
    if not rules_loaded:
        assert 'it has ["some-other-group"]' in output, output


def test_deploy_pd_skips_monitoring_without_a_monitoring_group(tmp_path):
    """deploy_pd.yml's monitoring play, run as it is on hosts at unroutable TEST-NET addresses: with no monitoring
    group (absent, or empty) every task is skipped and no host is contacted."""
    playbook = yaml.safe_load((REPO / "playbooks" / "deploy_pd.yml").read_text(encoding="utf-8"))
    (play,) = [p for p in playbook if "vllm_monitoring" in str(p.get("roles", ""))]
    hosts = {
        "prefill": {"hosts": {"p1": {"ansible_host": "192.0.2.11"}}},
        "decode": {"hosts": {"d1": {"ansible_host": "192.0.2.21"}}},
        "router": {"hosts": {"r1": {"ansible_host": "192.0.2.5"}}},
    }
    for name, inv in (("absent", hosts), ("empty", {**hosts, "monitoring": {"hosts": {}}})):
        run = run_playbook(tmp_path, name, [play], inv, extra={"ansible_connection": "ssh"}, timeout=120)
        output = run.stdout + run.stderr
        assert run.returncode == 0, output
        for host in ("p1", "d1", "r1"):
            assert re.search(rf"^{host}\s+: ok=0\s+changed=0\s+unreachable=0\s+failed=0\s+skipped=\d+", output, re.M), (
                output
            )
