# Copyright (c) inferops.vllm contributors
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""results.md and PNG charts from the result JSONs of `vllm bench serve` (vLLM 0.32's --save-result format).

playbooks/benchmark.yml (the vllm_benchmark role's report entry point) runs it on the controller:

    inferops_bench_report.py RUN_DIR [--compare=EARLIER_RUN_DIR ...] [--no-charts]

RUN_DIR holds one JSON per scenario, as vllm bench serve saved it (with --metadata scenario=, configuration=,
kv_dtype=, prefix_caching=, run=, kv_transfer=, goodput_slos=), deployment.json (the deployment, its machines and
the prefix-cache check, written by the playbook) and kv/<scenario>.json: each PD scenario's KV path, worked out by
the playbook (filter inferops.vllm.bench_kv) from the instances' NIXL metrics before and after the scenario.
The table has one row per result: this run's and those of each --compare directory (earlier runs, or any JSON of
vllm bench serve with that metadata), so that PD and colocated, or fp8 and auto KV, stand side by side. Writes
RUN_DIR/results.md and RUN_DIR/charts/*.png (matplotlib; without it, results.md says so). Standard library
only, apart from matplotlib for the charts.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

DEPLOYMENT = "deployment.json"
KV_DIR = "kv"
VENDORS = {"GenuineIntel", "AuthenticAMD", "HygonGenuine", "CentaurHauls"}
COLUMNS = ("scenario", "configuration", "KV dtype", "prefix caching", "TTFT p50 (ms)", "TTFT p99 (ms)",
           "ITL p50 (ms)", "output tok/s", "request/s", "failed", "KV transfers", "KV xfer p50 (ms)",
           "KV xfer p99 (ms)", "KV MB/s", "KV bytes/prompt token")
GOODPUT_COLUMN = "goodput (req/s)"


# --------------------------------------------------------------------------- reading


def load_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def is_bench_result(data: Any) -> bool:
    """A result JSON of vllm bench serve (it has the request counts and the throughputs)."""
    return isinstance(data, dict) and all(k in data for k in ("completed", "request_throughput", "duration"))


def _number(value: Any) -> float | None:
    """A finite JSON number as a float; None for null, a string, a boolean, NaN or Infinity.

    Programs wrote every input (vllm bench serve's results, deployment.json), so a measurement is a JSON
    number. What people typed, the scenarios, was parsed and checked once, by the bench_scenarios filter
    (plugins/filter/bench.py), before it reached deployment.json.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _metric(data: Mapping[str, Any], *keys: str) -> float | None:
    """The first of ``keys`` that the result has as a number (p50 falls back to the median, which is the same)."""
    for key in keys:
        value = _number(data.get(key))
        if value is not None:
            return value
    return None


def kv_path(data: Mapping[str, Any]) -> str:
    """How the result's KV moved: ``nixl`` (PD through the router), ``none`` (the colocated runs: one process
    prefills and decodes) or ``unknown`` (a result from before the metadata said so)."""
    given = str(data.get("kv_transfer") or "")
    if given:
        return given
    return "none" if str(data.get("configuration") or "").startswith("colocated") else "unknown"


def load_kv(source: Path) -> dict[str, Any] | None:
    """The scenario's KV path beside its result (kv/<name>.json), or None when it was not measured."""
    path = source.parent / KV_DIR / source.name
    try:
        data = load_json(path)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def row(data: Mapping[str, Any], run: str, source: str, kv: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One table row from one result JSON (and its KV path); the grouping columns come from its --metadata."""
    completed = int(_number(data.get("completed")) or 0)
    failed = int(_number(data.get("failed")) or 0)
    return {
        "scenario": str(data.get("scenario") or data.get("label") or Path(source).stem),
        "configuration": str(data.get("configuration") or "unknown"),
        "kv_dtype": str(data.get("kv_dtype") or "unknown"),
        "prefix_caching": str(data.get("prefix_caching") or "unknown"),
        "run": run,
        "source": source,
        "ttft_p50": _metric(data, "p50_ttft_ms", "median_ttft_ms"),
        "ttft_p99": _metric(data, "p99_ttft_ms"),
        "itl_p50": _metric(data, "p50_itl_ms", "median_itl_ms"),
        "output_throughput": _metric(data, "output_throughput"),
        "request_throughput": _metric(data, "request_throughput"),
        "completed": completed,
        "failed": failed,
        # Requests sent: prefix_repetition sends num_prefixes x (num_prompts // num_prefixes), not num_prompts.
        "num_prompts": completed + failed or int(_number(data.get("num_prompts")) or 0),
        "duration": _metric(data, "duration"),
        "vllm_variant": str(data.get("vllm_variant") or ""),
        "kv_transfer": kv_path(data),
        "kv": dict(kv) if kv else None,
        # vllm bench serve writes request_goodput (null without --goodput); goodput_slos is our metadata.
        "goodput": _metric(data, "request_goodput"),
        "goodput_slos": str(data.get("goodput_slos") or ""),
    }


def load_rows(directory: Path) -> list[dict[str, Any]]:
    """The rows of every vllm bench result JSON in ``directory`` (deployment.json and other JSON are skipped)."""
    rows = []
    for path in sorted(directory.glob("*.json")):
        if path.name == DEPLOYMENT:
            continue
        try:
            data = load_json(path)
        except (OSError, ValueError):
            continue
        if is_bench_result(data):
            rows.append(row(data, str(data.get("run") or directory.name), str(path), load_kv(path)))
    return rows


def sort_rows(rows: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return sorted(rows, key=lambda r: (r["scenario"], r["configuration"], r["kv_dtype"], r["prefix_caching"], r["run"]))


# --------------------------------------------------------------------------- machines


def cpu_models(processor: Iterable[Any]) -> list[str]:
    """CPU model names from Ansible's ``processor`` fact (index, vendor, model, index, vendor, model, ...)."""
    out: list[str] = []
    for item in processor or []:
        text = " ".join(str(item).split())
        if not text or text.isdigit() or text in VENDORS or text in out:
            continue
        out.append(text)
    return out


def cores(machine: Mapping[str, Any]) -> str:
    vcpus = machine.get("processor_vcpus")
    keys = ("processor_count", "processor_cores", "processor_threads_per_core")
    sockets, per_socket, threads = (machine.get(k) for k in keys)
    if vcpus in (None, ""):
        return "unknown"
    shape = f" ({sockets} socket(s) x {per_socket} core(s) x {threads} thread(s))" if sockets and per_socket else ""
    return f"{vcpus} vCPUs{shape}"


def memory(machine: Mapping[str, Any]) -> str:
    mb = _number(machine.get("memtotal_mb"))
    return f"{mb / 1024:.1f} GiB" if mb else "unknown"


def machines_table(machines: Iterable[Mapping[str, Any]]) -> list[str]:
    lines = ["| host | role | CPU | cores | memory | OS, kernel | GPUs | vLLM |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for m in machines:
        gpus = m.get("gpus") or []
        gpu_text = ", ".join(f"{n} x {name}" for name, n in _counts(gpus)) if gpus else "none"
        virt = str(m.get("virtualization") or "").strip("/")
        os_text = f"{m.get('os', '').strip()}, {m.get('kernel', '')}"
        if virt and virt != "NA/NA":
            os_text += f" ({virt})"
        lines.append(f"| {m.get('host')} | {', '.join(m.get('roles') or []) or '-'} | "
                     f"{'; '.join(cpu_models(m.get('processor') or [])) or 'unknown'} | {cores(m)} | {memory(m)} | "
                     f"{os_text} | {gpu_text} | {m.get('vllm_version', '')} ({m.get('vllm_variant', '')} build) |")
    return lines


def _counts(items: Iterable[str]) -> list[tuple[str, int]]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return list(out.items())


def cpu_only(deployment: Mapping[str, Any], rows: Iterable[Mapping[str, Any]]) -> bool:
    """Whether the numbers come from vLLM's CPU build (the sandbox), by the machines or the results' metadata."""
    variants = {str(m.get("vllm_variant")) for m in deployment.get("machines") or []
                if {"prefill", "decode"} & set(m.get("roles") or [])}
    variants |= {r["vllm_variant"] for r in rows if r["vllm_variant"]}
    return "cpu" in variants


# --------------------------------------------------------------------------- markdown


def _fmt(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def kv_cells(r: Mapping[str, Any]) -> list[str]:
    """The KV columns of a row: "-" where no KV moves by design (colocated), n/a where it was not measured."""
    if r["kv_transfer"] == "none":
        return ["-"] * 5
    kv = r.get("kv")
    if not kv or _number(kv.get("transfers")) is None:
        return ["n/a"] * 5
    transfers = int(_number(kv.get("transfers")) or 0)
    if transfers == 0:
        return ["**0: no KV moved**", "-", "-", "-", "-"]
    mark = "" if kv.get("complete") else " *"
    return [f"{transfers:,}{mark}", _fmt(_number(kv.get("xfer_p50_ms")), 1), _fmt(_number(kv.get("xfer_p99_ms")), 1),
            _fmt(_number(kv.get("mb_per_s")), 1), _fmt(_number(kv.get("bytes_per_prompt_token")), 0)]


def with_goodput(rows: Iterable[Mapping[str, Any]]) -> bool:
    """Whether the table gets a goodput column: some result was measured against SLOs."""
    return any(r["goodput_slos"] or r["goodput"] is not None for r in rows)


def results_table(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    rows = list(rows)
    goodput = with_goodput(rows)
    columns = COLUMNS + ((GOODPUT_COLUMN,) if goodput else ())
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for r in sort_rows(rows):
        cells = [r["scenario"], r["configuration"], r["kv_dtype"], r["prefix_caching"], _fmt(r["ttft_p50"], 0),
                 _fmt(r["ttft_p99"], 0), _fmt(r["itl_p50"], 1), _fmt(r["output_throughput"], 1),
                 _fmt(r["request_throughput"], 2), f"{r['failed']} of {r['num_prompts']}", *kv_cells(r)]
        if goodput:
            cells.append(_fmt(r["goodput"], 2) if r["goodput_slos"] or r["goodput"] is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def kv_warnings(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """A loud line for each PD row where no KV moved: its figures measure no disaggregation."""
    out = []
    for r in sort_rows(rows):
        kv = r.get("kv") or {}
        if r["kv_transfer"] != "none" and kv and _number(kv.get("transfers")) == 0:
            out.append(f"> **No KV moved in {r['scenario']} ({r['configuration']}, {r['run']}):** no NIXL transfer "
                       "happened on any instance during it, so decode computed every prompt itself; this row measures "
                       "no disaggregation. See the KV path notes below.")
    return out


def kv_notes(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """What the KV figures are, and every problem of their measurement, per row."""
    rows = list(rows)
    lines = ["KV columns: the NIXL transfers during the scenario, from every prefill and decode instance's /metrics "
             "read from the router host right before and right after it (the differences of "
             "`vllm:nixl_xfer_time_seconds`, `vllm:nixl_bytes_transferred` and "
             "`vllm:nixl_num_failed_transfers_total`, summed over the instances). Transfer time p50 and p99 are "
             "estimated from the histogram's buckets as Prometheus' `histogram_quantile` does (linear interpolation "
             "within the bucket; vLLM's buckets run from 5 ms to 5 s). KV MB/s: bytes moved / seconds spent in "
             "transfers (MB = 10^6 bytes). KV bytes/prompt token: bytes moved / the scenario's prompt tokens "
             "(vLLM moves whole KV blocks). `-`: no KV moves (colocated: one process prefills and decodes); n/a: not "
             "measured; `*`: not every instance could be counted (see below)."]
    notes = []
    for r in sort_rows(rows):
        kv = r.get("kv") or {}
        for problem in kv.get("problems") or []:
            # bench_kv starts each problem with the scenario, which the note names already.
            problem = str(problem).removeprefix(f"{kv.get('scenario') or r['scenario']}: ")
            notes.append(f"- {r['scenario']} ({r['configuration']}, {r['run']}): {problem}")
    if notes:
        lines += ["", "KV path notes:", "", *notes]
    if with_goodput(rows):
        slos = sorted({(r["scenario"], r["goodput_slos"]) for r in rows if r["goodput_slos"]})
        lines += ["", "Goodput: requests per second that met every SLO (`vllm bench serve --goodput`, milliseconds; "
                  "`-`: the scenario had no SLOs): " + "; ".join(f"{name} {slo}" for name, slo in slos) + "."]
    return lines


def prefix_section(check: Mapping[str, Any] | None, instances: Iterable[Mapping[str, Any]]) -> list[str]:
    if not check:
        return ["Not run (vllm_benchmark_prefix_check: false)."]
    first, second = check["requests"][:2]
    tokens = second.get("prompt_tokens") or first.get("prompt_tokens")
    sized = ("the front's /tokenize" if check.get("prompt_tokens_source") == "tokenize"
             else "an estimate: /tokenize did not answer")
    blocks = sorted({i.get("block_size") for i in instances if i.get("block_size")})
    lines = [
        f"Two chat requests with the same {tokens or 'long'}-token system prompt "
        f"(tag `{check.get('system_prompt_tag')}`, sized with {sized}), different user messages, one after the other, "
        "through the front.",
        "",
        "| request | TTFT (ms) | latency (ms) | prompt tokens | prefix cache queries (tokens) "
        "| prefix cache hits (tokens) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, q in (("first", first), ("second", second)):
        prompt = q.get("prompt_tokens") if q.get("prompt_tokens") is not None else "n/a"
        lines.append(f"| {name} | {_fmt(_number(q.get('ttft_ms')), 0)} | {_fmt(_number(q.get('latency_ms')), 0)} | "
                     f"{prompt} | {q.get('queries')} | {q.get('hits')} |")
    drop = _number(check.get("ttft_drop_percent"))
    per = ", ".join(f"{name} +{v.get('hits')} of {v.get('queries')} queried"
                    for name, v in (second.get("per_instance") or {}).items())
    lines += ["", f"**TTFT drop: {_fmt(drop, 1)} %** (second vs first). `vllm:prefix_cache_hits_total` during the "
              f"second request: {per or 'no instance counted a query'} (first request: +{first.get('hits')}).",
              ""]
    if blocks:
        lines.append(f"vLLM caches whole blocks ({', '.join(map(str, blocks))} tokens here): the hits are the system "
                     "prompt's full blocks; the rest of the prompt is computed again.")
    off = [i.get("name") for i in instances if i.get("enable_prefix_caching") is False]
    if off:
        lines.append(f"Prefix caching is off on {', '.join(map(str, off))} (vllm_instance_enable_prefix_caching): "
                     "no hits are expected there.")
    return lines


def scenarios_table(scenarios: Iterable[Mapping[str, Any]]) -> list[str]:
    lines = ["| scenario | dataset | prompt tokens (max) | output tokens (max) | prompts | rate (req/s) "
             "| concurrency |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for s in scenarios:
        lines.append(f"| {s.get('name')} | {s.get('dataset')} | {s.get('max_prompt_tokens')} | "
                     f"{s.get('max_output_tokens')} | {s.get('num_prompts')} | {s.get('rate')} | "
                     f"{s.get('concurrency') or 'unlimited'} |")
    return lines


def markdown(deployment: Mapping[str, Any], rows: list[Mapping[str, Any]], charts: list[str] | None,
             chart_note: str = "", compared: Iterable[str] = ()) -> str:
    machines = deployment.get("machines") or []
    lines = [f"# Benchmark {deployment.get('site', '')} {deployment.get('run', '')}".rstrip(), ""]
    keys = ("benchmark_host", "front", "model", "max_model_len", "configuration", "kv_dtype", "prefix_caching")
    d = {k: deployment.get(k, "?") for k in keys}
    lines.append(f"`vllm bench serve` (vLLM's own client) on {d['benchmark_host']}, through the front {d['front']}, "
                 f"model `{d['model']}` (max_model_len {d['max_model_len']}); deployment: {d['configuration']}, "
                 f"KV dtype {d['kv_dtype']}, prefix caching {d['prefix_caching']}.")
    lines.append("")
    if cpu_only(deployment, rows):
        models = sorted({c for m in machines for c in cpu_models(m.get("processor") or [])})
        lines += [f"**CPU numbers.** These instances run vLLM's CPU build (`vllm_install_variant: cpu`) on "
                  f"{', '.join(models) or 'the CPUs below'}: the figures measure this machine, not GPU serving. "
                  "Compare them only with runs on the same machine.", ""]
    lines += ["## Machines", ""] + machines_table(machines) + [""]
    lines += ["## Results", ""]
    compared = list(compared)
    if compared:
        lines += [f"This run and {', '.join(compared)}; one row per scenario and configuration.", ""]
    warnings = kv_warnings(rows)
    if warnings:
        lines += [*warnings, ""]
    lines += results_table(rows) + [""]
    lines += ["TTFT: time to first token; ITL: inter-token latency (median); output tok/s and request/s over the whole "
              "run; failed: requests that did not complete, of those sent.", ""]
    lines += kv_notes(rows) + [""]
    lines += ["## Prefix cache", ""] + prefix_section(deployment.get("prefix_check"), deployment.get("instances") or [])
    lines += ["", "## Scenarios", ""] + scenarios_table(deployment.get("scenarios") or []) + [""]
    lines += ["## Charts", ""]
    if charts:
        lines += [f"![{Path(c).stem}]({c})" for c in charts]
    else:
        lines.append(chart_note or "No charts.")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- charts


def series_label(r: Mapping[str, Any], with_run: bool) -> str:
    label = f"{r['configuration']}, KV {r['kv_dtype']}, prefix {r['prefix_caching']}"
    return f"{label} ({r['run']})" if with_run else label


def charts(rows: list[Mapping[str, Any]], check: Mapping[str, Any] | None, out_dir: Path,
           title_note: str = "") -> tuple[list[str], str]:
    """Write the PNG charts into ``out_dir``: (their paths relative to the run directory, a note when none)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "No charts: matplotlib is not installed on the controller (`pip install matplotlib`)."
    out_dir.mkdir(parents=True, exist_ok=True)
    with_run = len({r["run"] for r in rows}) > 1
    scenarios = sorted({r["scenario"] for r in rows})
    labels = sorted({series_label(r, with_run) for r in rows})
    written = []

    def grouped(ax, key, title):
        width = 0.8 / max(1, len(labels))
        for i, label in enumerate(labels):
            values = []
            for sc in scenarios:
                match = [r[key] for r in rows if r["scenario"] == sc and series_label(r, with_run) == label]
                values.append(match[0] if match and match[0] is not None else 0)
            ax.bar([x + i * width for x in range(len(scenarios))], values, width, label=label)
        ax.set_xticks([x + width * (len(labels) - 1) / 2 for x in range(len(scenarios))])
        ax.set_xticklabels(scenarios)
        ax.set_title(title)

    for name, panels in (("latency", (("ttft_p50", "TTFT p50 (ms)"), ("ttft_p99", "TTFT p99 (ms)"),
                                      ("itl_p50", "ITL p50 (ms)"))),
                         ("throughput", (("output_throughput", "output tokens/s"),
                                         ("request_throughput", "requests/s")))):
        if not rows:
            break
        fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.6))
        for ax, (key, title) in zip(axes, panels, strict=True):
            grouped(ax, key, title)
        handles, names = axes[0].get_legend_handles_labels()
        fig.legend(handles, names, loc="lower center", ncol=min(3, len(names)), fontsize="small")
        if title_note:
            fig.suptitle(title_note, fontsize="medium")
        fig.tight_layout(rect=(0, 0.06 * math.ceil(len(names) / 3) + 0.02, 1, 0.95 if title_note else 1))
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(f"{out_dir.name}/{path.name}")
    if check:
        first, second = check["requests"][:2]
        fig, axes = plt.subplots(1, 2, figsize=(9, 4))
        colors = ["grey", "green"]
        axes[0].bar(["first", "second"], [first.get("ttft_ms") or 0, second.get("ttft_ms") or 0], color=colors)
        axes[0].set_title(f"TTFT (ms), drop {_fmt(_number(check.get('ttft_drop_percent')), 1)} %")
        axes[1].bar(["first", "second"], [first.get("hits") or 0, second.get("hits") or 0], color=colors)
        axes[1].set_title("prefix cache hits (tokens)")
        if title_note:
            fig.suptitle(f"{title_note}: the same system prompt twice", fontsize="medium")
        fig.tight_layout(rect=(0, 0, 1, 0.93 if title_note else 1))
        path = out_dir / "prefix_cache.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(f"{out_dir.name}/{path.name}")
    return written, ""


# --------------------------------------------------------------------------- main


def report(run_dir: Path, compare: Iterable[Path] = (), with_charts: bool = True) -> str:
    """Write run_dir/results.md (and run_dir/charts/*.png); returns the markdown."""
    deployment_path = run_dir / DEPLOYMENT
    deployment = load_json(deployment_path) if deployment_path.is_file() else {}
    rows = load_rows(run_dir)
    compare = list(compare)
    for other in compare:
        rows += load_rows(other)
    if with_charts:
        note = "CPU numbers (vLLM's CPU build)" if cpu_only(deployment, rows) else ""
        title = " ".join(str(deployment.get(k, "")) for k in ("site", "run")).strip()
        written, note = charts(rows, deployment.get("prefix_check"), run_dir / "charts",
                               " - ".join(x for x in (title, note) if x))
    else:
        written, note = [], "No charts (vllm_benchmark_charts: false)."
    text = markdown(deployment, rows, written, note, [p.name for p in compare])
    (run_dir / "results.md").write_text(text, encoding="utf-8")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--compare", type=Path, action="append", default=[],
                        help="an earlier run directory whose results join the table (repeatable)")
    parser.add_argument("--no-charts", action="store_true")
    args = parser.parse_args(argv)
    for directory in [args.run_dir, *args.compare]:
        if not directory.is_dir():
            print(f"{directory}: not a directory", file=sys.stderr)
            return 2
    report(args.run_dir, args.compare, not args.no_charts)
    print(args.run_dir / "results.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
