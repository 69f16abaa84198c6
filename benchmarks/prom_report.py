"""A PNG report of the inferops.vllm dashboard from Prometheus, for those without Grafana; and the
queries of the dashboard and the alert rules, with a check that each returns data.

Grafana is not in the distributions our hosts reach, so roles/vllm_monitoring ships its dashboard as
JSON only. This script reads that JSON (roles/vllm_monitoring/files/dashboards/inferops-vllm-pd.json),
runs every time-series panel's queries through Prometheus' /api/v1/query_range and draws each panel
as a PNG (matplotlib), with an index.md that shows them all:

    python3 benchmarks/prom_report.py --prometheus http://127.0.0.1:9090 --since 1h --out /tmp/report
    python3 benchmarks/prom_report.py --prometheus http://127.0.0.1:9090 --check   # queries with no series

The panels' queries are read from the JSON, not repeated here. Grafana's variables are replaced as
Grafana would with everything selected: $role and $instance by `.*`, $__rate_interval by
--rate-interval (default: 4 scrape intervals of 15 s, at least the step).

dashboard_queries() lists every query of the dashboard and of the alert rules (rendered from the role's
template with its defaults, or read from a rules file or a running Prometheus); check_queries(url)
returns those that should return data but have no series on that Prometheus (molecule verifies a
deployment with it). metric_selectors() is the small PromQL reader both use, also used by
tests/unit/test_monitoring_metric_names.py.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ROLE = REPO / "roles" / "vllm_monitoring"
DASHBOARD = ROLE / "files" / "dashboards" / "inferops-vllm-pd.json"
RULES_TEMPLATE = ROLE / "templates" / "inferops-vllm-pd.rules.yml.j2"
ROLE_DEFAULTS = ROLE / "defaults" / "main.yml"

# Grafana's variables with everything selected, for queries run outside Grafana.
ALL = ".*"
DEFAULT_RATE_INTERVAL = "1m"

# --------------------------------------------------------------------------- PromQL reading

# Words that are never metric names where they stand.
AGGREGATIONS = {
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
}
# Followed by a parenthesized list of label names.
LABEL_LIST_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
OPERATOR_WORDS = {"and", "or", "unless", "bool", "atan2", "inf", "nan", "offset"}
IDENT_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
NUMBER_RE = re.compile(r"(?:0[xX][0-9a-fA-F]+|[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)(?:ms|s|m|h|d|w|y)*")
MATCHER_RE = re.compile(
    r"\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*(\"(?:\\.|[^\"\\])*\"|'(?:\\.|[^'\\])*'|`[^`]*`)\s*,?"
)


@dataclass
class Selector:
    """A vector selector: the metric name (None for {__name__=...} selectors) and its label matchers."""

    metric: str | None
    matchers: list[tuple[str, str, str]] = field(default_factory=list)

    def label_names(self) -> set[str]:
        return {name for name, _op, _value in self.matchers}

    def text(self) -> str:
        inner = ", ".join(f'{n}{op}"{v}"' for n, op, v in self.matchers)
        return f"{self.metric or ''}{{{inner}}}" if inner or not self.metric else self.metric


def _string_end(expr: str, i: int) -> int:
    quote = expr[i]
    j = i + 1
    while j < len(expr):
        if expr[j] == "\\" and quote != "`":
            j += 2
            continue
        if expr[j] == quote:
            return j + 1
        j += 1
    raise ValueError(f"unterminated string at {i} in {expr!r}")


def _closing(expr: str, i: int, open_: str, close: str) -> int:
    """Index after the bracket closing the one at i, skipping strings."""
    depth = 0
    j = i
    while j < len(expr):
        c = expr[j]
        if c in "\"'`":
            j = _string_end(expr, j)
            continue
        if c == open_:
            depth += 1
        elif c == close:
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    raise ValueError(f"unbalanced {open_!r} at {i} in {expr!r}")


def _unquote(text: str) -> str:
    if text[0] == "`":
        return text[1:-1]
    return re.sub(r"\\(.)", r"\1", text[1:-1])


def _matchers(block: str) -> list[tuple[str, str, str]]:
    inner = block[1:-1]
    out = []
    pos = 0
    while pos < len(inner):
        if not inner[pos:].strip():
            break
        m = MATCHER_RE.match(inner, pos)
        if not m:
            raise ValueError(f"cannot read label matchers {block!r}")
        out.append((m.group(1), m.group(2), _unquote(m.group(3))))
        pos = m.end()
    return out


def _next_char(expr: str, i: int) -> str:
    while i < len(expr) and expr[i].isspace():
        i += 1
    return expr[i] if i < len(expr) else ""


def metric_selectors(expr: str) -> list[Selector]:
    """Every vector selector of a PromQL expression, in order (Grafana variables already replaced)."""
    out: list[Selector] = []
    i = 0
    skip_label_list = False
    while i < len(expr):
        c = expr[i]
        if c.isspace() or c in ",+-*/%^=!<>@":
            i += 1
            continue
        if c == "#":
            nl = expr.find("\n", i)
            i = len(expr) if nl < 0 else nl
            continue
        if c in "\"'`":
            i = _string_end(expr, i)
            continue
        if c == "[":  # range, subquery
            i = _closing(expr, i, "[", "]")
            continue
        if c == "(":
            if skip_label_list:
                i = _closing(expr, i, "(", ")")
                skip_label_list = False
                continue
            i += 1
            continue
        if c == ")":
            i += 1
            continue
        if c == "{":  # a selector without a metric name
            end = _closing(expr, i, "{", "}")
            out.append(Selector(None, _matchers(expr[i:end])))
            i = end
            continue
        if c.isdigit() or (c == "." and i + 1 < len(expr) and expr[i + 1].isdigit()):
            m = NUMBER_RE.match(expr, i)
            i = m.end() if m and m.end() > i else i + 1
            continue
        m = IDENT_RE.match(expr, i)
        if not m:
            raise ValueError(f"unexpected {c!r} at {i} in {expr!r}")
        word = m.group(0)
        i = m.end()
        lowered = word.lower()
        if lowered in LABEL_LIST_KEYWORDS:
            skip_label_list = _next_char(expr, i) == "("
            continue
        if lowered == "offset":
            # offset 5m: skip the duration
            j = i
            while j < len(expr) and expr[j].isspace():
                j += 1
            d = NUMBER_RE.match(expr, j) or IDENT_RE.match(expr, j)
            i = d.end() if d else j
            continue
        if lowered in OPERATOR_WORDS or lowered in AGGREGATIONS:
            continue
        nxt = _next_char(expr, i)
        if nxt == "(":  # a function
            continue
        matchers: list[tuple[str, str, str]] = []
        j = i
        while j < len(expr) and expr[j].isspace():
            j += 1
        if j < len(expr) and expr[j] == "{":
            end = _closing(expr, j, "{", "}")
            matchers = _matchers(expr[j:end])
            i = end
        out.append(Selector(word, matchers))
    return out


def metric_names(expr: str) -> set[str]:
    """Metric names an expression reads (also those given as __name__ matchers with =)."""
    names = set()
    for sel in metric_selectors(expr):
        if sel.metric:
            names.add(sel.metric)
        names.update(v for n, op, v in sel.matchers if n == "__name__" and op == "=")
    return names


# --------------------------------------------------------------------------- the dashboard

LABEL_VALUES_RE = re.compile(r"^\s*label_values\s*\((.*),\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)\s*$", re.S)


def load_dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def expand(expr: str, rate_interval: str = DEFAULT_RATE_INTERVAL, variables: dict[str, str] | None = None) -> str:
    """A dashboard query with Grafana's variables replaced (everything selected)."""
    values = {
        "__rate_interval": rate_interval,
        "__interval": rate_interval,
        "__range": rate_interval,
        "role": ALL,
        "instance": ALL,
    }
    values.update(variables or {})

    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name not in values:
            raise KeyError(f"dashboard query uses ${name}, which this report does not know: {expr!r}")
        return values[name]

    return re.sub(
        r"\$\{([a-zA-Z_][a-zA-Z0-9_]*)(?::[a-z]+)?\}|\$([a-zA-Z_][a-zA-Z0-9_]*)|\[\[([a-zA-Z_][a-zA-Z0-9_]*)\]\]",
        sub,
        expr,
    )


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard.get("panels", []):
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows
    return out


def dashboard_panels(dashboard: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The time-series panels: title, unit, description and targets (expr, legendFormat)."""
    dashboard = dashboard or load_dashboard()
    out = []
    for panel in _panels(dashboard):
        if panel.get("type") != "timeseries":
            continue
        out.append(
            {
                "id": panel.get("id"),
                "title": panel.get("title", ""),
                "unit": ((panel.get("fieldConfig") or {}).get("defaults") or {}).get("unit", ""),
                "description": panel.get("description", ""),
                "targets": [
                    {"expr": t["expr"], "legend": t.get("legendFormat", "")}
                    for t in panel.get("targets", [])
                    if t.get("expr")
                ],
            }
        )
    return out


def dashboard_expressions(dashboard: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """(where, raw expression) of every query of the dashboard: panel targets and template variables."""
    dashboard = dashboard or load_dashboard()
    out = []
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            if target.get("expr"):
                out.append((f"dashboard panel {panel.get('title')!r}", target["expr"]))
    for var in (dashboard.get("templating") or {}).get("list", []):
        if var.get("type") != "query":
            continue
        query = var.get("query")
        query = query.get("query", "") if isinstance(query, dict) else (query or "")
        m = LABEL_VALUES_RE.match(query)
        out.append((f"dashboard variable ${var.get('name')}", m.group(1) if m else query))
    return out


# --------------------------------------------------------------------------- the alert rules


def render_rules(overrides: dict[str, Any] | None = None) -> str:
    """The role's rules template rendered with its defaults (and ``overrides``), as Ansible would.

    Only what the template uses is provided: ansible_managed, and the filters comment, to_json and
    combine. tests/unit/test_monitoring_rules.py checks that this equals Ansible's own rendering.
    """
    import jinja2
    import yaml

    variables = yaml.safe_load(ROLE_DEFAULTS.read_text(encoding="utf-8"))
    variables.update(overrides or {})
    variables["ansible_managed"] = "Ansible managed"
    env = jinja2.Environment(trim_blocks=True, keep_trailing_newline=True, undefined=jinja2.StrictUndefined)
    env.filters["comment"] = lambda text: (
        "#\n" + "\n".join(f"# {line}" if line else "#" for line in str(text).split("\n")) + "\n#"
    )
    env.filters["to_json"] = json.dumps
    env.filters["combine"] = lambda *dicts: {k: v for d in dicts for k, v in d.items()}
    return env.from_string(RULES_TEMPLATE.read_text(encoding="utf-8")).render(**variables)


def rules_from_text(text: str) -> list[dict[str, Any]]:
    import yaml

    data = yaml.safe_load(text)
    return [rule for group in data.get("groups", []) for rule in group.get("rules", [])]


def rule_expressions(rules: list[dict[str, Any]] | None = None) -> list[tuple[str, str]]:
    """(where, expression) of every rule; by default of the rules rendered with the role's defaults."""
    rules = rules if rules is not None else rules_from_text(render_rules())
    return [(f"rule {r.get('alert') or r.get('record')}", r["expr"]) for r in rules]


# --------------------------------------------------------------------------- every query, and a check


def dashboard_queries(
    rules: list[dict[str, Any]] | None = None, rate_interval: str = DEFAULT_RATE_INTERVAL
) -> list[dict[str, Any]]:
    """Every query of the dashboard and of the alert rules, ready for Prometheus.

    Each is ``{"source", "query", "expect_series"}``. Dashboard queries should all return series on a
    deployment that served requests. An alert's expression returns nothing while all is well, so for the
    rules each metric selector is listed on its own (expect_series) and the whole expression too
    (expect_series false, for the record). ``rules``: parsed rules (default: the role's template with
    its defaults).
    """
    out = []
    for where, expr in dashboard_expressions():
        out.append({"source": where, "query": expand(expr, rate_interval), "expect_series": True})
    for where, expr in rule_expressions(rules):
        out.append({"source": where, "query": " ".join(expr.split()), "expect_series": False})
        seen = set()
        for sel in metric_selectors(expr):
            text = sel.text()
            if text not in seen:
                seen.add(text)
                out.append({"source": f"{where}: selector", "query": text, "expect_series": True})
    return out


def _get(url: str, params: dict[str, str], timeout: float = 30) -> dict[str, Any]:
    full = url.rstrip("/") + "?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(full, timeout=timeout) as response:  # noqa: S310 - a URL the caller gives
            body = json.loads(response.read().decode("utf-8"))
    except urllib.error.HTTPError as exc:  # Prometheus explains a refused query in a JSON body
        try:
            body = json.loads(exc.read().decode("utf-8"))
        except ValueError:
            raise RuntimeError(f"{full}: HTTP {exc.code} {exc.reason}") from exc
    if body.get("status") != "success":
        raise RuntimeError(f"{full}: {body.get('errorType')}: {body.get('error')}")
    return body["data"]


def live_rules(prometheus_url: str) -> list[dict[str, Any]]:
    """The alert rules a running Prometheus evaluates (/api/v1/rules), as {alert, expr}."""
    data = _get(prometheus_url.rstrip("/") + "/api/v1/rules", {"type": "alert"})
    return [{"alert": r["name"], "expr": r["query"]} for g in data.get("groups", []) for r in g.get("rules", [])]


# The front's fallback counters exist only where a router has vllm_router_front_fallbacks (the
# monitoring role scrapes them as job nginx-fallback then): their queries are empty by design elsewhere.
FALLBACK_JOB = "nginx-fallback"
FALLBACK_METRIC = "inferops_vllm_front_fallbacks_total"


def needs_fallbacks(expr: str) -> bool:
    """Whether a query reads only the front's fallback counters (empty without fallback endpoints)."""
    return FALLBACK_METRIC in expr


def fallbacks_scraped(prometheus_url: str) -> bool:
    """Whether the Prometheus has a target of the fallback job (some front has fallback endpoints)."""
    return bool(_get(prometheus_url.rstrip("/") + "/api/v1/query", {"query": f'up{{job="{FALLBACK_JOB}"}}'})["result"])


def check_queries(
    prometheus_url: str, rules: list[dict[str, Any]] | None = None, at: float | None = None
) -> list[dict[str, Any]]:
    """The queries of dashboard_queries() that should return data but have no series at ``at`` (now).

    The rules are those the Prometheus at ``prometheus_url`` runs, unless given. Each returned dict
    carries ``source``, ``query`` and, when Prometheus refused the query, ``error``. The fallback
    counters' queries count only when the Prometheus scrapes a front with fallback endpoints.
    """
    rules = rules if rules is not None else live_rules(prometheus_url)
    with_fallbacks = fallbacks_scraped(prometheus_url)
    missing = []
    for q in dashboard_queries(rules):
        if not q["expect_series"] or (needs_fallbacks(q["query"]) and not with_fallbacks):
            continue
        params = {"query": q["query"]}
        if at is not None:
            params["time"] = f"{at:.3f}"
        try:
            data = _get(prometheus_url.rstrip("/") + "/api/v1/query", params)
        except Exception as exc:  # noqa: BLE001 - reported with the query
            missing.append({**q, "error": str(exc)})
            continue
        if not data.get("result"):
            missing.append(q)
    return missing


# --------------------------------------------------------------------------- the PNG report


def parse_duration(text: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    parts = re.findall(r"([0-9.]+)(ms|s|m|h|d|w|y)", text)
    if not parts or "".join(a + b for a, b in parts) != text:
        raise ValueError(f"not a duration like 30s, 5m, 1h30m: {text!r}")
    return sum(float(n) * units[u] for n, u in parts)


def legend(fmt: str, labels: dict[str, str]) -> str:
    if not fmt:
        return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
    return re.sub(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip()


def query_range(prometheus_url: str, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
    data = _get(
        prometheus_url.rstrip("/") + "/api/v1/query_range",
        {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"},
    )
    return data.get("result", [])


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "panel"


def render_report(
    prometheus_url: str, start: float, end: float, step: float, out_dir: Path, rate_interval: str | None = None
) -> Path:
    """One PNG per time-series panel of the dashboard and index.md; returns the index's path."""
    import matplotlib

    matplotlib.use("Agg")
    from datetime import datetime, timezone

    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    rate_interval = rate_interval or f"{max(60, int(math.ceil(step)) * 4)}s"
    first, last = (datetime.fromtimestamp(t, timezone.utc) for t in (start, end))
    when = f"{first:%Y-%m-%d %H:%M:%S} to {last:%Y-%m-%d %H:%M:%S} UTC"
    lines = [
        "# inferops.vllm: prefill/decode vLLM",
        "",
        f"From {prometheus_url}, {when}, step {step:g} s, rate interval {rate_interval}; the panels of "
        f"`{DASHBOARD.relative_to(REPO)}` (all roles and instances).",
        "",
    ]
    with_fallbacks = fallbacks_scraped(prometheus_url)
    for number, panel in enumerate(dashboard_panels(), start=1):
        fig, ax = plt.subplots(figsize=(10, 4.2), dpi=100)
        series_count = 0
        problems = []
        for target in panel["targets"]:
            expr = expand(target["expr"], rate_interval)
            try:
                result = query_range(prometheus_url, expr, start, end, step)
            except Exception as exc:  # noqa: BLE001 - shown in the report
                problems.append(f"`{expr}`: {exc}")
                continue
            for series in result:
                points = [(float(t), float(v)) for t, v in series.get("values", [])]
                points = [(t, v) for t, v in points if math.isfinite(v)]
                if not points:
                    continue
                xs = [datetime.fromtimestamp(t, timezone.utc) for t, _v in points]
                ax.plot(
                    xs, [v for _t, v in points], linewidth=1.2, label=legend(target["legend"], series.get("metric", {}))
                )
                series_count += 1
        ax.set_title(panel["title"])
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M", tz=timezone.utc))
        if panel["unit"]:
            ax.set_ylabel(panel["unit"])
        ax.grid(True, alpha=0.3)
        if series_count:
            ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
        else:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="grey")
        fig.tight_layout()
        name = f"{number:02d}-{_slug(panel['title'])}.png"
        fig.savefig(out_dir / name)
        plt.close(fig)
        lines += [f"## {panel['title']}", "", panel["description"], "", f"![{panel['title']}]({name})", ""]
        lines += [f"- query: `{t['expr']}`" for t in panel["targets"]]
        lines += [f"- error: {p}" for p in problems]
        fallback_only = all(needs_fallbacks(t["expr"]) for t in panel["targets"])
        if not series_count and not problems and fallback_only and not with_fallbacks:
            lines.append(f"- no fallback endpoints: no front is scraped as job {FALLBACK_JOB}")
        elif not series_count and not problems:
            lines.append("- no series in this range")
        lines.append("")
    index = out_dir / "index.md"
    index.write_text("\n".join(lines), encoding="utf-8")
    return index


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus base URL")
    parser.add_argument("--since", default="1h", help="range ending now, e.g. 30m, 1h, 1d (or --start/--end)")
    parser.add_argument("--start", type=float, help="start, Unix seconds")
    parser.add_argument("--end", type=float, help="end, Unix seconds (default now)")
    parser.add_argument("--step", default="", help="resolution, e.g. 15s (default: range / 300, at least 15s)")
    parser.add_argument("--rate-interval", default="", help="replaces $__rate_interval (default: 4 steps, at least 1m)")
    parser.add_argument("--out", type=Path, default=Path("prom-report"), help="output directory")
    parser.add_argument(
        "--check",
        action="store_true",
        help="list the dashboard's and rules' queries that have no series, exit 1 if any",
    )
    args = parser.parse_args(argv)
    if args.check:
        missing = check_queries(args.prometheus)
        for q in missing:
            print(f"{q['source']}: {q['query']}" + (f"  ({q['error']})" if q.get("error") else ""))
        print(f"{len(missing)} queries without series", file=sys.stderr)
        return 1 if missing else 0
    end = args.end or time.time()
    start = args.start or end - parse_duration(args.since)
    step = parse_duration(args.step) if args.step else max(15.0, (end - start) / 300)
    index = render_report(args.prometheus, start, end, step, args.out, args.rate_interval or None)
    print(index)
    return 0


if __name__ == "__main__":
    sys.exit(main())
