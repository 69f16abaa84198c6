"""playbooks/benchmark.yml against the deployment, for real: `vllm bench serve` through the front and, with
vllm_benchmark_colocated, straight to the prefill instance alone; the prefix-cache check; the report with its
table and charts. Small on purpose (a few prompts): what is tested is that every part runs and says the truth,
not how fast a 2-core machine is."""

from __future__ import annotations

import json
import os

import pytest
from conftest import PREFILL, container_ip, deploy_playbook, front_ca

EPHEMERAL = os.environ.get("MOLECULE_EPHEMERAL_DIRECTORY", "")
pytestmark = pytest.mark.skipif(not EPHEMERAL, reason="runs inside molecule only (its inventory)")

PROMPTS = 4
SCENARIOS = [{"name": "tiny", "dataset": "random", "input_len": 64, "output_len": 8, "num_prompts": PROMPTS,
              "rate": "inf", "concurrency": 2}]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    results = tmp_path_factory.mktemp("bench-results")
    extra = {"vllm_benchmark_scenarios": SCENARIOS, "vllm_benchmark_colocated": True,
             "vllm_benchmark_results_dir": str(results), "vllm_benchmark_poll_interval": 5}
    ca = front_ca()
    if ca:
        extra["inferops_front_ca_file"] = ca
    done = deploy_playbook(os.path.join(EPHEMERAL, "inventory"), "benchmark.yml", "-e", json.dumps(extra))
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    (run_dir,) = [p for p in results.iterdir() if p.is_dir()]
    return run_dir, done.stdout


def result(path):
    data = json.loads(path.read_text())
    assert data["completed"] == PROMPTS and data["failed"] == 0, {k: data.get(k) for k in ("completed", "failed")}
    return data


def test_each_scenario_runs_through_the_front_and_against_one_instance_alone(run, decode_urls):
    run_dir = run[0]
    pd, alone = result(run_dir / "tiny.json"), result(run_dir / "colocated" / "tiny.json")
    assert pd["configuration"] == f"PD 1P+{len(decode_urls)}D"
    assert pd["front"].startswith(f"https://{container_ip('molecule-router')}:")
    assert alone["configuration"].startswith(f"colocated: {PREFILL} ")
    assert alone["front"] == f"http://{container_ip(PREFILL)}:8100"
    # What the instances really run, read from their vllm:cache_config_info, on both rows.
    assert pd["kv_dtype"] == alone["kv_dtype"] != "unknown" and pd["prefix_caching"] == alone["prefix_caching"] == "on"
    # The colocated runs send other prompts than the PD runs, which the prefill instance has just cached.
    assert int(alone["seed"]) == int(pd["seed"]) + 1


def test_the_report_has_both_rows_and_its_charts(run, decode_urls):
    run_dir, stdout = run
    report = (run_dir / "results.md").read_text()
    results = report.split("## Results", 1)[1].split("\n## ", 1)[0]  # the results table, not the scenarios'
    rows = [line for line in results.splitlines() if line.startswith("| tiny |")]
    assert len(rows) == 2 and any(f"| PD 1P+{len(decode_urls)}D |" in r for r in rows), rows
    assert any("| colocated: " in r for r in rows), rows
    assert all(f"| 0 of {PROMPTS} |" in r for r in rows), rows
    # The KV path: the PD row's NIXL transfers (the KV moved), "-" on the colocated row (no KV moves there).
    pd_row = next(r for r in rows if "| colocated: " not in r)
    alone_row = next(r for r in rows if "| colocated: " in r)
    assert alone_row.rstrip().endswith(f"| 0 of {PROMPTS} | - | - | - | - | - |"), alone_row
    transfers = pd_row.split(f"| 0 of {PROMPTS} | ", 1)[1].split(" |")[0]
    assert transfers.replace(",", "").isdigit() and int(transfers.replace(",", "")) > 0, pd_row
    kv = json.loads((run_dir / "kv" / "tiny.json").read_text())
    assert kv["problems"] == [] and kv["bytes"] > 0 and kv["xfer_p50_ms"] > 0, kv
    assert "**CPU numbers.**" in report.split("## Results")[0]  # the sandbox says so, and names the CPU
    for chart in ("latency", "throughput", "prefix_cache"):
        assert (run_dir / "charts" / f"{chart}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", chart
    assert "## Results" in stdout  # the playbook shows the report


def test_the_prefix_cache_check_shows_the_hits_that_explain_the_second_request(run):
    run_dir = run[0]
    check = json.loads((run_dir / "deployment.json").read_text())["prefix_check"]
    first, second = check["requests"]
    assert first["hits"] == 0 and second["hits"] > 0, check["summary"]
    # With PD both sides find the system prompt's blocks: prefill in its cache, decode those NIXL brought. Every
    # instance that took part (queried its cache: the prefill and the decode instance the router chose) had hits.
    served = {name: counts for name, counts in second["per_instance"].items() if counts["queries"] > 0}
    assert "prefill-0" in served and any(name.startswith("decode-") for name in served), second["per_instance"]
    assert all(counts["hits"] > 0 for counts in served.values()), second["per_instance"]
