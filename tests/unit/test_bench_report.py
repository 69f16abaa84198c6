"""The benchmark report (roles/vllm_benchmark/files/inferops_bench_report.py): results.md and the charts from
hand-written vllm bench serve results (tests/unit/fixtures/bench, vLLM 0.32's --save-result format)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "roles" / "vllm_benchmark" / "files" / "inferops_bench_report.py"
FIXTURES = REPO / "tests" / "unit" / "fixtures" / "bench"
AUTO, FP8 = "20261201-100000", "20261201-110000"
HEADER = ("| scenario | configuration | KV dtype | prefix caching | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) "
          "| output tok/s | request/s | failed |")


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
    assert lines[start + 1] == "|" + " --- |" * 10
    assert lines[start + 2:start + 4] == [
        "| shared-prefixes | PD 1P+1D | auto | on | 1,102 | 1,895 | 55.6 | 20.0 | 0.62 | 1 of 16 |",
        "| short-prompts | PD 1P+1D | auto | on | 688 | 1,013 | 49.8 | 23.4 | 0.73 | 0 of 16 |",
    ]
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
