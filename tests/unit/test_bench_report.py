"""The benchmark report (roles/vllm_benchmark/files/inferops_bench_report.py): results.md and the charts from
hand-written vllm bench serve results (tests/unit/fixtures/bench, vLLM 0.32's --save-result format)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "roles" / "vllm_benchmark" / "files" / "inferops_bench_report.py"
FIXTURES = REPO / "tests" / "unit" / "fixtures" / "bench"
AUTO, FP8 = "20261201-100000", "20261201-110000"
HEADER = ("| scenario | configuration | KV dtype | prefix caching | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) "
          "| output tok/s | request/s | failed | KV transfers | KV xfer p50 (ms) | KV xfer p99 (ms) | KV MB/s "
          "| KV bytes/prompt token |")
NOT_MEASURED = " n/a | n/a | n/a | n/a | n/a |"


def _load():
    spec = importlib.util.spec_from_file_location("inferops_bench_report", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


report = _load()


@pytest.fixture
def runs(tmp_path):
    for name in (AUTO, FP8):
        shutil.copytree(FIXTURES / name, tmp_path / name)
    return tmp_path / AUTO, tmp_path / FP8


def test_rows_come_from_the_bench_results_only(runs):
    rows = report.load_rows(runs[0])
    assert sorted(r["scenario"] for r in rows) == ["shared-prefixes", "short-prompts"]  # not deployment/notes.json
    short = next(r for r in rows if r["scenario"] == "short-prompts")
    assert (short["configuration"], short["kv_dtype"], short["prefix_caching"], short["run"]) == (
        "PD 1P+1D", "auto", "on", AUTO)
    figures = ("ttft_p50", "ttft_p99", "itl_p50", "output_throughput", "request_throughput", "failed", "num_prompts")
    assert tuple(short[k] for k in figures) == (688.1, 1012.6, 49.8, 23.44, 0.7326, 0, 16)


def test_the_markdown_table_in_the_sources_shape(runs):
    text = report.report(runs[0], with_charts=False)
    lines = text.splitlines()
    start = lines.index(HEADER)
    assert lines[start + 1] == "|" + " --- |" * 15
    # These results are from before the KV path was measured: n/a, not zeros; no goodput column without SLOs.
    assert lines[start + 2:start + 4] == [
        "| shared-prefixes | PD 1P+1D | auto | on | 1,102 | 1,895 | 55.6 | 20.0 | 0.62 | 1 of 16 |" + NOT_MEASURED,
        "| short-prompts | PD 1P+1D | auto | on | 688 | 1,013 | 49.8 | 23.4 | 0.73 | 0 of 16 |" + NOT_MEASURED,
    ]
    assert "goodput" not in lines[start]
    assert (runs[0] / "results.md").read_text() == text
    assert "No charts (vllm_benchmark_charts: false)." in text


def test_cpu_numbers_and_the_machine_are_said(runs):
    text = report.report(runs[0], with_charts=False)
    assert ("**CPU numbers.** These instances run vLLM's CPU build (`vllm_install_variant: cpu`) on "
            "Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz: the figures measure this machine, not GPU serving.") in text
    assert ("| inferops-prefill-1 | prefill, vllm bench serve | Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz | "
            "2 vCPUs (1 socket(s) x 2 core(s) x 1 thread(s)) | 23.0 GiB | "
            "Debian 12, 6.1.0-27-amd64 (container/guest) | none | 0.32.0 (cpu build) |") in text


def test_gpu_machines_get_no_cpu_line():
    deployment = {"machines": [{"host": "g1", "roles": ["prefill"], "vllm_variant": "cuda", "gpus": ["NVIDIA H100"] * 2,
                                "processor": ["0", "AuthenticAMD", "AMD EPYC 9654"], "processor_vcpus": 192}]}
    text = report.markdown(deployment, [], None)
    assert "CPU numbers" not in text
    assert "| g1 | prefill | AMD EPYC 9654 | 192 vCPUs | unknown | " in text and "| 2 x NVIDIA H100 | " in text


def test_the_prefix_cache_check_is_explained(runs):
    text = report.report(runs[0], with_charts=False)
    assert "Two chat requests with the same 498-token system prompt (tag `3f9a0c1e`" in text
    assert "| first | 812 | 1,021 | 498 | 996 | 0 |" in text and "| second | 339 | 560 | 498 | 996 | 768 |" in text
    assert ("**TTFT drop: 58.3 %** (second vs first). `vllm:prefix_cache_hits_total` during the second request: "
            "prefill-0 +384 of 498 queried, decode-0 +384 of 498 queried (first request: +0).") in text
    assert "vLLM caches whole blocks (128 tokens here)" in text
    assert report.prefix_section(None, []) == ["Not run (vllm_benchmark_prefix_check: false)."]


def test_an_earlier_run_joins_the_table_for_the_fp8_comparison(runs):
    text = report.report(runs[0], [runs[1]], with_charts=False)
    assert f"This run and {FP8}; one row per scenario and configuration." in text
    assert "| short-prompts | PD 1P+1D | auto | on | 688 |" in text
    assert "| short-prompts | PD 1P+1D | fp8 | on | 640 | 950 | 47.5 | 24.1 | 0.75 | 0 of 16 |" in text


def test_charts_are_pngs(runs):
    pytest.importorskip("matplotlib")
    text = report.report(runs[0], [runs[1]])
    for name in ("latency", "throughput", "prefix_cache"):
        path = runs[0] / "charts" / f"{name}.png"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"![{name}](charts/{name}.png)" in text


def test_the_command_line(runs, capsys):
    assert report.main([str(runs[0]), f"--compare={runs[1]}", "--no-charts"]) == 0
    assert capsys.readouterr().out.strip() == str(runs[0] / "results.md")
    assert report.main([str(runs[0] / "nowhere")]) == 2


# --------------------------------------------------------------------------- the KV path and goodput

RESULT = {"completed": 16, "failed": 0, "duration": 20.0, "p50_ttft_ms": 700.0, "p99_ttft_ms": 1000.0,
          "p50_itl_ms": 50.0, "output_throughput": 25.0, "request_throughput": 0.8, "total_input_tokens": 2048,
          "run": "20261202-090000"}


def kv_figures(**changes):
    """A scenario's KV path as the playbook's bench_kv filter writes it (kv/<scenario>.json)."""
    kv = {"transfers": 16, "failed_transfers": 0, "xfer_p50_ms": 9.75, "xfer_p99_ms": 95.875, "bytes": 47185920,
          "xfer_seconds": 0.5, "mb_per_s": 94.372, "bytes_per_prompt_token": 23040.0, "input_tokens": 2048,
          "kv_moved": True, "complete": True, "instances": [], "problems": []}
    return {**kv, **changes}


def write_run(run_dir, results, kv=None):
    """Result JSONs (name -> metadata and figures) and, for those in ``kv``, their KV path."""
    run_dir.mkdir(parents=True)
    for name, data in results.items():
        (run_dir / f"{name}.json").write_text(json.dumps({**RESULT, "scenario": name, **data}))
    for name, figures in (kv or {}).items():
        (run_dir / "kv").mkdir(exist_ok=True)
        (run_dir / "kv" / f"{name}.json").write_text(json.dumps(figures))
    return run_dir


def table_rows(text):
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| scenario | configuration |"))
    end = lines.index("", start)
    return lines[start:end]


def test_the_kv_path_in_the_table_and_a_dash_for_the_colocated_rows(tmp_path):
    pd = {"configuration": "PD 1P+1D", "kv_dtype": "auto", "prefix_caching": "on", "kv_transfer": "nixl"}
    run = write_run(tmp_path / "run", {"short": pd}, {"short": kv_figures()})
    write_run(run / "colocated", {"short": {**pd, "configuration": "colocated: p1 vllm-0 alone",
                                            "kv_transfer": "none"}})
    text = report.report(run, [run / "colocated"], with_charts=False)
    rows = table_rows(text)
    assert rows[0] == HEADER
    assert rows[2:] == [
        "| short | PD 1P+1D | auto | on | 700 | 1,000 | 50.0 | 25.0 | 0.80 | 0 of 16 "
        "| 16 | 9.8 | 95.9 | 94.4 | 23,040 |",
        "| short | colocated: p1 vllm-0 alone | auto | on | 700 | 1,000 | 50.0 | 25.0 | 0.80 | 0 of 16 "
        "| - | - | - | - | - |",
    ]
    assert "as Prometheus' `histogram_quantile` does (linear interpolation within the bucket" in text
    assert "No KV moved" not in text and "KV path notes" not in text
    # A colocated result from before kv_transfer was in the metadata: known by its configuration.
    assert report.kv_path({"configuration": "colocated: p1 vllm-0 alone"}) == "none"
    assert report.kv_path({"configuration": "PD 1P+1D"}) == "unknown"


def test_a_pd_scenario_without_transfers_is_said_loudly(tmp_path):
    problem = "short: NO KV MOVED: vllm:nixl_xfer_time_seconds_count did not grow on any instance during the scenario"
    run = write_run(tmp_path / "run", {"short": {"configuration": "PD 1P+1D", "kv_transfer": "nixl"}},
                    {"short": kv_figures(transfers=0, bytes=0, xfer_p50_ms=None, xfer_p99_ms=None, mb_per_s=None,
                                         bytes_per_prompt_token=None, kv_moved=False, problems=[problem])})
    text = report.report(run, with_charts=False)
    assert "| 0 of 16 | **0: no KV moved** | - | - | - | - |" in table_rows(text)[2]
    warning = next(line for line in text.splitlines() if line.startswith("> **No KV moved"))
    assert warning.startswith("> **No KV moved in short (PD 1P+1D, 20261202-090000):** no NIXL transfer happened")
    # The warning stands above the table, the measurement's own words below it.
    assert text.index(warning) < text.index(HEADER)
    assert f"- short (PD 1P+1D, 20261202-090000): {problem.removeprefix('short: ')}" in text


def test_an_incomplete_kv_measurement_is_marked_and_explained(tmp_path):
    problem = ("short: decode-1 vllm-0 (http://10.0.0.12:8200): vllm:nixl_xfer_time_seconds_count went down from 5 to "
               "1 during the scenario: the instance restarted")
    run = write_run(tmp_path / "run", {"short": {"configuration": "PD 1P+2D", "kv_transfer": "nixl"}},
                    {"short": kv_figures(transfers=1234, complete=False, problems=[problem])})
    text = report.report(run, with_charts=False)
    assert "| 0 of 16 | 1,234 * | 9.8 |" in table_rows(text)[2]
    assert "KV path notes:" in text
    assert f"- short (PD 1P+2D, 20261202-090000): {problem.removeprefix('short: ')}" in text


def test_a_goodput_column_when_slos_were_given(tmp_path):
    run = write_run(tmp_path / "run", {
        "short": {"configuration": "PD 1P+1D", "kv_transfer": "nixl", "request_goodput": 0.6,
                  "goodput_slos": "ttft:500 tpot:100"},
        "long": {"configuration": "PD 1P+1D", "kv_transfer": "nixl", "request_goodput": None}})
    text = report.report(run, with_charts=False)
    rows = table_rows(text)
    assert rows[0] == HEADER + " goodput (req/s) |" and rows[1] == "|" + " --- |" * 16
    assert rows[2].startswith("| long |") and rows[2].endswith(NOT_MEASURED + " - |")
    assert rows[3].startswith("| short |") and rows[3].endswith(" | 0.60 |")
    assert ("Goodput: requests per second that met every SLO (`vllm bench serve --goodput`, milliseconds; `-`: the "
            "scenario had no SLOs): short ttft:500 tpot:100.") in text
