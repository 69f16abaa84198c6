"""roles/vllm_monitoring's alert rules: rendered by the real ansible-playbook (the role's own task, its
promtool validation included), checked with `promtool check rules`, and run through `promtool test rules`
with hand-written series that make each alert fire, and others (or earlier times) where it stays quiet.

Three renderings: the role's defaults; the defaults on a router host whose front has fallback endpoints
(vllm_router_front_fallbacks), which adds the alerts on the front's fallback counters; and custom objectives,
thresholds, `for` durations and alert labels (with fallbacks), under which some series that are quiet by
default fire (and one that fires by default is quiet). The fallback alerts are rendered only where Prometheus
scrapes the front's counters, which is also checked through the role's vars/main.yml with routers that have
fallbacks and routers that do not. promtool is Debian 12's (scripts/promtool.sh), the Prometheus the role
installs.
"""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import yaml
from monitoring_support import ANSIBLE_PLAYBOOK, ROLE, config_files_task, prom_report, promtool, run_playbook

pytestmark = pytest.mark.skipif(ANSIBLE_PLAYBOOK is None, reason="ansible-playbook is not installed")

FRONT_ALERTS = {"InferopsFrontFallingBack", "InferopsFrontFallbackExhausted"}
FALLBACK_METRICS_URL = "http://127.0.0.1:8090/fallback_metrics"

DEFAULTS = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text(encoding="utf-8"))
CUSTOM = {
    "vllm_monitoring_slo_ttft_p99_seconds": 0.5,
    "vllm_monitoring_slo_itl_p99_seconds": 0.04,
    "vllm_monitoring_slo_for": "2m",
    "vllm_monitoring_instance_down_for": "3m",
    "vllm_monitoring_no_healthy_worker_for": "2m",
    "vllm_monitoring_kv_cache_usage_threshold": 0.8,
    "vllm_monitoring_kv_cache_usage_for": "2m",
    "vllm_monitoring_fallback_ratio": 0.3,
    "vllm_monitoring_alert_labels": {"team": "inference"},
    "vllm_monitoring_front_fallback_window": "4m",
    "vllm_monitoring_front_fallback_for": "3m",
    # An RDMA deployment: the slow-transfer alert's floor is rdma's.
    "_vllm_monitoring_kv_transport": "rdma",
    "vllm_monitoring_kv_throughput_for": "5m",
}
# A router host whose front has fallback endpoints: what the role's vars/main.yml makes of vllm_router's published
# record (the variables the template and prometheus.yml's nginx-fallback job read).
FRONT = {"_vllm_monitoring_is_router": True, "_vllm_monitoring_router": {"fallback_metrics_url": FALLBACK_METRICS_URL}}
RENDERINGS = {"defaults": {}, "fallbacks": FRONT, "custom": {**CUSTOM, **FRONT}}


def rules_task(path: str) -> dict[str, Any]:
    """The role's task that writes the alert rules (and Prometheus' configuration), writing only the rules, to
    ``path`` (a Jinja expression), validated by promtool as on a host."""
    return config_files_task(
        "configure.yml",
        "Write Prometheus' alert rules, the instances' key and the configuration (scrape targets from the inventory)",
        path,
        keys=("rules",),
    )


def _render(tmp, name: str, overrides: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    task = rules_task(f"'{tmp / (name + '.rules.yml')}'")
    plays = [
        {
            "name": "Render the monitoring role's alert rules",
            "hosts": "localhost",
            "gather_facts": False,
            "tasks": [
                {"name": "The role's defaults", "ansible.builtin.include_vars": str(ROLE / "defaults" / "main.yml")},
                task,
            ],
        }
    ]
    return run_playbook(tmp, f"render-{name}", plays, extra={"_vllm_monitoring_promtool": promtool(), **overrides})


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("monitoring-rules")
    promtool()  # once, before the parallel runs
    with ThreadPoolExecutor(max_workers=len(RENDERINGS)) as pool:
        runs = {name: pool.submit(_render, tmp, name, overrides) for name, overrides in RENDERINGS.items()}
        runs = {name: future.result() for name, future in runs.items()}
    for name, run in runs.items():
        assert run.returncode == 0, f"{name}:\n{run.stdout}{run.stderr}"
    return {name: (tmp / f"{name}.rules.yml").read_text(encoding="utf-8") for name in RENDERINGS}


def config(name: str) -> dict[str, Any]:
    return {**DEFAULTS, **RENDERINGS[name]}


def front_has_fallbacks(cfg: dict[str, Any]) -> bool:
    return bool(cfg.get("_vllm_monitoring_is_router")) and bool(
        cfg.get("_vllm_monitoring_router", {}).get("fallback_metrics_url")
    )


def increase(values: list[int], t: int, window: int) -> float:
    """Prometheus 2.42's increase() over [t - window, t] of a counter sampled every minute from 0m, when a sample
    sits on both ends (no extrapolation): a value below the previous one is a reset (the count file deleted)."""
    assert t >= window, "the window must start at or after the first sample"
    samples = values[t - window : t + 1]
    resets = sum(prev for prev, cur in zip(samples[:-1], samples[1:], strict=True) if cur < prev)
    return samples[-1] - samples[0] + resets


def minutes(duration: str) -> int:
    seconds = prom_report.parse_duration(duration)
    assert seconds % 60 == 0, f"the series here are a minute apart: {duration}"
    return int(seconds // 60)


# --------------------------------------------------------------------------- the hand-written series

P = {"job": "vllm", "role": "prefill", "host": "p1", "instance_name": "prefill-0", "instance": "10.0.0.11:8100"}
D = {"job": "vllm", "role": "decode", "host": "d1", "instance_name": "decode-0", "instance": "10.0.0.21:8200"}
VLLM = {"model_name": "m", "engine": "0"}
R0 = {
    "job": "vllm-router",
    "role": "router",
    "host": "r1",
    "instance_name": "vllm-router@0",
    "instance": "127.0.0.1:29000",
}
R1 = {**R0, "instance_name": "vllm-router@1", "instance": "127.0.0.1:29001"}
R2 = {**R0, "instance_name": "vllm-router@2", "instance": "127.0.0.1:29002"}
NODE_D = {"job": "node", "role": "decode", "host": "d1", "instance": "10.0.0.21:9100"}
NODE_P = {"job": "node", "role": "prefill", "host": "p1", "instance": "10.0.0.11:9100"}
NGINX = {"job": "nginx", "role": "router", "host": "r1", "instance": "127.0.0.1:9113"}
FRONT_FB = {"job": "nginx-fallback", "role": "router", "host": "r1", "instance": "127.0.0.1:8090"}
FRONT_GROUPED = ("job", "role", "host", "fallback", "reason")
GROUPED = ("job", "role", "host", "instance_name")


def series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    inner = ", ".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{inner}}}", "values": values}


def worker(router: dict[str, str], pool: str, values: str) -> dict[str, str]:
    url = "http://10.0.0.11:8100" if pool == "prefill" else "http://10.0.0.21:8200"
    return series(
        "vllm_router_worker_health", {**router, "worker": url, "worker_role": pool, "worker_name": f"{pool}-0"}, values
    )


def buckets(name: str, labels: dict[str, str], per_minute: dict[str, int]) -> list[dict[str, str]]:
    """A histogram whose buckets (cumulative, as given) grow by these counts every minute."""
    return [series(f"{name}_bucket", {**labels, "le": le}, f"0+{n}x30") for le, n in per_minute.items()]


def alert(cfg: dict[str, Any], severity: str, labels: dict[str, str], summary: str, description: str) -> dict[str, Any]:
    return {
        "exp_labels": {**labels, "severity": severity, **cfg["vllm_monitoring_alert_labels"]},
        "exp_annotations": {"summary": summary, "description": description},
    }


def only(labels: dict[str, str], keys=GROUPED) -> dict[str, str]:
    return {k: labels[k] for k in keys}


def promtool_tests(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """The `tests:` of a promtool test file for rules rendered with ``cfg``."""
    down = minutes(cfg["vllm_monitoring_instance_down_for"])
    no_worker = minutes(cfg["vllm_monitoring_no_healthy_worker_for"])
    nixl_window = minutes(cfg["vllm_monitoring_nixl_window"])
    kv_for = minutes(cfg["vllm_monitoring_kv_cache_usage_for"])
    kv_threshold = float(cfg["vllm_monitoring_kv_cache_usage_threshold"])
    slo_for = minutes(cfg["vllm_monitoring_slo_for"])
    slo_window = minutes(cfg["vllm_monitoring_slo_window"])
    ttft, itl = float(cfg["vllm_monitoring_slo_ttft_p99_seconds"]), float(cfg["vllm_monitoring_slo_itl_p99_seconds"])
    fb_window, fb_for = minutes(cfg["vllm_monitoring_fallback_window"]), minutes(cfg["vllm_monitoring_fallback_for"])
    ratio = float(cfg["vllm_monitoring_fallback_ratio"])
    front_window = minutes(cfg["vllm_monitoring_front_fallback_window"])
    front_for = minutes(cfg["vllm_monitoring_front_fallback_for"])
    front = front_has_fallbacks(cfg)
    transport = cfg.get("_vllm_monitoring_kv_transport", "tcp")
    floor = float(cfg["vllm_monitoring_kv_throughput_min_mib_s"][transport])
    kv_slow_for = minutes(cfg["vllm_monitoring_kv_throughput_for"])
    kv_slow_window = cfg["vllm_monitoring_kv_throughput_window"]

    def instance_down(labels):
        return alert(
            cfg,
            "critical",
            labels,
            f"vLLM {labels['role']} instance {labels['instance_name']} on {labels['host']} is down",
            f"Prometheus cannot scrape {labels['instance']}/metrics. The router takes the instance out of "
            "rotation; a pool with no instance left serves nothing.",
        )

    def router_down(labels):
        return alert(
            cfg,
            "critical",
            labels,
            f"vllm-router replica {labels['instance_name']} on {labels['host']} is down",
            f"Prometheus cannot scrape {labels['instance']}. nginx sends requests to the other replicas, if any.",
        )

    def exporter_down(labels):
        return alert(
            cfg,
            "warning",
            labels,
            f"{labels['job']} exporter on {labels['host']} is down",
            f"Prometheus cannot scrape {labels['instance']}: the host's (or the front's) metrics are missing.",
        )

    def no_healthy(labels, pool):
        return alert(
            cfg,
            "critical",
            labels,
            f"vllm-router {labels['instance_name']} on {labels['host']} has no healthy {pool} instance",
            f"The router's health checks count no {pool} instance healthy (vllm_router_worker_health): PD "
            "requests through it fail with 503.",
        )

    def nixl_failed(labels, value):
        return alert(
            cfg,
            "critical",
            {**labels, **VLLM},
            f"NIXL transfers failed on {labels['role']} instance {labels['instance_name']} ({labels['host']})",
            f"{value} failed NIXL KV transfers in the last {cfg['vllm_monitoring_nixl_window']}. Decode answers "
            "them with an error (kv_load_failure_policy fail) or recomputes the prompt itself (recompute). A peer "
            "refused or reset once stays disconnected until the instance restarts: once the KV path works, roll it "
            "(docs/day2.md, a broken KV path).",
        )

    def kv_slow(labels, value):
        why = ("On rdma this is the speed of TCP: UCX fell back (docs/fabric.md: ucx_info -d, UCX_PROTO_INFO=y)."
               if transport == "rdma" else "Look for a crowded CPU, a busy-polling NIXL worker, or a peer restarted "
               "under a decode that kept its old connection.")
        return alert(
            cfg,
            "warning",
            {**only(labels), "kv_transport": transport},
            f"KV reaches {labels['role']} instance {labels['instance_name']} ({labels['host']}) at {value} MiB/s",
            f"Below the {floor} MiB/s expected over {transport} (vllm_monitoring_kv_throughput_min_mib_s) for "
            f"{cfg['vllm_monitoring_kv_throughput_for']}, measured over {kv_slow_window} as NIXL's bytes over its own "
            f"transfer time. {why}",
        )

    def kv_expired(labels, value):
        return alert(
            cfg,
            "warning",
            {**labels, **VLLM},
            f"KV expired on {labels['role']} instance {labels['instance_name']} ({labels['host']}) before "
            "decode fetched it",
            f"{value} requests' KV expired in the last {cfg['vllm_monitoring_nixl_window']}: prefill computed "
            "them for nothing (a decode that died or never asked; one-token prompts, which vLLM never hands "
            "over, end this way too).",
        )

    def kv_full(labels, value):
        return alert(
            cfg,
            "warning",
            {**labels, **VLLM},
            f"KV cache of {labels['role']} instance {labels['instance_name']} ({labels['host']}) is {value} full",
            f"Above {round(kv_threshold * 100, 1)} % for {cfg['vllm_monitoring_kv_cache_usage_for']}: requests "
            "queue or are preempted. Add instances to the pool, or give them more KV memory (fp8 KV holds "
            "twice the tokens).",
        )

    def ttft_over(labels, value):
        return alert(
            cfg,
            "warning",
            only(labels),
            f"p99 time to first token of {labels['role']} instance {labels['instance_name']} ({labels['host']}) "
            f"is {value}",
            f"Over the objective of {ttft} s (vllm_monitoring_slo_ttft_p99_seconds) for "
            f"{cfg['vllm_monitoring_slo_for']}, measured by vLLM per instance over "
            f"{cfg['vllm_monitoring_slo_window']}. A client sees about prefill's plus the KV transfer plus decode's.",
        )

    def itl_over(labels, value):
        return alert(
            cfg,
            "warning",
            only(labels),
            f"p99 inter-token latency of {labels['role']} instance {labels['instance_name']} ({labels['host']}) "
            f"is {value}",
            f"Over the objective of {itl} s (vllm_monitoring_slo_itl_p99_seconds) for "
            f"{cfg['vllm_monitoring_slo_for']}, measured by vLLM per instance over "
            f"{cfg['vllm_monitoring_slo_window']}.",
        )

    def fallback(labels, value):
        return alert(
            cfg,
            "critical",
            only(labels),
            f"Decode instance {labels['instance_name']} ({labels['host']}) computes prompts itself instead of "
            "receiving their KV over NIXL",
            f"It computed {value} prompt tokens/s itself beyond the one per request vLLM recomputes (over "
            f"{round(ratio * 100, 1)} % of its prompt tokens, for {cfg['vllm_monitoring_fallback_for']}) while "
            "prefill serves traffic: the KV transfer fails or is bypassed. Look at "
            "vllm:nixl_num_failed_transfers_total and the decode journal.",
        )

    def falling_back(labels, value):
        window = cfg["vllm_monitoring_front_fallback_window"]
        return alert(
            cfg,
            "warning",
            only(labels, FRONT_GROUPED),
            f"The front on {labels['host']} sends requests to the fallback endpoint {labels['fallback']} "
            f"({labels['reason']})",
            f"{value} requests went to {labels['fallback']} in the last {window}, and some in every {window} for "
            f"{cfg['vllm_monitoring_front_fallback_for']}: the local pool fails (local_5xx, unreachable, timeout, "
            "other), is saturated (local_429) or the client's key is over its own limits (limited); the reason label "
            "says which. The cloud bills these requests.",
        )

    def exhausted(labels, value):
        return alert(
            cfg,
            "critical",
            only(labels, FRONT_GROUPED),
            f"Clients of the front on {labels['host']} got errors: the local service and every fallback endpoint "
            f"failed ({labels['reason']})",
            f"{value} requests in the last {cfg['vllm_monitoring_front_fallback_window']} got a 502 or 503 from the "
            f"front: the local pool did not serve them ({labels['reason']}) and no fallback endpoint could "
            "(unreachable, timed out or refused the key). /var/log/nginx/inferops-vllm.fallback.log on "
            f"{labels['host']} has each request.",
        )

    groups = []

    # Down: decode-0, router replica 0 and decode's node exporter stop answering at 2m; the others answer.
    groups.append(
        {
            "interval": "1m",
            "input_series": [
                series("up", D, "1 1 0x20"),
                series("up", P, "1x22"),
                series("up", R0, "1 1 0x20"),
                series("up", R1, "1x22"),
                series("up", NODE_D, "1 1 0x20"),
                series("up", NODE_P, "1x22"),
                series("up", NGINX, "1x22"),
            ],
            "alert_rule_test": [
                *(
                    {"eval_time": t, "alertname": a, "exp_alerts": []}
                    for t in ("1m", "2m")
                    for a in ("VllmInstanceDown", "VllmRouterDown", "InferopsExporterDown")
                ),
                {"eval_time": f"{2 + down + 1}m", "alertname": "VllmInstanceDown", "exp_alerts": [instance_down(D)]},
                {"eval_time": f"{2 + down + 1}m", "alertname": "VllmRouterDown", "exp_alerts": [router_down(R0)]},
                {
                    "eval_time": f"{2 + down + 1}m",
                    "alertname": "InferopsExporterDown",
                    "exp_alerts": [exporter_down(NODE_D)],
                },
            ],
        }
    )

    # Router workers: replica 0's decode turns unhealthy at 2m; replica 1 reports no prefill worker at all;
    # replica 2 is down (its own alert covers it), whatever its workers' last values.
    groups.append(
        {
            "interval": "1m",
            "input_series": [
                series("up", R0, "1x22"),
                series("up", R1, "1x22"),
                series("up", R2, "0x22"),
                worker(R0, "prefill", "1x22"),
                worker(R0, "decode", "1 1 0x20"),
                worker(R1, "decode", "1x22"),
                worker(R2, "prefill", "0x22"),
                worker(R2, "decode", "0x22"),
            ],
            "alert_rule_test": [
                {"eval_time": "1m", "alertname": "VllmRouterNoHealthyDecode", "exp_alerts": []},
                {
                    "eval_time": f"{2 + no_worker + 1}m",
                    "alertname": "VllmRouterNoHealthyDecode",
                    "exp_alerts": [no_healthy(R0, "decode")],
                },
                {
                    "eval_time": f"{no_worker + 1}m",
                    "alertname": "VllmRouterNoHealthyPrefill",
                    "exp_alerts": [no_healthy(R1, "prefill")],
                },
            ],
        }
    )
    # Everything healthy: both quiet.
    groups.append(
        {
            "interval": "1m",
            "input_series": [
                series("up", R0, "1x22"),
                worker(R0, "prefill", "1x22"),
                worker(R0, "decode", "1x22"),
            ],
            "alert_rule_test": [
                {"eval_time": "10m", "alertname": a, "exp_alerts": []}
                for a in ("VllmRouterNoHealthyDecode", "VllmRouterNoHealthyPrefill", "VllmRouterDown")
            ],
        }
    )

    # NIXL: decode counts a failed transfer at 3m, prefill two expired KV; the others stay at 0. Quiet again
    # once the window no longer holds the increase.
    groups.append(
        {
            "interval": "1m",
            "input_series": [
                series("vllm:nixl_num_failed_transfers_total", {**D, **VLLM}, "0 0 0 1x20"),
                series("vllm:nixl_num_failed_transfers_total", {**P, **VLLM}, "0x23"),
                series("vllm:nixl_num_kv_expired_reqs_total", {**P, **VLLM}, "0 0 0 2x20"),
                series("vllm:nixl_num_kv_expired_reqs_total", {**D, **VLLM}, "0x23"),
            ],
            "alert_rule_test": [
                {"eval_time": "2m", "alertname": "VllmNixlTransferFailures", "exp_alerts": []},
                {"eval_time": "4m", "alertname": "VllmNixlTransferFailures", "exp_alerts": [nixl_failed(D, "1")]},
                {"eval_time": f"{3 + nixl_window + 1}m", "alertname": "VllmNixlTransferFailures", "exp_alerts": []},
                {"eval_time": "2m", "alertname": "VllmNixlKvExpired", "exp_alerts": []},
                {"eval_time": "4m", "alertname": "VllmNixlKvExpired", "exp_alerts": [kv_expired(P, "2")]},
                {"eval_time": f"{3 + nixl_window + 1}m", "alertname": "VllmNixlKvExpired", "exp_alerts": []},
            ],
        }
    )

    # KV throughput: decode receives 983040 bytes per minute in 20 ms of NIXL time (46.9 MiB/s, the sandbox's
    # TCP order), a second decode 1 MiB in 2 s (0.5 MiB/s, a stalled path); a prefill moves nothing (no rate,
    # never an alert). tcp's floor (1) catches the stalled one only, rdma's (100) both.
    d2 = {**D, "host": "d2", "instance_name": "decode-1", "instance": "10.0.0.22:8200"}
    slow = [kv_slow(d2, "0.5")] + ([kv_slow(D, "46.9")] if 46.875 < floor else [])
    groups.append(
        {
            "interval": "1m",
            "input_series": [
                series("vllm:nixl_bytes_transferred_sum", {**D, **VLLM}, "0+983040x30"),
                series("vllm:nixl_xfer_time_seconds_sum", {**D, **VLLM}, "0+0.02x30"),
                series("vllm:nixl_bytes_transferred_sum", {**d2, **VLLM}, "0+1048576x30"),
                series("vllm:nixl_xfer_time_seconds_sum", {**d2, **VLLM}, "0+2x30"),
                series("vllm:nixl_bytes_transferred_sum", {**P, **VLLM}, "0x30"),
                series("vllm:nixl_xfer_time_seconds_sum", {**P, **VLLM}, "0x30"),
            ],
            "alert_rule_test": [
                {"eval_time": "1m", "alertname": "VllmKvTransferSlow", "exp_alerts": []},
                {"eval_time": f"{1 + kv_slow_for + 1}m", "alertname": "VllmKvTransferSlow", "exp_alerts": slow},
            ],
        }
    )

    # KV cache: decode at 95 % from 1m; prefill at 85 % (over a threshold of 0.8, not of 0.9).
    kv_fire = [kv_full(P, "85%")] if 0.85 > kv_threshold else []
    groups.append(
        {
            "interval": "1m",
            "input_series": [
                series("vllm:kv_cache_usage_perc", {**D, **VLLM}, "0.5 0.95x22"),
                series("vllm:kv_cache_usage_perc", {**P, **VLLM}, "0.85x23"),
            ],
            "alert_rule_test": [
                {"eval_time": "1m", "alertname": "VllmKvCacheNearlyFull", "exp_alerts": []},
                {
                    "eval_time": f"{1 + kv_for + 1}m",
                    "alertname": "VllmKvCacheNearlyFull",
                    "exp_alerts": [*kv_fire, kv_full(D, "95%")],
                },
            ],
        }
    )

    # Latency: prefill's first tokens all beyond the largest finite bucket (p99 = 2.5 s), decode's between
    # 0.5 and 1 s (p99 0.995 s); decode's inter-token latencies between 0.1 and 0.25 s (p99 0.2485 s),
    # prefill's under 0.05 s (p99 0.0495 s).
    ttft_b = "vllm:time_to_first_token_seconds"
    itl_b = "vllm:inter_token_latency_seconds"
    t_fire = f"{slo_for + slo_window + 1}m"
    ttft_alerts = [a for v, a in ((2.5, ttft_over(P, "2.5s")), (0.995, ttft_over(D, "995ms"))) if v > ttft]
    itl_alerts = [a for v, a in ((0.2485, itl_over(D, "248.5ms")), (0.0495, itl_over(P, "49.5ms"))) if v > itl]
    groups.append(
        {
            "interval": "1m",
            "input_series": [
                *buckets(ttft_b, {**P, **VLLM}, {"0.5": 0, "1": 0, "2.5": 0, "+Inf": 10}),
                *buckets(ttft_b, {**D, **VLLM}, {"0.5": 0, "1": 10, "2.5": 10, "+Inf": 10}),
                *buckets(itl_b, {**D, **VLLM}, {"0.05": 0, "0.1": 0, "0.25": 50, "+Inf": 50}),
                *buckets(itl_b, {**P, **VLLM}, {"0.05": 50, "0.1": 50, "0.25": 50, "+Inf": 50}),
            ],
            "alert_rule_test": [
                {"eval_time": f"{slo_for}m", "alertname": "VllmTtftP99OverSlo", "exp_alerts": []},
                {"eval_time": t_fire, "alertname": "VllmTtftP99OverSlo", "exp_alerts": ttft_alerts},
                {"eval_time": f"{slo_for}m", "alertname": "VllmItlP99OverSlo", "exp_alerts": []},
                {"eval_time": t_fire, "alertname": "VllmItlP99OverSlo", "exp_alerts": itl_alerts},
            ],
        }
    )

    # Silent colocated fallback, tokens per minute. d1 computes every prompt token itself (600/min for 60
    # requests); d2 hands over properly (one local token per request); d3 computes 180 of 600 itself
    # (2 tokens/s beyond one per request: over 10 % of its 10 tokens/s, not over 30 %). Prefill computes.
    d2 = {**D, "host": "d2", "instance": "10.0.0.22:8200"}
    d3 = {**D, "host": "d3", "instance": "10.0.0.23:8200"}

    def decode(labels, local, external, requests):
        source = "vllm:prompt_tokens_by_source_total"
        return [
            series(source, {**labels, **VLLM, "source": "local_compute"}, f"0+{local}x30"),
            series(source, {**labels, **VLLM, "source": "local_cache_hit"}, "0x31"),
            series(source, {**labels, **VLLM, "source": "external_kv_transfer"}, f"0+{external}x30"),
            series("vllm:request_prompt_tokens_count", {**labels, **VLLM}, f"0+{requests}x30"),
        ]

    prefill_busy = series("vllm:prompt_tokens_by_source_total", {**P, **VLLM, "source": "local_compute"}, "0+1200x30")
    prefill_idle = series("vllm:prompt_tokens_by_source_total", {**P, **VLLM, "source": "local_compute"}, "0x31")
    fb_fire = f"{fb_window + fb_for + 1}m"
    fb_alerts = [fallback(D, "9")] + ([fallback(d3, "2")] if 2 > ratio * 10 else [])
    groups.append(
        {
            "interval": "1m",
            "input_series": [
                *decode(D, 600, 0, 60),
                *decode(d2, 60, 540, 60),
                *decode(d3, 180, 420, 60),
                prefill_busy,
            ],
            "alert_rule_test": [
                {"eval_time": f"{fb_for}m", "alertname": "VllmSilentColocatedFallback", "exp_alerts": []},
                {"eval_time": fb_fire, "alertname": "VllmSilentColocatedFallback", "exp_alerts": fb_alerts},
            ],
        }
    )
    # The same decode, but prefill serves nothing (and so does nothing go through it): quiet.
    groups.append(
        {
            "interval": "1m",
            "input_series": [*decode(D, 600, 0, 60), prefill_idle],
            "alert_rule_test": [
                {"eval_time": fb_fire, "alertname": "VllmSilentColocatedFallback", "exp_alerts": []},
            ],
        }
    )

    # The front's fallback counters (inferops_vllm_front_fallbacks_total, one series per endpoint and reason, from
    # 0 when nginx opens its count files), a minute apart. cloud-a/local_5xx rises from 2m on; cloud-b/unreachable
    # too, but its count file is deleted and recreated (a counter reset) shortly before the alert fires;
    # cloud-a/limited stays flat above 0; cloud-b/local_429 only resets (a deleted file, no new fallback);
    # "none" (every endpoint failed) rises, which is the other alert's; the same counter under another job rises.
    # Without fallbacks on the router the rules have neither alert: nothing fires, whatever the series.
    length = 2 + front_for + front_window + 10
    fire = 2 + front_for + 1
    assert fire >= front_window

    def counter(labels, fallback, reason, values):
        assert len(values) == length
        full = {**labels, "fallback": fallback, "reason": reason}
        return full, series("inferops_vllm_front_fallbacks_total", full, " ".join(str(v) for v in values))

    rising = [0, 0] + list(range(1, length - 1))
    reset_at = front_for + 1  # inside the window the alert fires with
    with_reset = [0, 0] + list(range(1, reset_at - 1)) + list(range(length - reset_at))
    local_5xx, s_local_5xx = counter(FRONT_FB, "cloud-a", "local_5xx", rising)
    unreachable, s_unreachable = counter(FRONT_FB, "cloud-b", "unreachable", with_reset)
    _flat, s_flat = counter(FRONT_FB, "cloud-a", "limited", [7] * length)
    _reset_only, s_reset_only = counter(FRONT_FB, "cloud-b", "local_429", [3] * 5 + [0] * (length - 5))
    _none, s_none = counter(FRONT_FB, "none", "unreachable", rising)
    _other_job, s_other_job = counter({**FRONT_FB, "job": "nginx"}, "cloud-a", "timeout", rising)
    assert with_reset[reset_at] == 0 and with_reset[reset_at - 1] > 0 and fire - front_window < reset_at

    def value(values):
        return f"{increase(values, fire, front_window):.0f}"

    fb_alerts = [falling_back(local_5xx, value(rising)), falling_back(unreachable, value(with_reset))]
    groups.append(
        {
            "interval": "1m",
            "input_series": [s_local_5xx, s_unreachable, s_flat, s_reset_only, s_none, s_other_job],
            "alert_rule_test": [
                {"eval_time": "1m", "alertname": "InferopsFrontFallingBack", "exp_alerts": []},
                # Pending since 2m, for less than its `for`.
                {"eval_time": f"{1 + front_for}m", "alertname": "InferopsFrontFallingBack", "exp_alerts": []},
                {
                    "eval_time": f"{fire}m",
                    "alertname": "InferopsFrontFallingBack",
                    "exp_alerts": fb_alerts if front else [],
                },
            ],
        }
    )

    # Every endpoint failed for one request at 3m (reason unreachable); "none"/other stays flat above 0; the
    # endpoints' own counters and another job's "none" rise. Quiet again once the window no longer holds it.
    one = [0, 0, 0] + [1] * (length - 3)
    none_unreachable, s_none_unreachable = counter(FRONT_FB, "none", "unreachable", one)
    _none_flat, s_none_flat = counter(FRONT_FB, "none", "other", [2] * length)
    _none_other_job, s_none_other_job = counter({**FRONT_FB, "job": "nginx"}, "none", "timeout", rising)
    groups.append(
        {
            "interval": "1m",
            "input_series": [s_none_unreachable, s_none_flat, s_local_5xx, s_none_other_job],
            "alert_rule_test": [
                {"eval_time": "2m", "alertname": "InferopsFrontFallbackExhausted", "exp_alerts": []},
                {
                    "eval_time": "4m",
                    "alertname": "InferopsFrontFallbackExhausted",
                    "exp_alerts": [exhausted(none_unreachable, "1")] if front else [],
                },
                {
                    "eval_time": f"{3 + front_window + 1}m",
                    "alertname": "InferopsFrontFallbackExhausted",
                    "exp_alerts": [],
                },
            ],
        }
    )
    return groups


# --------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("name", sorted(RENDERINGS))
def test_promtool_check_rules(rendered, tmp_path, name):
    path = tmp_path / "rules.yml"
    path.write_text(rendered[name], encoding="utf-8")
    run = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    count = len(prom_report.rules_from_text(rendered[name]))
    assert f"SUCCESS: {count} rules found" in run.stdout + run.stderr


@pytest.mark.parametrize("name", sorted(RENDERINGS))
def test_every_alert_fires_and_stays_quiet(rendered, tmp_path, name):
    cfg = config(name)
    (tmp_path / "rules.yml").write_text(rendered[name], encoding="utf-8")
    groups = promtool_tests(cfg)
    (tmp_path / "test.yml").write_text(
        yaml.safe_dump({"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": groups}, sort_keys=False),
        encoding="utf-8",
    )
    run = subprocess.run(
        [promtool(), "test", "rules", "test.yml"], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stdout + run.stderr

    # Every alert of the file is tested both ways.
    alerts = {r["alert"] for r in prom_report.rules_from_text(rendered[name])}
    tests = [t for g in groups for t in g["alert_rule_test"]]
    fired = {t["alertname"] for t in tests if t["exp_alerts"]}
    quiet = {t["alertname"] for t in tests if not t["exp_alerts"]}
    assert fired == alerts, f"alerts never made to fire: {sorted(alerts - fired)}"
    assert quiet >= alerts, f"alerts never checked quiet: {sorted(alerts - quiet)}"


def test_custom_settings_change_what_fires():
    """The custom rendering is not the default one under another name: its series verdicts differ."""

    def firing(cfg):
        return {
            (t["alertname"], t["eval_time"], len(t["exp_alerts"]))
            for g in promtool_tests(cfg)
            for t in g["alert_rule_test"]
        }

    assert firing(config("defaults")) != firing(config("custom"))
    custom = [t for g in promtool_tests(config("custom")) for t in g["alert_rule_test"]]
    # Under the custom objectives both instances are over them, and the prefill's 85 % KV cache is too full.
    assert {len(t["exp_alerts"]) for t in custom if t["alertname"] == "VllmTtftP99OverSlo"} == {0, 2}
    assert any(a["exp_labels"]["team"] == "inference" for t in custom for a in t["exp_alerts"])


@pytest.mark.parametrize("name", sorted(RENDERINGS))
def test_prom_report_renders_the_rules_as_ansible_does(rendered, name):
    """benchmarks/prom_report.py renders the template itself (dashboard_queries without Ansible): same text."""
    assert prom_report.render_rules(RENDERINGS[name]) == rendered[name]


def test_the_front_alerts_are_rendered_only_with_fallbacks(rendered):
    def alerts(name):
        return {r["alert"] for r in prom_report.rules_from_text(rendered[name]) if "alert" in r}

    assert not alerts("defaults") & FRONT_ALERTS
    assert alerts("fallbacks") >= FRONT_ALERTS and alerts("custom") >= FRONT_ALERTS
    assert alerts("fallbacks") - FRONT_ALERTS == alerts("defaults")


def test_the_front_alerts_follow_each_routers_published_record(tmp_path):
    """Through the role's vars/main.yml, as on real hosts: r1's router published the front's fallback counters
    (vllm_router_front_fallbacks), r2's has none, m1 is a monitoring host without a router. Only r1's rules
    have the fallback alerts (the hosts whose prometheus.yml gets the nginx-fallback job); all pass promtool."""
    router = {"metrics_urls": ["http://127.0.0.1:29000"], "stub_status_url": "http://127.0.0.1:8090/stub_status"}
    inventory = {
        "all": {
            "children": {
                "router": {
                    "hosts": {
                        "r1": {"vllm_router_published": {**router, "fallback_metrics_url": FALLBACK_METRICS_URL}},
                        "r2": {"vllm_router_published": {**router, "fallback_metrics_url": ""}},
                    }
                },
                "monitoring": {"hosts": {"r1": {}, "r2": {}, "m1": {}}},
            }
        }
    }
    task = rules_task(f"'{tmp_path}/' ~ inventory_hostname ~ '.rules.yml'")
    plays = [
        {
            "name": "Render each monitoring host's alert rules",
            "hosts": "monitoring",
            "gather_facts": False,
            "tasks": [
                {"name": "The role's defaults", "ansible.builtin.include_vars": str(ROLE / "defaults" / "main.yml")},
                {"name": "The role's variables", "ansible.builtin.include_vars": str(ROLE / "vars" / "main.yml")},
                task,
            ],
        }
    ]
    run = run_playbook(tmp_path, "render-hosts", plays, inventory, extra={"_vllm_monitoring_promtool": promtool()})
    assert run.returncode == 0, run.stdout + run.stderr
    alerts = {}
    for host in ("r1", "r2", "m1"):
        rules = prom_report.rules_from_text((tmp_path / f"{host}.rules.yml").read_text(encoding="utf-8"))
        alerts[host] = {r["alert"] for r in rules if "alert" in r}
    assert alerts["r1"] >= FRONT_ALERTS
    assert not alerts["r2"] & FRONT_ALERTS and not alerts["m1"] & FRONT_ALERTS
    assert alerts["r1"] - FRONT_ALERTS == alerts["r2"] == alerts["m1"]


def test_a_broken_rule_is_refused_by_the_role(tmp_path):
    """The role's task validates with promtool: a threshold that breaks the expression fails the task."""
    run = _render(tmp_path, "broken", {"vllm_monitoring_nixl_window": "5 minutes"})
    assert run.returncode != 0
    output = run.stdout + run.stderr
    assert "broken.rules.yml: the new content failed validation" in output and "check rules" in output
    assert not (tmp_path / "broken.rules.yml").exists()
