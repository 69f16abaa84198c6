"""The roles' own settings that an inventory decides alone, in the controller-side PD preflight (issue #28).

vllm_install (`install`), nvidia_driver (`driver`), vllm_router (`router`, and its part of `secrets`) and
vllm_monitoring (`monitoring`) publish records; pd_preflight checks them before any host is contacted, and each role's
preflight runs the same function through a filter (install_problems, driver_problems, router_problems,
monitoring_problems): one rule, one place, the same words. tests/preflight/{install,driver,router,monitoring,secrets}_*
run the real playbooks/preflight.yml on bad inventories; tests/unit/test_install_index_preflight.py,
test_nixl_delay_preflight.py, test_monitoring_config.py and test_router_documented_rules.py run the roles' preflights.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
from ansible_collections.inferops.vllm.plugins.filter.preflight import FilterModule
from ansible_collections.inferops.vllm.plugins.plugin_utils import _preflight as pf
from ansible_collections.inferops.vllm.tests.unit.plugins.filter.test_preflight import instance, inventory, router

REPO = Path(__file__).resolve().parents[4]


def install(**kw: Any) -> dict[str, Any]:
    """roles/vllm_install/tasks/publish.yml's record with the role's defaults (an index install from PyPI)."""
    base = {"variant": "cuda", "source": "index", "version": "0.32.0", "nixl_version": "1.5.1",
            "nixl_progress_delay_us": 0, "nixl_delay_versions": ["1.5.1"], "wheelhouse_dir": "", "index_url": "",
            "extra_index_urls": [], "index_credentials_broken": False, "index_username_set": False,
            "index_password_set": False, "index_username_colon": False, "index_credentials_ascii": True,
            "index_ca_file": "", "index_allow_plaintext": False, "venv": "/opt/vllm/venv", "keep_previous": 1}
    return {**base, **kw}


def driver(**kw: Any) -> dict[str, Any]:
    """roles/nvidia_driver/tasks/publish.yml's record with the role's defaults on a cuda host."""
    return {"install": True, "branch": "580", "source": "cuda_repo", "fabric_manager": "auto", "container": "auto",
            "cuda_keyring_sha256": "", **kw}


def router_settings(**kw: Any) -> dict[str, Any]:
    """roles/vllm_router/tasks/publish.yml's record with the role's defaults, the front on loopback."""
    base = router(source="index", version="0.1.17", wheelhouse_dir="", keep_previous=1, venv="/opt/vllm-router/venv",
                  stop_timeout=1800, request_timeout=1800,
                  front_limits={"rate_limit": 20, "rate_burst": 40, "concurrency_limit": 64, "failed_key_rate": 60,
                                "failed_key_burst": 20},
                  max_body_size="64m", extra_routes=[], front_bind="127.0.0.1", front_public=False, tls=False,
                  front_allow_plaintext=False, log_level="info", extra_args_log_flags=False, tls_certificate_file="",
                  tls_key_file="", worker_api_key_valid=True, stub_status_port=8090)
    return {**base, **kw}


def monitoring(prometheus: bool = False, **kw: Any) -> dict[str, Any]:
    """roles/vllm_monitoring/tasks/publish.yml's record with the role's defaults."""
    durations = {"vllm_monitoring_scrape_interval": "15s", "vllm_monitoring_scrape_timeout": "10s",
                 "vllm_monitoring_retention_time": "15d", "vllm_monitoring_slo_window": "5m"}
    base = {"prometheus": prometheus, "ports": {"prometheus": 9090, "node_exporter": 9100, "nginx_exporter": 9113},
            "listen_address": "127.0.0.1", "allow_remote": False, "durations": durations,
            "slo_ttft_p99_seconds": 2, "slo_itl_p99_seconds": 0.2, "kv_cache_usage_threshold": 0.9,
            "fallback_ratio": 0.1, "kv_throughput_min_mib_s": {"tcp": 50, "rdma": 2000}, "alertmanagers": [],
            "alert_labels": {}, "targets_timeout": 120}
    return {**base, **kw}


def published(install_records: dict[str, dict] | None = None, driver_records: dict[str, dict] | None = None,
              monitoring_records: dict[str, dict] | None = None,
              routers: dict[str, dict] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(published_by_host, groups) of inventory() with the role records added to the plain data."""
    data, groups = inventory(routers=routers or {"r1": router_settings()})
    for key, records in (("install", install_records), ("driver", driver_records),
                         ("monitoring", monitoring_records)):
        for host, record in (records or {}).items():
            data[host][key] = record
    if monitoring_records is not None:
        groups["monitoring"] = ["r1"]
    return data, groups


def preflight(**kw: Any) -> list[str]:
    data, groups = published(**kw)
    return pf.pd_preflight(data, groups)


def test_good_records_pass_the_preflight_and_the_roles():
    assert preflight(install_records={"p1": install(), "d1": install()}, driver_records={"p1": driver()},
                     monitoring_records={h: monitoring(prometheus=h == "r1") for h in ("p1", "d1", "r1")}) == []
    assert pf.install_problems(install(), "p1") == []
    assert pf.driver_problems(driver(), "p1") == []
    assert pf.router_problems(router_settings(), "r1", [{"max_model_len": 8192, "label": "d1"}]) == []


def test_a_host_that_gets_no_driver_is_not_checked():
    assert pf.driver_problems(driver(install=False, branch=580, source="nowhere"), "p1") == []


INSTALL = {
    "variant": (install(variant="gpu"), "[install] p1: vllm_install_variant: is 'gpu', not a vLLM build"),
    "source": (install(source="pip"), "[install] p1: vllm_install_source: is 'pip', not a place vLLM is installed"),
    "version": (install(version="0.32"), "[install] p1: vllm_install_version: is '0.32', not an exact release X.Y.Z"),
    "nixl_version": (install(nixl_version=1.5), "[install] p1: vllm_install_nixl_version: is 1.5, not an exact"),
    "delay_word": (install(nixl_progress_delay_us="1ms"),
                   "[install] p1: vllm_install_nixl_progress_delay_us: is '1ms': it must be a whole number"),
    "delay_bool": (install(nixl_progress_delay_us=True),
                   "[install] p1: vllm_install_nixl_progress_delay_us: is True: it must be a whole number"),
    "delay_long": (install(nixl_progress_delay_us=100001),
                   "[install] p1: vllm_install_nixl_progress_delay_us: is 100001: it must be a whole number"),
    "delay_unknown_nixl": (install(nixl_progress_delay_us=1000, nixl_version="1.6.0"),
                           "[install] p1: vllm_install_nixl_progress_delay_us: is 1000, but the delay is set by "
                           "changing NIXL's nixl_cu*/_api.py, whose content is known for NIXL 1.5.1 only"),
    "wheelhouse": (install(source="wheelhouse", wheelhouse_dir="/nonexistent/wh"),
                   "[install] p1: vllm_install_wheelhouse_dir: is '/nonexistent/wh', not a directory on the "
                   "controller holding requirements.lock"),
    "wheelhouse_empty": (install(source="wheelhouse"), "[install] p1: vllm_install_wheelhouse_dir: is empty, not a"),
    "credentials_in_url": (install(index_url="https://<credentials>@pypi.example/simple"),
                           "[install] p1: vllm_install_index_url, vllm_install_extra_index_urls: must be http:// or "
                           "https:// URLs"),
    "half_credentials": (install(index_url="https://pypi.example/simple", index_username_set=True),
                         "[install] p1: vllm_install_index_username, vllm_install_index_password: must be set "
                         "together"),
    "colon": (install(index_url="https://pypi.example/simple", index_username_set=True, index_password_set=True,
                      index_username_colon=True), "[install] p1: vllm_install_index_username: contains a colon"),
    "not_ascii": (install(index_url="https://pypi.example/simple", index_username_set=True, index_password_set=True,
                          index_credentials_ascii=False), "must be printable ASCII"),
    "broken": (install(index_credentials_broken=True), "refer to an undefined variable (is the vault file loaded?"),
    "password_for_pypi": (install(index_username_set=True, index_password_set=True),
                          "[install] p1: vllm_install_index_password: is set, but vllm_install_index_url is empty"),
    "password_over_http": (install(index_url="http://10.0.0.5/simple", index_username_set=True,
                                   index_password_set=True),
                           "[install] p1: vllm_install_index_password: is set, but vllm_install_index_url is plain"),
    "plaintext_not_bool": (install(index_allow_plaintext="yes"),
                           "[install] p1: vllm_install_index_allow_plaintext: is 'yes', not a boolean."),
    "ca_file": (install(index_ca_file="/nonexistent/ca.pem"),
                "[install] p1: vllm_install_index_ca_file: is '/nonexistent/ca.pem', not a PEM file"),
    "venv": (install(venv="/opt/vllm/venv/"), "[install] p1: vllm_install_venv: is '/opt/vllm/venv/', not an"),
    "keep": (install(keep_previous="one"), "[install] p1: vllm_install_keep_previous: is 'one', not a whole number"),
}


@pytest.mark.parametrize("case", sorted(INSTALL))
def test_the_install_role_and_the_controller_give_the_same_message(case):
    record, start = INSTALL[case]
    (line,) = pf.install_problems(record, "p1")
    assert line.startswith(start) or start in line, line
    assert " Fix: " in line
    assert line in preflight(install_records={"p1": record})


def test_allowed_plaintext_and_a_wheelhouse_with_its_lock_pass(tmp_path):
    (tmp_path / "requirements.lock").write_text("vllm==0.32.0\n", encoding="utf-8")
    assert pf.install_problems(install(source="wheelhouse", wheelhouse_dir=str(tmp_path), index_url="nonsense"),
                               "p1") == []
    assert pf.install_problems(install(index_url="http://10.0.0.5/simple", index_username_set=True,
                                       index_password_set=True, index_allow_plaintext=True), "p1") == []
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\nMII\n-----END CERTIFICATE-----\n", encoding="utf-8")
    assert pf.install_problems(install(index_url="https://pypi.example/simple", index_ca_file=str(ca)), "p1") == []


DRIVER = {
    "unquoted": (driver(branch=580), "[driver] p1: nvidia_driver_branch: is 580, not a quoted three-digit"),
    "old_cuda_repo": (driver(branch="550"), "[driver] p1: nvidia_driver_branch: is \"550\", older than 580"),
    "source": (driver(source="ppa"), "[driver] p1: nvidia_driver_source: is 'ppa', not a driver source"),
    "fabric": (driver(fabric_manager="yes"), "[driver] p1: nvidia_driver_fabric_manager: is 'yes', not auto, true"),
    "container": (driver(container=2), "[driver] p1: nvidia_driver_container: is 2, not auto, true or false."),
    "debian_fabric": (driver(source="distribution", branch="535", fabric_manager=True),
                      "[driver] p1: nvidia_driver_fabric_manager: is true, but nvidia_driver_source is "
                      "'distribution'"),
    "keyring": (driver(cuda_keyring_sha256="abc"), "[driver] p1: nvidia_driver_cuda_keyring_sha256: is 'abc', not"),
}


@pytest.mark.parametrize("case", sorted(DRIVER))
def test_the_driver_role_and_the_controller_give_the_same_message(case):
    record, start = DRIVER[case]
    (line,) = pf.driver_problems(record, "p1")
    assert line.startswith(start), line
    assert line in preflight(driver_records={"p1": record})


ROUTER = {
    "source": (router_settings(source="git"), "[router] r1: vllm_router_source: is 'git', not a place"),
    "version": (router_settings(version="0.1"), "[router] r1: vllm_router_version: is '0.1', not an exact release"),
    "wheelhouse": (router_settings(source="wheelhouse", wheelhouse_dir="/nonexistent"),
                   "[router] r1: vllm_router_wheelhouse_dir: is '/nonexistent', not a directory on the controller"),
    "stop": (router_settings(stop_timeout="0"), "[router] r1: vllm_router_stop_timeout: is '0', not a whole number"),
    "limit": (router_settings(front_limits={"rate_limit": -1, "rate_burst": 40}),
              "[router] r1: vllm_router_front_rate_limit: is -1, not a whole number (0 = no limit)."),
    "limits": (router_settings(front_limits={"rate_limit": "x", "rate_burst": "y"}),
               "[router] r1: vllm_router_front_rate_burst, vllm_router_front_rate_limit: must be whole numbers"),
    "body_unit": (router_settings(max_body_size="64 MB"),
                  "[router] r1: vllm_router_front_max_body_size: is '64 MB', not an nginx size."),
    "body_small": (router_settings(max_body_size="200k"),
                   "[router] r1: vllm_router_front_max_body_size: is 200k (204800 bytes), below 32 bytes per token "
                   "of the longest context the instances serve (max_model_len 8192 of d1)"),
    "route_path": (router_settings(extra_routes=[{"path": "/v1/x; return 200", "methods": ["POST"]}]),
                   "[router] r1: vllm_router_front_extra_routes: is"),
    "route_method": (router_settings(extra_routes=[{"path": "/v1/x", "methods": ["PUT"]}]),
                     "[router] r1: vllm_router_front_extra_routes: is"),
    "plaintext": (router_settings(front_bind="0.0.0.0", front_public=True),
                  "[router] r1: vllm_router_front_bind: is '0.0.0.0', beyond the host, and the front has no TLS"),
    "plaintext_flag": (router_settings(front_allow_plaintext="yes"),
                       "[router] r1: vllm_router_front_allow_plaintext: is 'yes', not a boolean."),
    "debug": (router_settings(log_level="debug"), "[router] r1: vllm_router_log_level: is 'debug': at debug"),
    "log_flags": (router_settings(extra_args_log_flags=True), "[router] r1: vllm_router_extra_args: sets --log-level"),
    "venv": (router_settings(venv="venv"), "[router] r1: vllm_router_venv: is 'venv', not an absolute path"),
    "worker_key": (router_settings(worker_api_key_valid=False),
                   "[secrets] r1: vllm_router_worker_api_key: is not a usable key (not shown)"),
    "tls_files": (router_settings(tls_certificate=True, tls_key=True, tls_certificate_file="/nonexistent/c.pem",
                                  tls_key_file="/nonexistent/c.key"),
                  "[secrets] r1: vllm_router_tls_certificate: is '/nonexistent/c.pem', not a file on the controller."),
}


@pytest.mark.parametrize("case", sorted(ROUTER))
def test_the_router_role_and_the_controller_give_the_same_settings_message(case):
    record, start = ROUTER[case]
    limits = [{"max_model_len": 512, "label": "p1"}, {"max_model_len": 8192, "label": "d1"}]
    lines = pf.router_problems(record, "r1", limits)
    assert lines and lines[0].startswith(start), lines
    data, groups = inventory(decode={"d1": instance("decode", address="10.0.0.21", max_model_len=8192)},
                             routers={"r1": record})
    assert set(lines) <= set(pf.pd_preflight(data, groups)), lines


def test_the_body_size_is_measured_against_the_context_vllm_resolves():
    """max_model_len 0 is the model's own (SmolLM2: 8192): the role's old Jinja read 0 and passed any size."""
    data, groups = inventory(decode={"d1": instance("decode", address="10.0.0.21", max_model_len=0)},
                             routers={"r1": router_settings(max_body_size="128k")})
    found = [line for line in pf.pd_preflight(data, groups) if line.startswith("[router]")]
    assert len(found) == 1 and "(max_model_len 8192 of d1)" in found[0] and "raise it to at least 1m" in found[0]


def test_a_router_record_of_the_old_shape_has_no_settings_to_check():
    assert pf.router_problems(router(), "r1") == []


def _monitoring_lines(records: dict[str, dict], monitoring_group: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    data, groups = published(monitoring_records=records)
    groups["monitoring"] = monitoring_group
    controller = pf.pd_preflight(data, groups)
    roles = {host: pf.monitoring_problems(data, groups, host) for host in records}
    return controller, roles


MONITORING = {
    "ports_clash": ("d1", monitoring(ports={"prometheus": 9090, "node_exporter": 8200, "nginx_exporter": 9113}),
                    "[monitoring] d1: vllm_monitoring_prometheus_port, vllm_monitoring_node_exporter_port, "
                    "vllm_monitoring_nginx_exporter_port: the host already serves 8200"),
    "ports_router": ("r1", monitoring(prometheus=True,
                                      ports={"prometheus": 29001, "node_exporter": 9100, "nginx_exporter": 9113}),
                     "[monitoring] r1: vllm_monitoring_prometheus_port, vllm_monitoring_node_exporter_port, "
                     "vllm_monitoring_nginx_exporter_port: the host already serves 29001"),
    "ports_same": ("p1", monitoring(ports={"prometheus": 9100, "node_exporter": 9100, "nginx_exporter": 9113}),
                   "must be three distinct ports from 1 to 65535"),
    "duration": ("p1", monitoring(durations={"vllm_monitoring_slo_window": "5 minutes"}),
                 "[monitoring] p1: vllm_monitoring_slo_window: must be Prometheus durations"),
    "timeout": ("p1", monitoring(durations={"vllm_monitoring_scrape_interval": "1m",
                                            "vllm_monitoring_scrape_timeout": "1m1s"}),
                "[monitoring] p1: vllm_monitoring_scrape_timeout: is 1m1s, longer than"),
    "slo": ("p1", monitoring(slo_ttft_p99_seconds=0), "[monitoring] p1: vllm_monitoring_slo_ttft_p99_seconds: is 0"),
    "share": ("p1", monitoring(fallback_ratio=1.5), "[monitoring] p1: vllm_monitoring_fallback_ratio: is 1.5, not a"),
    "floors": ("p1", monitoring(kv_throughput_min_mib_s={"nvlink": 1}),
               "[monitoring] p1: vllm_monitoring_kv_throughput_min_mib_s: is {'nvlink': 1}, not a mapping"),
    "alertmanagers": ("p1", monitoring(alertmanagers="am:9093"),
                      "[monitoring] p1: vllm_monitoring_alertmanagers: is 'am:9093', not a list"),
    "labels": ("p1", monitoring(alert_labels={"alertname": "x"}), "[monitoring] p1: vllm_monitoring_alert_labels:"),
    "targets_timeout": ("p1", monitoring(targets_timeout="2m"),
                        "[monitoring] p1: vllm_monitoring_targets_timeout: is '2m', not a whole number"),
    "remote": ("r1", monitoring(prometheus=True, listen_address="0.0.0.0"),
               "[monitoring] r1: vllm_monitoring_prometheus_listen_address: is '0.0.0.0': Prometheus' API"),
}


@pytest.mark.parametrize("case", sorted(MONITORING))
def test_the_monitoring_role_and_the_controller_give_the_same_message(case):
    host, record, start = MONITORING[case]
    records = {h: monitoring(prometheus=h == "r1") for h in ("p1", "d1", "r1")}
    records[host] = record
    controller, roles = _monitoring_lines(records, ["r1"])
    (line,) = [found for found in controller if found.startswith("[monitoring]")]
    assert line.startswith(start) or start in line, line
    assert roles[host] == [line]
    assert all(lines == [] for other, lines in roles.items() if other != host)


def test_allowed_remote_prometheus_passes():
    records = {h: monitoring(prometheus=h == "r1") for h in ("p1", "d1", "r1")}
    records["r1"] = monitoring(prometheus=True, listen_address="0.0.0.0", allow_remote=True)
    assert _monitoring_lines(records, ["r1"])[0] == []


def test_the_router_hosts_belong_to_the_monitoring_group_and_serve_stub_status():
    records = {h: monitoring(prometheus=h == "d1") for h in ("p1", "d1", "r1")}
    controller, roles = _monitoring_lines(records, ["d1"])
    line = "[monitoring] r1: groups['monitoring']: the router host is not in the monitoring group"
    assert any(found.startswith(line) for found in controller), controller
    assert all(any(found.startswith(line) for found in lines) for lines in roles.values()), roles
    data, groups = published(monitoring_records={h: monitoring(prometheus=h == "r1") for h in ("p1", "d1", "r1")},
                             routers={"r1": router_settings(stub_status_port=0)})
    (found,) = pf.pd_preflight(data, groups)
    assert found.startswith("[monitoring] r1: vllm_router_front_stub_status_port: is 0, but this router host runs "
                            "Prometheus"), found


def test_no_monitoring_group_no_monitoring_check_but_the_role_says_so():
    data, groups = published(monitoring_records={"p1": monitoring(ports={"prometheus": "x"})})
    groups.pop("monitoring")
    assert pf.pd_preflight(data, groups) == []  # deploy_pd.yml skips the role without the group
    assert pf.monitoring_problems(data, groups, "p1")[0].startswith(
        "[monitoring] groups['monitoring']: the monitoring group is empty or missing.")


def _hostvars(entry: dict[str, Any]) -> types.MappingProxyType:
    """A host's variables as hostvars gives them (a mapping that is not a dict)."""
    return types.MappingProxyType(entry)


def test_prefill_and_decode_share_one_instance_key_never_shown():
    secret = "preflight-SECRET-key-0002"
    hostvars = {
        "p1": _hostvars({"vllm_instance_published": instance("prefill", address="10.0.0.11"),
                         "vllm_instance_api_key": "preflight-test-key-00001"}),
        "d1": _hostvars({"vllm_instance_published": instance("decode", address="10.0.0.21"),
                         "vllm_instance_api_key": secret}),
        "r1": _hostvars({"vllm_router_published": router_settings()}),
    }
    groups = {"prefill": ["p1"], "decode": ["d1"], "router": ["r1"], "monitoring": []}
    (line,) = pf.pd_preflight(hostvars, groups)
    assert line.startswith("[secrets] p1, d1: vllm_instance_api_key: the prefill and decode hosts set 2 different "
                           "keys (not shown)"), line
    assert secret not in line
    hostvars["d1"] = _hostvars({**hostvars["d1"], "vllm_instance_api_key": "preflight-test-key-00001"})
    assert pf.pd_preflight(hostvars, groups) == []


def test_the_filters_are_registered():
    filters = FilterModule().filters()
    for name in ("install_problems", "driver_problems", "monitoring_problems", "router_problems"):
        assert filters[name].__name__ == name and callable(getattr(pf, name))
        assert (REPO / "plugins" / "filter" / f"{name}.yml").is_file(), name


# Fragments of the rules now held in plugins/plugin_utils/_preflight.py: a copy in a role's tasks would be a
# second place.
COPIES = {
    "roles/vllm_install/tasks/preflight.yml": ("inferops.vllm.install_problems",
                                               ["[0-9]+\\.[0-9]+\\.[0-9]+", "requirements.lock", "100000",
                                                "BEGIN CERTIFICATE", "<credentials>"]),
    "roles/nvidia_driver/tasks/preflight.yml": ("inferops.vllm.driver_problems",
                                                ["[0-9]{3}$", ">= 580", "['auto', 'true', 'false']"]),
    "roles/vllm_router/tasks/preflight.yml": ("inferops.vllm.router_problems",
                                              ["vllm_router_stop_timeout | int", "[kKmMgG]", "'warning', 'error'",
                                               "--log-(level|dir)", "vllm_router_tls_certificate is file",
                                               "32 * __max_model_len"]),
    "roles/vllm_monitoring/tasks/preflight.yml": ("inferops.vllm.monitoring_problems",
                                                  ["community.general.to_seconds", "(ms|s|m|h|d|w|y)", "intersect",
                                                   "_vllm_monitoring_instance_keys", "listen_address in"]),
}


@pytest.mark.parametrize("path", sorted(COPIES))
def test_the_roles_call_the_rules_and_hold_no_copy(path):
    text = (REPO / path).read_text(encoding="utf-8")
    call, fragments = COPIES[path]
    assert call in text, f"{path} does not call {call}"
    for fragment in fragments:
        assert fragment not in text, f"{path} repeats {fragment!r}"


class _NeedsFacts(dict):
    """Host variables where one value cannot be resolved on the controller (it needs facts)."""

    def __getitem__(self, key: str) -> Any:
        if key == "vllm_firewall_api_sources":
            raise KeyError("ansible_facts")
        return super().__getitem__(key)


def test_types_run_the_role_argument_specs_on_what_the_inventory_sets():
    pytest.importorskip("ansible.module_utils.common.arg_spec")
    hostvars = {
        "p1": types.MappingProxyType({"vllm_instance_published": instance("prefill", address="10.0.0.11"),
                                      "vllm_firewall_enabled": "maybe"}),
        "d1": types.MappingProxyType(_NeedsFacts({"vllm_instance_published": instance("decode", address="10.0.0.21"),
                                                  "vllm_firewall_api_sources": None})),
        "r1": types.MappingProxyType({"vllm_router_published": router_settings(log_level="debug"),
                                      "vllm_router_log_level": "debug",
                                      "vllm_router_health_check_interval_secs": "often"}),
    }
    groups = {"prefill": ["p1"], "decode": ["d1"], "router": ["r1"]}
    found = pf.pd_preflight(hostvars, groups)
    assert [line.split(":")[0] for line in found] == ["[router] r1", "[types] p1", "[types] r1"], found
    assert found[1].startswith("[types] p1: vllm_firewall_enabled: is of type str and we were unable to convert to "
                               "bool"), found
    assert "(roles/vllm_firewall/meta/argument_specs.yml). Fix: give it the type the argument spec documents: " \
           "ansible-doc -t role inferops.vllm.vllm_firewall." in found[1]
    assert found[2].startswith("[types] r1: vllm_router_health_check_interval_secs: is of type str and we were "
                               "unable to convert to int"), found
    # vllm_router_log_level: debug is the `router` rule's line only (its spec's choices would say it again).
    assert not any("[types] r1: vllm_router_log_level" in line for line in found)


# --------------------------------------------------------------------------- the router's stop timeout (issue #24)


def test_a_router_stop_shorter_than_the_request_timeout_is_a_warning_not_a_problem():
    """vllm-router finishes its running streams on SIGTERM, within the unit's TimeoutStopSec: 120 s (the old default)
    cut every longer stream at each replica restart of a rolling restart."""
    data, groups = published(routers={"r1": router_settings(stop_timeout=120)})
    assert pf.pd_preflight(data, groups) == []
    warnings = pf.pd_preflight_warnings(data, groups, {})
    assert warnings == [
        "[router] r1: vllm_router_stop_timeout: is 120 s, shorter than vllm_router_request_timeout_secs (1800 s): each "
        "router replica restart (every rolling restart's put-back, a new vllm-router) cuts the streams it runs that "
        "last longer than 120 s. Fix: remove it (its default is the request timeout: a restart waits only for the "
        "longest running request), or accept the cut streams."
    ], warnings


@pytest.mark.parametrize("record", [router_settings(), router_settings(stop_timeout=3600),
                                    {k: v for k, v in router_settings(stop_timeout=120).items()
                                     if k != "request_timeout"}])
def test_no_warning_when_the_stop_covers_the_request_timeout_or_it_is_not_known(record):
    data, groups = published(routers={"r1": record})
    assert [w for w in pf.pd_preflight_warnings(data, groups, {}) if "stop_timeout" in w] == []


def test_the_roles_default_stop_timeout_is_the_request_timeout():
    defaults = (REPO / "roles" / "vllm_router" / "defaults" / "main.yml").read_text(encoding="utf-8")
    assert 'vllm_router_stop_timeout: "{{ vllm_router_request_timeout_secs }}"' in defaults


def _pair(tmp_path: Path, name: str, days: tuple[int, int] = (-1, 30), passphrase: bytes | None = None,
          key_of: str | None = None) -> tuple[str, str]:
    """A self-signed certificate and its key in PEM files; `key_of` writes another pair's key instead."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    certificate = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now + datetime.timedelta(days=days[0]))
                   .not_valid_after(now + datetime.timedelta(days=days[1])).sign(key, hashes.SHA256()))
    encryption = (serialization.BestAvailableEncryption(passphrase) if passphrase
                  else serialization.NoEncryption())
    cert_path, key_path = tmp_path / f"{name}.pem", tmp_path / f"{name}.key"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    if key_of is None:
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               encryption))
    else:
        key_path.write_bytes((tmp_path / f"{key_of}.key").read_bytes())
    return str(cert_path), str(key_path)


def _tls_lines(cert: str, key: str) -> list[str]:
    record = router_settings(tls=True, tls_certificate=True, tls_key=True, tls_certificate_file=cert,
                             tls_key_file=key)
    return [line for line in pf.router_problems(record, "r1") if "tls" in line]


def test_a_matching_current_certificate_and_key_pass(tmp_path):
    assert _tls_lines(*_pair(tmp_path, "front")) == []


@pytest.mark.parametrize(("case", "start"), [
    ("mismatch", "[secrets] r1: vllm_router_tls_certificate, vllm_router_tls_key: the key"),
    ("expired", "[secrets] r1: vllm_router_tls_certificate: '"),
    ("future", "[secrets] r1: vllm_router_tls_certificate: '"),
    ("passphrase", "[secrets] r1: vllm_router_tls_key: '"),
    ("not_pem", "[secrets] r1: vllm_router_tls_certificate: '"),
])
def test_a_pair_nginx_would_not_load_or_clients_would_refuse_is_refused(tmp_path, case, start):
    """nginx's reload keeps the old configuration when the new pair does not load (and says so in its error log
    only): a certificate rotation to a bad pair would look done. Each is refused before any host changes."""
    if case == "mismatch":
        _pair(tmp_path, "other")
        cert, key = _pair(tmp_path, "front", key_of="other")
        said = "is not the key of the certificate"
    elif case == "expired":
        cert, key = _pair(tmp_path, "front", days=(-30, -1))
        said = "expired on"
    elif case == "future":
        cert, key = _pair(tmp_path, "front", days=(2, 30))
        said = "is valid only from"
    elif case == "passphrase":
        cert, key = _pair(tmp_path, "front", passphrase=b"secret-passphrase")
        said = "is encrypted with a passphrase"
    else:
        cert, key = _pair(tmp_path, "front")
        Path(cert).write_text("not a certificate\n")
        said = "holds no PEM certificate"
    lines = _tls_lines(cert, key)
    assert len(lines) == 1 and lines[0].startswith(start) and said in lines[0], lines
    assert "secret-passphrase" not in lines[0] and "PRIVATE KEY" not in lines[0]
