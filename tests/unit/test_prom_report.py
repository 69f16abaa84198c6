"""benchmarks/prom_report.py: its PromQL reader, the dashboard's queries, check_queries() and the PNG report,
against a fake Prometheus on loopback (a real one runs in molecule, where the other tests use these)."""

from __future__ import annotations

import http.server
import json
import math
import threading
import urllib.parse

import pytest
from monitoring_support import prom_report as pr


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("up", [("up", [])]),
        (
            'sum by (le, host) (rate(vllm:x_bucket{job="vllm", role=~"a|b"}[5m])) > 0.5',
            [("vllm:x_bucket", [("job", "=", "vllm"), ("role", "=~", "a|b")])],
        ),
        (
            '(up{job="r"} == 1) unless on (host, instance_name) (health{worker_role="decode"} == 1)',
            [("up", [("job", "=", "r")]), ("health", [("worker_role", "=", "decode")])],
        ),
        ("sum without (engine) (a) / ignoring (x) group_left (y) b offset 5m", [("a", []), ("b", [])]),
        ("histogram_quantile(0.99, sum(rate(m_bucket[1m])) by (le))", [("m_bucket", [])]),
        (
            '1 - avg by (host) (rate(node_cpu_seconds_total{mode="idle"}[1m])) and on () count(x) > 0',
            [("node_cpu_seconds_total", [("mode", "=", "idle")]), ("x", [])],
        ),
        ('a{l="}{\\"",m!~`x`} # a comment naming not_a_metric', [("a", [("l", "=", '}{"'), ("m", "!~", "x")])]),
        ("max_over_time(a[5m:1m]) + bool 1e3 * b @ 100", [("a", []), ("b", [])]),
    ],
)
def test_metric_selectors(expr, expected):
    got = [(s.metric, s.matchers) for s in pr.metric_selectors(expr)]
    assert got == expected


def test_grafana_variables_are_replaced_and_unknown_ones_refused():
    assert (
        pr.expand('rate(x{role=~"$role", i=~"${instance}"}[$__rate_interval])', "2m")
        == 'rate(x{role=~".*", i=~".*"}[2m])'
    )
    with pytest.raises(KeyError, match=r"\$cluster"):
        pr.expand('x{c="$cluster"}')


def test_every_dashboard_query_reads_and_every_rule_is_split_into_selectors():
    queries = pr.dashboard_queries()
    assert all("$" not in q["query"] for q in queries)
    panels = [q for q in queries if q["source"].startswith("dashboard panel")]
    assert len(panels) == sum(len(p["targets"]) for p in pr.dashboard_panels())
    alerts = {r["alert"] for r in pr.rules_from_text(pr.render_rules())}
    whole = {q["source"].removeprefix("rule ") for q in queries if not q["expect_series"]}
    assert whole == alerts
    selectors = [q["query"] for q in queries if q["source"].endswith(": selector")]
    assert 'vllm_router_worker_health{job="vllm-router", worker_role="decode"}' in selectors
    assert 'vllm:prompt_tokens_by_source_total{job="vllm", role="decode", source="local_compute"}' in selectors


class FakePrometheus(http.server.BaseHTTPRequestHandler):
    """Series for every query that names a vLLM metric or `up`; none for the others (the router's, say)."""

    seen: list[str] = []
    # Whether a front with fallback endpoints is scraped (job nginx-fallback has a target, its counters series).
    fallbacks = False

    def do_GET(self):  # noqa: N802 - http.server's name
        url = urllib.parse.urlparse(self.path)
        params = dict(urllib.parse.parse_qsl(url.query))
        if url.path == "/api/v1/rules":
            data = {
                "groups": [
                    {
                        "name": "g",
                        "rules": [
                            {
                                "name": "A",
                                "type": "alerting",
                                "query": 'increase(vllm:nixl_num_failed_transfers_total{job="vllm"}[5m]) > 0',
                            },
                            {
                                "name": "B",
                                "type": "alerting",
                                "query": 'vllm_router_worker_health{worker_role="decode"} == 0',
                            },
                        ],
                    }
                ]
            }
        elif url.path == "/api/v1/query":
            query = params["query"]
            FakePrometheus.seen.append(query)
            if "refuse_me" in query:
                return self._send(400, {"status": "error", "errorType": "bad_data", "error": "parse error"})
            has = ("vllm:" in query or query.startswith("up") or "(up" in query) and (
                FakePrometheus.fallbacks or "nginx-fallback" not in query
            ) or (FakePrometheus.fallbacks and pr.FALLBACK_METRIC in query)
            data = {
                "resultType": "vector",
                "result": [{"metric": {"role": "decode"}, "value": [1, "1"]}] if has else [],
            }
        elif url.path == "/api/v1/query_range":
            start, end, step = float(params["start"]), float(params["end"]), float(params["step"])
            values = [[start + i * step, str(math.sin(i / 5) + 1)] for i in range(int((end - start) / step) + 1)]
            result = (
                [
                    {"metric": {"role": r, "instance_name": f"{r}-0", "source": "local_compute"}, "values": values}
                    for r in ("prefill", "decode")
                ]
                if "vllm:" in params["query"] or (FakePrometheus.fallbacks and pr.FALLBACK_METRIC in params["query"])
                else []
            )
            data = {"resultType": "matrix", "result": result}
        else:
            return self._send(404, {"status": "error", "error": "not found"})
        self._send(200, {"status": "success", "data": data})

    def _send(self, status, payload):
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def prometheus():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakePrometheus)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_check_queries_returns_those_without_series(prometheus):
    FakePrometheus.seen = []
    missing = pr.check_queries(prometheus)
    # The live rules (from /api/v1/rules) are split into their selectors; the whole expressions are not asked.
    assert 'vllm:nixl_num_failed_transfers_total{job="vllm"}' in FakePrometheus.seen
    assert not any(q.endswith("> 0") for q in FakePrometheus.seen)
    queries = {q["query"] for q in missing}
    assert 'vllm_router_worker_health{worker_role="decode"}' in queries
    assert any(q["source"] == "dashboard panel 'Router: worker health'" for q in missing)
    assert not any("vllm:" in q for q in queries)
    assert all(q["expect_series"] for q in missing)


def test_the_fallback_counters_count_only_where_a_front_has_fallbacks(prometheus):
    """Without a target of job nginx-fallback the fallback panel's queries are empty by design: not missing, and
    the report says why; with one, an empty fallback query is missing like any other."""
    FakePrometheus.fallbacks = False
    assert not [q for q in pr.check_queries(prometheus) if pr.needs_fallbacks(q["query"])]
    assert any(pr.needs_fallbacks(q["query"]) for q in pr.dashboard_queries([]))
    try:
        FakePrometheus.fallbacks = True
        # Now scraped, the fake answers the counter: nothing missing for it either, and it was asked.
        FakePrometheus.seen = []
        assert not [q for q in pr.check_queries(prometheus) if pr.needs_fallbacks(q["query"])]
        assert any(pr.FALLBACK_METRIC in q for q in FakePrometheus.seen)
    finally:
        FakePrometheus.fallbacks = False


def test_an_empty_fallback_query_is_missing_once_fallbacks_are_scraped(prometheus, monkeypatch):
    original = pr._get

    def without_counter_series(url, params, timeout=30):
        if pr.FALLBACK_METRIC in params.get("query", ""):
            return {"resultType": "vector", "result": []}
        return original(url, params, timeout)

    monkeypatch.setattr(pr, "_get", without_counter_series)
    FakePrometheus.fallbacks = True
    try:
        missing = pr.check_queries(prometheus)
    finally:
        FakePrometheus.fallbacks = False
    assert [q for q in missing if pr.needs_fallbacks(q["query"])]


def test_check_queries_reports_a_refused_query_with_its_error(prometheus):
    missing = pr.check_queries(prometheus, rules=[{"alert": "X", "expr": "refuse_me > 0"}])
    (refused,) = [q for q in missing if q["source"] == "rule X: selector"]
    assert refused["query"] == "refuse_me"
    assert "bad_data: parse error" in refused["error"]
    assert pr.check_queries(prometheus, rules=[]) == [q for q in missing if not q["source"].startswith("rule")]


def test_the_report_draws_every_panel(prometheus, tmp_path):
    index = pr.render_report(prometheus, 1_700_000_000, 1_700_003_600, 60, tmp_path)
    pngs = sorted(tmp_path.glob("*.png"))
    assert len(pngs) == len(pr.dashboard_panels())
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    text = index.read_text()
    assert "## KV cache usage" in text and "(01-time-to-first-token-p50-p99.png)" in text
    assert "- no series in this range" in text  # the router's panels: the fake has none
    assert "- no fallback endpoints: no front is scraped as job nginx-fallback" in text
    assert "rate interval 240s" in text
    assert pr.main(["--prometheus", prometheus, "--since", "30m", "--out", str(tmp_path / "cli")]) == 0
    assert (tmp_path / "cli" / "index.md").is_file()
