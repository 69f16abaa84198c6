"""Every metric the dashboard and the alert rules read is exported by the pinned software, with those labels.

The vLLM names (and their types, hence their sample names: counters end in _total, histograms have
_bucket/_sum/_count) and labels are read from the pinned vLLM wheel in the wheelhouse at test time,
vllm-router's from the strings of its Rust library in its pinned wheel, the front's fallback counters from the njs
module that serves them (roles/vllm_router/files/inferops-vllm-fallback.js); node exporter's and the nginx
exporter's are listed in monitoring_support.py (they build their names at run time). A missing wheelhouse
fails these tests with what to do, it does not skip them. The checker itself is shown to refuse names that
the pinned vLLM does not export (the old vllm:gpu_cache_usage_perc, a counter without _total, ...).
"""

from __future__ import annotations

import pytest
from monitoring_support import VLLM_VERSION, prom_report, unknown_metrics, vllm_metrics

DASHBOARD = prom_report.load_dashboard()


def test_the_dashboard_reads_only_metrics_the_pinned_versions_export():
    problems = unknown_metrics(prom_report.dashboard_expressions(DASHBOARD))
    assert not problems, "\n".join(problems)


def test_the_alert_rules_read_only_metrics_the_pinned_versions_export():
    problems = unknown_metrics(prom_report.rule_expressions())
    assert not problems, "\n".join(problems)


def test_the_front_fallback_alerts_read_only_what_the_fronts_njs_exports():
    """The rules of a router host whose front has fallback endpoints add alerts on the front's own counter
    (inferops_vllm_front_fallbacks_total): no wheel exports it, our njs module does (monitoring_support's
    front_metrics reads its name and labels there), so it is checked against that module."""
    front = {"_vllm_monitoring_is_router": True, "_vllm_monitoring_router": {"fallback_metrics_url": "http://x/y"}}
    rules = prom_report.rules_from_text(prom_report.render_rules(front))
    expressions = prom_report.rule_expressions(rules)
    assert any("inferops_vllm_front_fallbacks_total" in expr for _where, expr in expressions)
    problems = unknown_metrics(expressions)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("expr", "problem"),
    [
        ("vllm:gpu_cache_usage_perc", f"vllm:gpu_cache_usage_perc is not exported by vLLM {VLLM_VERSION}"),
        ("increase(vllm:nixl_num_failed_transfers[5m])", "vllm:nixl_num_failed_transfers is not exported"),
        ("vllm:time_to_first_token_seconds_total", "vllm:time_to_first_token_seconds_total is not exported"),
        ('vllm:prompt_tokens_by_source_total{source="remote_prefill"}', "vLLM's sources are"),
        ('vllm:kv_cache_usage_perc{worker="x"}', "vllm:kv_cache_usage_perc has no label 'worker'"),
        ("rate(vllm_router_pd_request_total[5m])", "vllm_router_pd_request_total is not exported by vllm-router"),
        ("vllm_router_worker_healthy", "vllm_router_worker_healthy is not exported by vllm-router"),
        ("node_memory_available", "node_memory_available is exported by none of"),
        ("inferops_vllm_front_fallback_total", "inferops_vllm_front_fallback_total is exported by none of"),
        ('inferops_vllm_front_fallbacks_total{endpoint="x"}', "inferops_vllm_front_fallbacks_total has no label"),
    ],
)
def test_the_check_refuses_what_the_pinned_versions_do_not_export(expr, problem):
    problems = unknown_metrics([("test", expr)])
    assert any(problem in p for p in problems), problems


def test_what_the_check_accepts():
    assert (
        unknown_metrics(
            [
                ("test", e)
                for e in (
                    "histogram_quantile(0.99, sum by (le) "
                    '(rate(vllm:time_to_first_token_seconds_bucket{job="vllm"}[5m])))',
                    'vllm:prompt_tokens_by_source_total{source="external_kv_transfer", model_name="m", engine="0", '
                    'role="decode"}',
                    "vllm_router_pd_request_duration_seconds_bucket",
                    'vllm_router_worker_health{worker_role="decode"}',
                    'node_cpu_seconds_total{mode="idle"}',
                    "nginx_connections_active",
                    'sum by (fallback, reason) (inferops_vllm_front_fallbacks_total{job="nginx-fallback"})',
                    "up",
                )
            ]
        )
        == []
    )


def test_the_names_the_issue_asks_for_are_on_the_dashboard():
    used = set()
    for _where, expr in prom_report.dashboard_expressions(DASHBOARD):
        used |= prom_report.metric_names(expr)
    wanted = {
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "vllm:nixl_xfer_time_seconds_bucket",
        "vllm:nixl_bytes_transferred_sum",
        "vllm:nixl_num_failed_transfers_total",
        "vllm:prompt_tokens_by_source_total",
        "vllm_router_pd_prefill_requests_total",
        "vllm_router_pd_decode_requests_total",
        "vllm_router_worker_health",
        "vllm_router_pd_request_duration_seconds_bucket",
        "nginx_http_requests_total",
        "inferops_vllm_front_fallbacks_total",
        "node_cpu_seconds_total",
    }
    assert wanted <= used, sorted(wanted - used)


def test_vllm_types_are_read_from_the_wheel():
    """The wheel says what the names are: the sample names follow (a regression guard for the reader)."""
    metrics = vllm_metrics()
    assert metrics["types"]["time_to_first_token_seconds"] == {"histogram"}
    assert metrics["types"]["nixl_num_failed_transfers"] == {"counter"}
    assert "vllm:nixl_num_failed_transfers_total" in metrics["samples"]
    assert "vllm:kv_cache_usage_perc" in metrics["samples"]
    assert {"model_name", "engine", "source"} <= metrics["labels"]["prompt_tokens_by_source"]
    assert metrics["sources"] == ["local_compute", "local_cache_hit", "external_kv_transfer"]


def test_the_dashboard_is_ready_for_provisioning():
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("role", "instance"):
        assert variables[name]["type"] == "query" and variables[name]["datasource"]["uid"] == "${datasource}"
        assert variables[name]["multi"] and variables[name]["includeAll"]
    assert "__inputs" not in DASHBOARD and DASHBOARD["uid"] == "inferops-vllm-pd"
    panels = [p for p in DASHBOARD["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in DASHBOARD["panels"]}) == len(DASHBOARD["panels"])
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
    # The vLLM panels follow the role and instance variables.
    for _where, expr in prom_report.dashboard_expressions(DASHBOARD):
        if "vllm:" in expr and "label_values" not in expr and "$role" not in expr:
            assert _where.startswith("dashboard variable"), f"{_where}: {expr}"
