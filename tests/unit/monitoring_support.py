"""What the roles/vllm_monitoring tests share: promtool, the pinned wheels, Ansible runs, the PromQL reader.

promtool comes from Debian 12's pinned prometheus package (scripts/promtool.sh downloads it once into the
cache). The pinned vLLM and vllm-router wheels come from the wheelhouses that scripts/sandbox/setup.sh
builds (INFEROPS_WHEELHOUSE_DIR / INFEROPS_ROUTER_WHEELHOUSE_DIR, which scripts/test.sh exports, or the
cache under INFEROPS_CACHE_DIR, by default ~/.cache/inferops-vllm). Neither is skipped when missing: the
tests fail and say how to get them.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
ROLE = REPO / "roles" / "vllm_monitoring"
sys.path.insert(0, str(REPO / "benchmarks"))
import prom_report  # noqa: E402  (benchmarks/ is no package)
from test_preflight_inventories import ANSIBLE_PLAYBOOK, playbook_env  # noqa: E402,F401


def _yaml_default(role: str, name: str) -> str:
    return str(yaml.safe_load((REPO / "roles" / role / "defaults" / "main.yml").read_text(encoding="utf-8"))[name])


VLLM_VERSION = _yaml_default("vllm_install", "vllm_install_version")
VLLM_ROUTER_VERSION = _yaml_default("vllm_router", "vllm_router_version")


@functools.cache
def promtool() -> str:
    """Path of the pinned promtool (downloaded once into the cache by scripts/promtool.sh)."""
    run = subprocess.run(
        ["bash", str(REPO / "scripts" / "promtool.sh")], capture_output=True, text=True, timeout=600, check=False
    )
    if run.returncode != 0 or not run.stdout.strip():
        pytest.fail(
            "no promtool: scripts/promtool.sh failed (it downloads Debian 12's prometheus package with apt-get "
            f"download and unpacks promtool into the cache):\n{run.stderr.strip()}",
            pytrace=False,
        )
    return run.stdout.strip().splitlines()[-1]


def _cache_dir() -> Path:
    if os.environ.get("INFEROPS_CACHE_DIR"):
        return Path(os.environ["INFEROPS_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "inferops-vllm"


def find_wheel(env: str, pattern: str, what: str) -> Path:
    """The wheel matching ``pattern`` in $env's directory, else in any wheelhouse of the cache; fails clearly."""
    places = []
    if os.environ.get(env):
        places.append(Path(os.environ[env]))
    places.extend(sorted((_cache_dir() / "wheelhouse").glob("*/")))
    for place in places:
        found = sorted(place.glob(pattern))
        if found:
            return found[0]
    pytest.fail(
        f"{what}: no wheel {pattern} in {', '.join(str(p) for p in places) or 'no wheelhouse'} (${env} or "
        f"{_cache_dir() / 'wheelhouse'}/*/). The metric names the dashboard and the alert rules may use are read "
        "from the pinned wheels; build the wheelhouses with `bash scripts/sandbox/setup.sh wheelhouse` "
        "(scripts/test.sh does), or point the variable at one.",
        pytrace=False,
    )
    raise AssertionError  # not reached


# --------------------------------------------------------------------------- what the pinned software exports

# prometheus_client's sample names per metric type (name without its _total for counters).
SAMPLE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("", "_info"),
    None: ("",),
}
VLLM_NAME_RE = re.compile(r"""["']vllm:([a-zA-Z_][a-zA-Z0-9_]*)["']""")
CTOR_RE = re.compile(r"([A-Za-z_][\w.]*)\s*\(")
BASE_LABELS_RE = re.compile(r"""labelnames\s*=\s*\[\s*["']model_name["']\s*,\s*["']engine["']\s*\]""")


def _call_text(text: str, start: int) -> str:
    """The rest of the constructor call a metric name sits in (up to its closing parenthesis)."""
    depth = 1
    i = start
    while i < len(text) and depth:
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
        i += 1
    return text[start:i]


@functools.cache
def vllm_metrics() -> dict[str, Any]:
    """From the pinned vLLM wheel: {"samples": {sample name: metric}, "labels": {metric: labels}, "sources": [...]}.

    Each ``"vllm:NAME"`` literal in vLLM's Python sources is a metric; its type is the class of the call it
    is passed to (Counter, Gauge, Histogram; the _counter_cls-style attributes count by their name) and
    its labels the call's ``labelnames`` (``labelnames`` itself being vLLM's ["model_name", "engine"]).
    """
    wheel = find_wheel("INFEROPS_WHEELHOUSE_DIR", f"vllm*-{VLLM_VERSION}-*.whl", f"vLLM {VLLM_VERSION}")
    types: dict[str, set[str | None]] = {}
    labels: dict[str, set[str]] = {}
    sources: list[str] = []
    base = ["model_name", "engine"]
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            if not info.filename.startswith("vllm/") or not info.filename.endswith(".py"):
                continue
            text = zf.read(info).decode("utf-8", "replace")
            if "vllm:" not in text and "ALL_SOURCES" not in text:
                continue
            if info.filename.endswith("v1/metrics/stats.py"):
                m = re.search(r"ALL_SOURCES[^=]*=\s*\(([^)]*)\)", text)
                if m:
                    sources = re.findall(r"""["']([a-z_]+)["']""", m.group(1))
            for m in VLLM_NAME_RE.finditer(text):
                before = text[max(0, m.start() - 400) : m.start()]
                kind = None
                ctor_end = None
                for c in reversed(list(CTOR_RE.finditer(before))):
                    ident = c.group(1).split(".")[-1].lower()
                    kind = next((k for k in ("counter", "gauge", "histogram", "summary", "info") if k in ident), None)
                    if kind:
                        ctor_end = max(0, m.start() - 400) + c.end()
                        break
                name = m.group(1)
                types.setdefault(name, set()).add(kind)
                if ctor_end is not None:
                    call = _call_text(text, ctor_end)
                    lm = re.search(r"labelnames\s*=\s*([^\n]*(?:\n\s+[^\n=]*)?)", call)
                    found = set()
                    if lm:
                        found.update(re.findall(r"""["']([a-zA-Z_][a-zA-Z0-9_]*)["']""", lm.group(1)))
                        if re.match(r"\s*labelnames\b", lm.group(1)):
                            found.update(base)
                    labels.setdefault(name, set()).update(found)
    if not types:
        pytest.fail(f"{wheel}: no vllm:* metric found in its sources; has vLLM changed how it names metrics?")
    samples: dict[str, str] = {}
    for name, kinds in types.items():
        if kinds == {None}:
            kinds = {None}
        for kind in kinds:
            stem = name[: -len("_total")] if kind == "counter" and name.endswith("_total") else name
            for suffix in SAMPLE_SUFFIXES[kind]:
                samples[f"vllm:{stem}{suffix}"] = name
    return {"wheel": wheel, "samples": samples, "labels": labels, "types": types, "sources": sources}


@functools.cache
def router_metric_names() -> dict[str, Any]:
    """vllm-router's metric names, from the strings of its Rust library in the pinned wheel.

    Rust keeps string literals back to back without separators, so a name is accepted where it is followed
    by a character that cannot continue it, or by the next ``vllm_`` name. Its histograms whose names end in
    ``duration_seconds`` have buckets (vllm-router's metrics.rs: set_buckets_for_metric(Suffix("duration_seconds"))).
    """
    wheel = find_wheel(
        "INFEROPS_ROUTER_WHEELHOUSE_DIR",
        f"vllm_router-{VLLM_ROUTER_VERSION}-*.whl",
        f"vllm-router {VLLM_ROUTER_VERSION}",
    )
    blob = b""
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            if info.filename.endswith(".so"):
                blob += zf.read(info)
    if b"vllm_router_" not in blob:
        pytest.fail(f"{wheel}: no vllm_router_* string in its libraries")
    return {"wheel": wheel, "blob": blob}


def router_exports(sample: str) -> bool:
    blob = router_metric_names()["blob"]
    candidates = [sample]
    for suffix in ("_bucket", "_sum", "_count"):
        if sample.endswith(suffix) and sample[: -len(suffix)].endswith("duration_seconds"):
            candidates.append(sample[: -len(suffix)])
    for name in candidates:
        raw = name.encode()
        for m in re.finditer(re.escape(raw), blob):
            after = blob[m.end() : m.end() + 5]
            if not after or not re.match(rb"[a-z0-9_]", after[:1]) or after.startswith(b"vllm_"):
                return True
    return False


# node exporter 1.5 and nginx-prometheus-exporter 0.11 (Debian 12's packages) build their names at run time
# from a namespace and parts (and node's meminfo names from /proc/meminfo's fields), so no binary holds
# them whole: the names the dashboard and rules may use are listed here, from the exporters' documentation
# (node_exporter's collector/cpu_linux.go, meminfo; nginx-prometheus-exporter's collector/nginx.go).
NODE_EXPORTER = {
    "node_cpu_seconds_total": {"cpu", "mode"},
    "node_memory_MemAvailable_bytes": set(),
    "node_memory_MemTotal_bytes": set(),
    "node_load1": set(),
    "node_filesystem_avail_bytes": {"device", "fstype", "mountpoint"},
    "node_filesystem_size_bytes": {"device", "fstype", "mountpoint"},
}
NGINX_EXPORTER = {
    "nginx_up": set(),
    "nginx_connections_active": set(),
    "nginx_connections_accepted": set(),
    "nginx_connections_handled": set(),
    "nginx_connections_reading": set(),
    "nginx_connections_writing": set(),
    "nginx_connections_waiting": set(),
    "nginx_http_requests_total": set(),
}


@functools.cache
def front_metrics() -> dict[str, set[str]]:
    """The front's own metrics (vllm_router's fallback counters), from the njs module that serves them:
    each ``# TYPE <name>`` it prints, with the labels of the sample lines it builds (``name{a="..",b=".."}``)."""
    text = (REPO / "roles" / "vllm_router" / "files" / "inferops-vllm-fallback.js").read_text(encoding="utf-8")
    out: dict[str, set[str]] = {}
    for m in re.finditer(r"# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge)", text):
        name = m.group(1)
        sample = re.search(re.escape(name) + r"\{(.*)", text[m.end():])
        out[name] = set(re.findall(r"([a-z_]+)=\\?\"", sample.group(1))) if sample else set()
    if not out:
        pytest.fail("roles/vllm_router/files/inferops-vllm-fallback.js: no '# TYPE' line; did its metrics page change?")
    return out


PROMETHEUS_OWN = {"up": set(), "scrape_duration_seconds": set(), "ALERTS": {"alertname", "alertstate", "severity"}}
# The labels roles/vllm_monitoring's scrape configuration gives every target (and Prometheus' own).
TARGET_LABELS = {"job", "instance", "host", "role", "instance_name"}
ROUTER_LABELS = {"worker", "worker_role", "worker_name", "route", "error_type", "le"}


def unknown_metrics(expressions: list[tuple[str, str]]) -> list[str]:
    """Problems with the metrics and labels of ``(where, expression)`` pairs, against the pinned exports."""
    vllm = vllm_metrics()
    problems = []
    for where, expr in expressions:
        for sel in prom_report.metric_selectors(expr):
            name = sel.metric
            if name is None:
                problems.append(f"{where}: a selector without a metric name ({sel.text()}) cannot be checked")
                continue
            used = sel.label_names()
            if name.startswith("vllm:"):
                metric = vllm["samples"].get(name)
                if metric is None:
                    problems.append(f"{where}: {name} is not exported by vLLM {VLLM_VERSION} ({vllm['wheel'].name})")
                    continue
                allowed = (
                    vllm["labels"].get(metric, set()) | TARGET_LABELS | ({"le"} if name.endswith("_bucket") else set())
                )
                for label, _op, value in sel.matchers:
                    if (
                        label == "source"
                        and "source" in allowed
                        and vllm["sources"]
                        and not re.search(r"[.*|+?\[$]", value)
                        and value not in vllm["sources"]
                    ):
                        problems.append(f'{where}: {name}{{source="{value}"}}: vLLM\'s sources are {vllm["sources"]}')
            elif name.startswith("vllm_router_"):
                if not router_exports(name):
                    problems.append(f"{where}: {name} is not exported by vllm-router {VLLM_ROUTER_VERSION}")
                    continue
                allowed = ROUTER_LABELS | TARGET_LABELS
            else:
                table = {**NODE_EXPORTER, **NGINX_EXPORTER, **front_metrics(), **PROMETHEUS_OWN}
                if name not in table:
                    problems.append(
                        f"{where}: {name} is exported by none of vLLM, vllm-router, node exporter, the nginx "
                        "exporter, the front's fallback page or Prometheus itself"
                    )
                    continue
                allowed = table[name] | TARGET_LABELS
            for label in sorted(used - allowed):
                problems.append(f"{where}: {name} has no label {label!r} (it has {sorted(allowed)})")
    return problems


# --------------------------------------------------------------------------- Ansible runs


def collections_path() -> str:
    ours = next(p for p in sys.path if (Path(p) / "ansible_collections" / "inferops" / "vllm").is_dir())
    extra = os.environ.get("ANSIBLE_COLLECTIONS_PATH") or str(REPO / ".ansible" / "collections")
    return os.pathsep.join([ours, extra])


def run_playbook(
    tmp: Path,
    name: str,
    plays: list[dict[str, Any]],
    inventory: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    timeout: int = 300,
) -> subprocess.CompletedProcess[str]:
    """ansible-playbook on ``plays`` with ``inventory`` (default: localhost only), everything local."""
    playbook = tmp / f"{name}.yml"
    playbook.write_text(yaml.safe_dump(plays, sort_keys=False), encoding="utf-8")
    if inventory is None:
        inventory = {"all": {"hosts": {"localhost": {}}}}
    inv = tmp / f"{name}-hosts.yml"
    inv.write_text(yaml.safe_dump(inventory), encoding="utf-8")
    env = playbook_env(
        ANSIBLE_LOCALHOST_WARNING="0",
        ANSIBLE_INVENTORY_UNPARSED_WARNING="0",
        ANSIBLE_COLLECTIONS_PATH=collections_path(),
    )
    args = [
        ANSIBLE_PLAYBOOK,
        "-i",
        str(inv),
        str(playbook),
        "-e",
        json.dumps({"ansible_connection": "local", "ansible_python_interpreter": sys.executable, **(extra or {})}),
    ]
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def role_task(tasks_file: str, name: str, **changes: Any) -> dict[str, Any]:
    """The task called ``name`` of roles/vllm_monitoring/tasks/<tasks_file> (searched in blocks too), its
    module arguments updated with ``changes`` (None removes one), without its notify and when."""

    def walk(tasks):
        for t in tasks:
            yield t
            yield from walk(t.get("block") or [])

    tasks = yaml.safe_load((ROLE / "tasks" / tasks_file).read_text(encoding="utf-8"))
    (task,) = [t for t in walk(tasks) if t.get("name") == name]
    task = {k: v for k, v in task.items() if k not in ("notify", "when", "block")}
    (module,) = [k for k in task if k.startswith(("ansible.builtin.", "inferops.vllm."))]
    args = dict(task[module])
    for key, value in changes.items():
        if value is None:
            args.pop(key, None)
        else:
            args[key] = value
    if "src" in args and not str(args["src"]).startswith("/"):
        args["src"] = str(ROLE / "templates" / args["src"])
    task[module] = args
    return task


def config_files_task(
    tasks_file: str,
    name: str,
    path: str,
    role: Path = ROLE,
    only: str | None = None,
    changes: dict[str, Any] | None = None,
    keys: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """The inferops.vllm.config_files task called ``name`` of ``role``'s tasks/<tasks_file> (roles/vllm_monitoring by
    default), writing only some of its entries ``f``, each to ``path`` (a Jinja expression of the entry ``f``), with no
    owner or group, its templates read from the role (the test's play is not in the role), without its notify,
    register, tags and when. What else an entry says (its validate command, secret, state) stays, but for ``changes``
    (for example {"validate": None}: not validated). The entries kept: with ``keys``, those with these keys of a task
    whose files are a YAML list, chosen before anything is templated (the others may name variables the test does not
    define); else those the Jinja test ``only`` keeps (by default its rendered templates)."""
    tasks = yaml.safe_load((role / "tasks" / tasks_file).read_text(encoding="utf-8"))
    (task,) = [t for t in tasks if t.get("name") == name]
    files = task["inferops.vllm.config_files"]["files"]
    if keys is not None:
        # Rehomed here, before anything is templated: each kept entry's path is ``path`` with its key for f.key.
        kept = []
        for f in files:
            if f.get("key") not in keys:
                continue
            g = {**f, "owner": None, "group": None, "path": "{{ " + path.replace("f.key", repr(f["key"])) + " }}"}
            if "template" in f:
                g["template"] = str(role / "templates" / f["template"])
            kept.append({**g, **(changes or {})})
        assert sorted(g["key"] for g in kept) == sorted(keys), keys
        return {"name": name, "inferops.vllm.config_files": {"files": kept}}
    if only is None:
        only = "f.template is defined"
    rehomed = (
        "{%- set ns = namespace(out=[]) -%}{%- for f in __files if " + only + " -%}"
        "{%- set g = f | combine({'owner': None, 'group': None, 'path': " + path + "}, " + repr(changes or {}) + ") -%}"
        "{%- if f.template is defined -%}"
        "{%- set g = g | combine({'template': '" + str(role / "templates") + "/' ~ f.template}) -%}"
        "{%- endif -%}{%- set ns.out = ns.out + [g] -%}{%- endfor -%}{{ ns.out }}"
    )
    return {"name": name, "vars": {"__files": files}, "inferops.vllm.config_files": {"files": rehomed}}
