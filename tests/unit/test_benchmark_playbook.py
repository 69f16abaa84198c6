"""playbooks/benchmark.yml refuses bad scenarios and settings on the controller, before any host is contacted
and any request sent, through the real ansible-playbook on tests/preflight/good (hosts on unroutable TEST-NET-1
addresses: contacting one would show as unreachable). A good run passes the check, says what it will run, and
only then contacts the hosts (here: unreachable)."""

from __future__ import annotations

import json
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_preflight_inventories import ANSIBLE_PLAYBOOK, CASES_DIR, RECAP_RE, REPO, playbook_env

pytestmark = pytest.mark.skipif(ANSIBLE_PLAYBOOK is None, reason="ansible-playbook is not installed")

GOOD = {"name": "ok", "dataset": "random", "input_len": 100, "output_len": 10, "num_prompts": 4, "rate": 1}
CASES = {
    "unknown_dataset": ({"vllm_benchmark_scenarios": [GOOD, {**GOOD, "name": "hub", "dataset": "hf"}]},
                        [r"\[scenario\] scenario 'hub': dataset: is 'hf', not a dataset that vllm bench serve runs "
                         r"offline here \(random, prefix_repetition, sharegpt\)"]),
    "too_long": ({"vllm_benchmark_scenarios": [{**GOOD, "name": "long", "input_len": 600, "output_len": 32}]},
                 [r"\[scenario\] scenario 'long': input_len: prompts of up to 600 tokens \(input_len 600\) \+ up to 32 "
                  r"output tokens = 632 tokens, more than max_model_len 512 "
                  r"\(decode-1, the smallest of the instances\)"]),
    "numbers": ({"vllm_benchmark_scenarios": [{**GOOD, "num_prompts": 0, "rate": -2, "typo": 1}]},
                [r"Benchmark: 3 problem\(s\); no request was sent\.",
                 r"\[scenario\] scenario 'ok': typo: is not a setting of a random scenario",
                 r"\[scenario\] scenario 'ok': num_prompts: is 0, not a positive whole number",
                 r"\[scenario\] scenario 'ok': rate: is -2, not a positive number of requests per second"]),
    "goodput": ({"vllm_benchmark_goodput_slos": {"ttft_ms": -1},
                 "vllm_benchmark_scenarios": [{**GOOD, "goodput": {"tpot": 100}}]},
                [r"Benchmark: 2 problem\(s\); no request was sent\.",
                 r"\[scenario\] scenario 'ok': goodput\.tpot: is not an SLO that vllm bench serve measures goodput "
                 r"by \(known: ttft_ms, tpot_ms, e2el_ms\)\. Fix: use ttft_ms",
                 r"\[goodput\] vllm_benchmark_goodput_slos: ttft_ms: is -1, not a positive number of milliseconds\. "
                 r"Fix: give the SLO in milliseconds"]),
    "settings": ({"vllm_benchmark_host": "nowhere", "vllm_benchmark_compare_with": ["/nonexistent/run"],
                  "vllm_router_front_bind": "127.0.0.1"},
                 [r"\[host\] vllm_benchmark_host: is \"nowhere\", not a host of the inventory",
                  r"\[compare\] vllm_benchmark_compare_with: /nonexistent/run is not a directory",
                  r"\[front\] router-1: vllm_router_front_bind: is '127.0.0.1'"]),
}


def _run(extra: dict, results) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [ANSIBLE_PLAYBOOK, "-i", str(CASES_DIR / "good"), str(REPO / "playbooks" / "benchmark.yml"),
         "-e", json.dumps({"vllm_benchmark_results_dir": str(results), **extra})],
        cwd=REPO, env=playbook_env(), capture_output=True, text=True, timeout=300, check=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("benchmark")
    todo = {name: extra for name, (extra, _patterns) in CASES.items()}
    todo["good"] = {"vllm_benchmark_scenarios": [GOOD]}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_run, extra, tmp / name) for name, extra in todo.items()}
        return {name: (future.result(), tmp / name) for name, future in futures.items()}


def _recap(output: str) -> dict[str, tuple[int, ...]]:
    return {m[1]: tuple(int(x) for x in m.groups()[1:]) for m in RECAP_RE.finditer(output)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_before_any_host_is_contacted(runs, case):
    run, results = runs[case]
    output = run.stdout + run.stderr
    flat = " ".join(output.split())
    assert run.returncode != 0, output
    assert re.search(r"Benchmark: \d+ problem\(s\); no request was sent\.", flat), output
    for pattern in CASES[case][1]:
        assert re.search(pattern, flat), f"{pattern!r} not in:\n{output}"
    # Only the publishing play (set_fact, no connection) touched the PD and router hosts (the router publishes
    # vllm_router_published, where the front is); no facts, no prefix check on the router, no results.
    recap = _recap(output)
    assert set(recap) == {"prefill-1", "decode-1", "router-1", "localhost"}, output
    assert all(counts[1] == 0 and counts[2] == 0 for counts in recap.values()), output
    assert "Gathering Facts" not in output and "Gather the facts" not in output
    assert not results.exists()


def test_a_good_benchmark_passes_the_check_then_contacts_the_hosts(runs):
    run, results = runs["good"]
    output = run.stdout + run.stderr
    flat = " ".join(output.split())
    assert "Benchmark through http://192.0.2.5:8000 (smollm2-135m-instruct), vllm bench serve on prefill-1" in flat
    assert "Scenarios (all fit max_model_len 512 of decode-1): ok." in flat
    assert "Prefix-cache check: two requests with the same 504-token system prompt." in flat
    # The run's directory was made on the controller; then the first host-level play reached for the hosts.
    (run_dir,) = results.iterdir()
    assert re.fullmatch(r"\d{8}-\d{6}", run_dir.name) and list(run_dir.iterdir()) == []
    assert _recap(output)["prefill-1"][2] == 1, output  # unreachable, as TEST-NET-1 is
