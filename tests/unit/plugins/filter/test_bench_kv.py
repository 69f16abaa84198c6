"""inferops.vllm.bench_kv: the KV path of one benchmark scenario from every instance's /metrics read before and
after it (plugins/filter/bench.py). The text is built here in the shape vLLM 0.32 exports its NIXL histograms
(vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py: per engine, with model_name, buckets of 5 ms to 5 s
for the transfer time); the expected figures are computed from the observations each test makes up."""

from __future__ import annotations

import math

import pytest
from ansible_collections.inferops.vllm.plugins.filter.bench import FilterModule, bench_kv, histogram_quantile

pytest.importorskip("prometheus_client")

# vLLM 0.32's buckets (stats.py): the transfer time's drop the first (1 ms) one.
TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
BYTE_BUCKETS = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))
DECODE = {"host": "decode-1", "name": "vllm-0", "role": "decode", "url": "http://10.0.0.12:8200"}
PREFILL = {"host": "prefill-1", "name": "vllm-0", "role": "prefill", "url": "http://10.0.0.11:8100"}


def _histogram(name, bounds, observations, engine="0"):
    labels = f'engine="{engine}",model_name="m"'
    lines = [f"# HELP {name} Histogram.", f"# TYPE {name} histogram"]
    for bound in (*bounds, math.inf):
        le = "+Inf" if bound == math.inf else repr(bound)
        lines.append(f'{name}_bucket{{{labels},le="{le}"}} {float(sum(1 for o in observations if o <= bound))}')
    lines.append(f"{name}_count{{{labels}}} {float(len(observations))}")
    lines.append(f"{name}_sum{{{labels}}} {float(sum(observations))}")
    return lines


def metrics(times=(), sizes=(), failed=0, nixl=True):
    """A /metrics page: a few other vLLM metrics and, with ``nixl``, the NIXL ones for these transfers."""
    lines = ["# HELP vllm:num_requests_running Running.", "# TYPE vllm:num_requests_running gauge",
             'vllm:num_requests_running{engine="0",model_name="m"} 0.0']
    if nixl:
        lines += _histogram("vllm:nixl_xfer_time_seconds", TIME_BUCKETS, times)
        lines += _histogram("vllm:nixl_bytes_transferred", BYTE_BUCKETS, sizes)
        lines += ["# HELP vllm:nixl_num_failed_transfers Failed.", "# TYPE vllm:nixl_num_failed_transfers counter",
                  f'vllm:nixl_num_failed_transfers_total{{engine="0",model_name="m"}} {float(failed)}']
    return "\n".join(lines) + "\n"


def read(item, text, status=200, msg=""):
    """One item of the role's uri loop, as registered (only the keys bench_kv reads)."""
    return {"item": item, "status": status, "content": text, "msg": msg}


def test_transfers_quantiles_bytes_and_rates_from_the_difference():
    # Before the scenario: transfers of earlier scenarios, which must not count.
    old_times, old_sizes = [0.004, 0.3, 0.9], [3_000_000] * 3
    new_times = [0.002, 0.006, 0.007, 0.008, 0.02, 0.06, 0.07, 0.09, 0.15, 0.4]
    new_sizes = [2_949_120] * len(new_times)
    before = [read(DECODE, metrics(old_times, old_sizes)), read(PREFILL, metrics())]
    after = [read(DECODE, metrics(old_times + new_times, old_sizes + new_sizes, failed=0)), read(PREFILL, metrics())]
    kv = bench_kv(before, after, {"scenario": "short", "input_tokens": 1280})
    assert kv["problems"] == [] and kv["complete"] and kv["kv_moved"]
    assert kv["transfers"] == len(new_times) and kv["failed_transfers"] == 0
    assert kv["bytes"] == sum(new_sizes)
    assert kv["xfer_seconds"] == pytest.approx(sum(new_times))
    assert kv["mb_per_s"] == pytest.approx(sum(new_sizes) / 1e6 / sum(new_times), rel=1e-3)
    assert kv["bytes_per_prompt_token"] == pytest.approx(sum(new_sizes) / 1280, abs=0.1)
    # p50: rank 5 of 10; the bucket (0.01, 0.025] holds the 5th (cumulative 4 before it, 5 at its end).
    assert kv["xfer_p50_ms"] == pytest.approx(25.0)
    # p99: rank 9.9, in (0.3, 0.5] (9 before, 10 at its end): 0.3 + 0.2 x 0.9.
    assert kv["xfer_p99_ms"] == pytest.approx(480.0)
    by_instance = {i["instance"]: (i["status"], i["transfers"]) for i in kv["instances"]}
    assert by_instance == {"decode-1 vllm-0": ("ok", len(new_times)), "prefill-1 vllm-0": ("ok", 0)}


def test_quantiles_interpolate_within_the_bucket_like_prometheus():
    cumulative = {0.1: 0.0, 0.2: 4.0, 0.4: 8.0, math.inf: 8.0}
    assert histogram_quantile(0.5, cumulative) == pytest.approx(0.2)  # rank 4: the end of (0.1, 0.2]
    assert histogram_quantile(0.75, cumulative) == pytest.approx(0.3)  # rank 6: half way through (0.2, 0.4]
    assert histogram_quantile(0.25, {0.1: 4.0, math.inf: 4.0}) == pytest.approx(0.025)  # the first bucket starts at 0
    # In the +Inf bucket: the highest finite bound, as Prometheus answers.
    assert histogram_quantile(0.99, {1.0: 1.0, 5.0: 1.0, math.inf: 4.0}) == 5.0
    assert histogram_quantile(0.5, {1.0: 0.0, math.inf: 0.0}) is None
    assert histogram_quantile(0.5, {}) is None


def test_a_pd_scenario_without_transfers_says_so_loudly():
    page = metrics([0.01, 0.02], [1_000_000] * 2)
    kv = bench_kv([read(DECODE, page)], [read(DECODE, page)], {"scenario": "short", "input_tokens": 100})
    assert kv["transfers"] == 0 and kv["kv_moved"] is False
    assert (kv["xfer_p50_ms"], kv["mb_per_s"], kv["bytes_per_prompt_token"]) == (None, None, None)
    (line,) = kv["problems"]
    assert line.startswith("short: NO KV MOVED: vllm:nixl_xfer_time_seconds_count did not grow on any instance")


def test_a_histogram_created_during_the_scenario_counted_nothing_before():
    kv = bench_kv([read(DECODE, metrics(nixl=False))], [read(DECODE, metrics([0.01], [4096]))],
                  {"scenario": "s", "input_tokens": 8})
    assert kv["problems"] == [] and (kv["transfers"], kv["bytes"], kv["bytes_per_prompt_token"]) == (1, 4096, 512.0)


def test_a_counter_that_went_down_means_the_instance_restarted():
    before = [read(DECODE, metrics([0.01] * 5, [1000] * 5)), read(PREFILL, metrics([0.02] * 2, [500] * 2))]
    after = [read(DECODE, metrics([0.01], [1000])), read(PREFILL, metrics([0.02] * 4, [500] * 4))]
    kv = bench_kv(before, after, {"scenario": "short", "input_tokens": 10})
    (line,) = kv["problems"]
    assert line.startswith("short: decode-1 vllm-0 (http://10.0.0.12:8200): vllm:nixl_xfer_time_seconds_count went "
                           "down from 5 to 1 during the scenario: the instance restarted")
    # The other instance still counts, but the figures are marked incomplete.
    assert kv["complete"] is False and (kv["transfers"], kv["bytes"]) == (2, 1000)
    assert [i["status"] for i in kv["instances"]] == ["restarted", "ok"]


def test_failed_transfers_are_reported():
    kv = bench_kv([read(DECODE, metrics([0.01], [10], failed=1))], [read(DECODE, metrics([0.01] * 2, [10] * 2, 3))],
                  {"scenario": "s", "input_tokens": 4})
    assert kv["failed_transfers"] == 2
    assert kv["problems"] == ["s: 2 NIXL transfer(s) failed (vllm:nixl_num_failed_transfers_total grew)."]


def test_missing_nixl_metrics_are_named():
    page = metrics(nixl=False)
    kv = bench_kv([read(DECODE, page), read(PREFILL, page)], [read(DECODE, page), read(PREFILL, page)],
                  {"scenario": "s", "input_tokens": 4})
    (line,) = kv["problems"]
    assert line.startswith("s: vllm:nixl_xfer_time_seconds and vllm:nixl_bytes_transferred are missing from the "
                           "/metrics of every instance read (decode-1 vllm-0, prefill-1 vllm-0)")
    assert kv["transfers"] is None and kv["kv_moved"] is None and kv["complete"] is False


def test_an_unreadable_metrics_page_is_named_with_its_status():
    kv = bench_kv([read(DECODE, "", status=401, msg="HTTP Error 401: Unauthorized"), read(PREFILL, metrics())],
                  [read(DECODE, metrics([0.01], [10])), read(PREFILL, metrics())], {"scenario": "s"})
    assert kv["problems"][0] == ("s: could not read /metrics of decode-1 vllm-0 (http://10.0.0.12:8200) before the "
                                 "scenario (HTTP 401: HTTP Error 401: Unauthorized): its transfers are not counted.")
    assert kv["complete"] is False
    garbage = bench_kv([read(DECODE, metrics())], [read(DECODE, "{not prometheus")], {"scenario": "s"})
    assert "could not read /metrics of decode-1 vllm-0 (http://10.0.0.12:8200) after the scenario (not Prometheus" \
        in garbage["problems"][0]


def test_registered():
    assert FilterModule().filters()["bench_kv"] is bench_kv
