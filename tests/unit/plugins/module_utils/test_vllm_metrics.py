"""Unit tests for plugins/module_utils/vllm_metrics.py (pure parsing and comparison, no HTTP)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from ansible_collections.inferops.vllm.plugins.module_utils import vllm_metrics as vm

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
PREFILL_TEXT = (FIXTURES / "prefill_metrics.txt").read_text()
DECODE_TEXT = (FIXTURES / "decode_metrics.txt").read_text()
KEY = "sk-inferops-UNIT-7f3a9c1e5b"


@pytest.fixture()
def prefill():
    return vm.summarize_instance(PREFILL_TEXT)


@pytest.fixture()
def decode():
    return vm.summarize_instance(DECODE_TEXT)


# --------------------------------------------------------------------------- parsing the real fixtures


def test_parse_decode_fixture_samples():
    samples = vm.parse_metrics(DECODE_TEXT)
    src = "vllm:prompt_tokens_by_source_total"
    assert vm.sample_sum(samples, src, source="external_kv_transfer") == 21.0
    assert vm.sample_sum(samples, src, source="local_compute") == 21.0
    assert vm.sample_sum(samples, src, source="local_cache_hit") == 0.0
    assert vm.sample_sum(samples, "vllm:nixl_xfer_time_seconds_count") == 1.0
    assert vm.sample_sum(samples, "vllm:nixl_xfer_time_seconds_sum") == pytest.approx(0.024077)
    assert vm.sample_sum(samples, "vllm:nixl_bytes_transferred_sum") == 2949120.0
    assert vm.sample_sum(samples, "vllm:nixl_num_failed_transfers_total") == 0.0
    assert vm.sample_sum(samples, "vllm:prefix_cache_queries_total") == 42.0
    assert vm.sample_sum(samples, "vllm:time_to_first_token_seconds_count") == 2.0
    # Labels are kept as parsed, the sum only picks matching ones.
    assert vm.sample_sum(samples, src) == 42.0
    assert vm.sample_sum(samples, src, source="no_such_source") == 0.0


def test_parse_bytes_like_the_http_layer_delivers():
    samples = vm.parse_metrics(PREFILL_TEXT.encode())
    assert vm.sample_sum(samples, "vllm:prompt_tokens_by_source_total", source="local_compute") == 21.0


def test_summarize_decode_fixture(decode):
    assert decode["metrics"] == {
        "num_requests_running": 0,
        "num_requests_waiting": 0,
        "kv_cache_usage_perc": 0.0,
        "prefix_cache_hit_rate": 0.0,
        "prompt_tokens_local_compute": 21,
        "prompt_tokens_local_cache_hit": 0,
        "prompt_tokens_external_kv_transfer": 21,
        "nixl_transfers": 1,
        "nixl_failed_transfers": 0,
        "nixl_bytes_transferred": 2949120,
        "nixl_xfer_time_seconds": pytest.approx(0.024077),
    }
    assert decode["cache_config"] == {
        "block_size": 128,
        "cache_dtype": "auto",
        "kv_cache_size_tokens": 46592,
        "num_gpu_blocks": 364,
    }


def test_summarize_prefill_fixture(prefill):
    m = prefill["metrics"]
    assert m["prompt_tokens_local_compute"] == 21
    assert m["prompt_tokens_external_kv_transfer"] == 0
    assert m["nixl_transfers"] == 0
    assert m["nixl_bytes_transferred"] == 0
    assert m["nixl_failed_transfers"] == 0
    assert m["prefix_cache_hit_rate"] == 0.0
    assert prefill["cache_config"]["cache_dtype"] == "auto"
    assert prefill["cache_config"]["num_gpu_blocks"] == 364


def test_missing_nixl_metrics_count_as_zero():
    text = "\n".join(line for line in DECODE_TEXT.splitlines() if "nixl" not in line) + "\n"
    m = vm.summarize_instance(text)["metrics"]
    assert m["nixl_transfers"] == 0
    assert m["nixl_failed_transfers"] == 0
    assert m["nixl_bytes_transferred"] == 0
    assert m["nixl_xfer_time_seconds"] == 0.0
    assert m["prompt_tokens_external_kv_transfer"] == 21  # the rest is untouched


def test_minimal_page_has_zeros_and_nulls():
    text = 'vllm:cache_config_info{block_size="16",cache_dtype="fp8",engine="0",num_gpu_blocks="None"} 1.0\n'
    summary = vm.summarize_instance(text)
    m = summary["metrics"]
    assert m["prompt_tokens_external_kv_transfer"] == 0
    assert m["num_requests_running"] == 0
    assert m["kv_cache_usage_perc"] is None
    assert m["prefix_cache_hit_rate"] is None  # no queries yet: no rate, not 0/0
    assert summary["cache_config"] == {
        "block_size": 16,
        "cache_dtype": "fp8",
        "kv_cache_size_tokens": None,
        "num_gpu_blocks": None,
    }


def test_engines_are_summed_and_usage_is_the_largest():
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 3.0\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5\n'
        "# TYPE vllm:prefix_cache_queries_total counter\n"
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 30.0\n'
        'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 10.0\n'
        "# TYPE vllm:prefix_cache_hits_total counter\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 10.0\n'
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="1"} 1.0\n'
        'vllm:cache_config_info{block_size="16",cache_dtype="fp8",engine="0"} 1.0\n'
    )
    summary = vm.summarize_instance(text)
    assert summary["metrics"]["num_requests_running"] == 5
    assert summary["metrics"]["kv_cache_usage_perc"] == 0.5
    assert summary["metrics"]["prefix_cache_hit_rate"] == pytest.approx(0.25)
    assert summary["cache_config"]["block_size"] == 16  # engine 0 wins
    assert summary["cache_config"]["cache_dtype"] == "fp8"


@pytest.mark.parametrize(
    "text",
    [
        "garbage text here",
        "<html><body>502 Bad Gateway</body></html>",
        'vllm:num_requests_running{engine="0" 1.0',
        "{{{",
    ],
)
def test_garbage_is_a_clear_error(text):
    with pytest.raises(vm.MetricsError, match="not Prometheus text exposition format"):
        vm.summarize_instance(text)


def test_prometheus_text_without_vllm_metrics_is_an_error():
    text = "# TYPE process_open_fds gauge\nprocess_open_fds 31.0\n"
    with pytest.raises(vm.MetricsError, match="no vllm: metrics found"):
        vm.summarize_instance(text)
    with pytest.raises(vm.MetricsError, match="no vllm: metrics found"):
        vm.summarize_instance("")


def test_parse_error_message_is_short():
    with pytest.raises(vm.MetricsError) as err:
        vm.parse_metrics("<html>" + "x" * 5000)
    assert len(str(err.value)) < 300


# --------------------------------------------------------------------------- expected vs live


URL = "http://10.0.0.12:8200"


def test_expected_matching_config_has_no_problem(decode):
    expected = {"kv_cache_dtype": "auto", "block_size": 128, "kv_cache_size_tokens": 46592, "num_gpu_blocks": 364}
    assert vm.compare_expected("decode-0", URL, decode["cache_config"], expected) == []


def test_expected_nothing_checks_nothing(decode):
    assert vm.compare_expected("decode-0", URL, decode["cache_config"], {}) == []
    assert vm.compare_expected("decode-0", URL, decode["cache_config"], None) == []
    assert vm.compare_expected("decode-0", URL, decode["cache_config"], {"block_size": None}) == []


def test_fp8_asked_but_auto_live_is_a_failure(decode):
    problems = vm.compare_expected("decode-0", URL, decode["cache_config"], {"kv_cache_dtype": "fp8"})
    assert len(problems) == 1
    msg = problems[0]
    assert "decode-0" in msg and URL in msg
    assert "kv_cache_dtype=fp8" in msg and "cache_dtype=auto" in msg
    assert "not compressed" in msg


def test_dtype_is_compared_exactly(decode):
    live = dict(decode["cache_config"], cache_dtype="fp8_e4m3")
    assert vm.compare_expected("d", URL, live, {"kv_cache_dtype": "fp8"})
    assert vm.compare_expected("d", URL, live, {"kv_cache_dtype": "fp8_e4m3"}) == []


def test_block_size_mismatch(decode):
    problems = vm.compare_expected(
        "decode-0", URL, decode["cache_config"], {"block_size": 16, "kv_cache_dtype": "auto"}
    )
    assert problems == [f"instance decode-0 ({URL}): expected block_size=16 but live block_size=128"]


def test_every_mismatch_is_reported(decode):
    expected = {"kv_cache_dtype": "fp8", "block_size": 16, "kv_cache_size_tokens": 1, "num_gpu_blocks": 2}
    assert len(vm.compare_expected("decode-0", URL, decode["cache_config"], expected)) == 4


def test_expected_but_not_reported():
    live = vm.cache_config([])
    problems = vm.compare_expected("p", URL, live, {"num_gpu_blocks": 364})
    assert len(problems) == 1 and "does not report num_gpu_blocks" in problems[0]


@pytest.mark.parametrize(
    ("expected", "live", "ok"),
    [
        ("0.32.0", "0.32.0", True),
        ("0.32", "0.32.0", True),
        ("0.32", "0.32.1+cpu", True),
        ("0.32.0", "0.32.0+cpu", True),
        ("0.32.0", "0.32.1", False),
        ("0.3", "0.32.0", False),
        ("0.32.0", None, False),
        (None, "anything", True),
    ],
)
def test_version_matches(expected, live, ok):
    assert vm.version_matches(expected, live) is ok


# --------------------------------------------------------------------------- PD proof

ROLES = {"prefill-0": "prefill", "decode-0": "decode"}
PROMPT = 30  # prompt tokens per proof request


def _bump(metrics, **deltas):
    out = copy.deepcopy(metrics)
    for key, value in deltas.items():
        out[key] = out[key] + value
    return out


@pytest.fixture()
def before(prefill, decode):
    return {"prefill-0": prefill["metrics"], "decode-0": decode["metrics"]}


def handoff(before, requests=3, decode_local=0, failed=0):
    tokens = PROMPT * requests
    return {
        "prefill-0": _bump(before["prefill-0"], prompt_tokens_local_compute=tokens),
        "decode-0": _bump(
            before["decode-0"],
            prompt_tokens_external_kv_transfer=tokens - decode_local,
            prompt_tokens_local_compute=decode_local,
            nixl_transfers=requests,
            nixl_bytes_transferred=983040 * requests,
            nixl_xfer_time_seconds=0.02 * requests,
            nixl_failed_transfers=failed,
        ),
    }


def test_proof_handoff_ok(before):
    result = vm.evaluate_pd_proof(before, handoff(before), ROLES, 3, 3 * PROMPT)
    assert result["problems"] == []
    assert result["handoff_proven"] is True
    assert result["prefill_served"] == {"prefill-0": 90}
    assert result["decode_served"] == {"decode-0": 90}
    assert result["kv_tokens_transferred"] == 90
    assert result["decode_local_compute_tokens"] == 0
    assert result["nixl_transfers"] == 3
    assert result["nixl_bytes_transferred"] == 3 * 983040
    assert result["nixl_xfer_time_seconds"] == pytest.approx(0.06)
    assert result["nixl_failed_transfers"] == 0


def test_proof_accepts_one_recomputed_token_per_request(before):
    result = vm.evaluate_pd_proof(before, handoff(before, decode_local=3), ROLES, 3, 3 * PROMPT)
    assert result["handoff_proven"] is True, result["problems"]
    assert result["decode_local_compute_tokens"] == 3


def test_proof_without_prompt_token_count(before):
    assert vm.evaluate_pd_proof(before, handoff(before), ROLES, 3, None)["handoff_proven"] is True


def test_proof_served_without_handoff(before):
    # The router sent the requests straight to decode, which computed them itself.
    after = {
        "prefill-0": before["prefill-0"],
        "decode-0": _bump(before["decode-0"], prompt_tokens_local_compute=90),
    }
    result = vm.evaluate_pd_proof(before, after, ROLES, 3, 90)
    assert result["handoff_proven"] is False
    text = " | ".join(result["problems"])
    assert "no KV arrived by external_kv_transfer on decode (decode-0)" in text
    assert "recomputed on decode" in text
    assert "did not go through prefill" in text
    assert result["kv_tokens_transferred"] == 0
    assert result["decode_local_compute_tokens"] == 90


def test_proof_decode_recomputed_after_prefill(before):
    after = {
        "prefill-0": _bump(before["prefill-0"], prompt_tokens_local_compute=90),
        "decode-0": _bump(before["decode-0"], prompt_tokens_local_compute=90),
    }
    result = vm.evaluate_pd_proof(before, after, ROLES, 3, 90)
    assert result["handoff_proven"] is False
    assert any("computed 90 prompt tokens locally" in p for p in result["problems"])
    assert not any("did not go through prefill" in p for p in result["problems"])


def test_proof_partly_recomputed_is_a_failure(before):
    result = vm.evaluate_pd_proof(before, handoff(before, decode_local=30), ROLES, 3, 90)
    assert result["handoff_proven"] is False
    assert any("recomputed on decode" in p for p in result["problems"])


def test_proof_nixl_failure_grew(before):
    result = vm.evaluate_pd_proof(before, handoff(before, failed=1), ROLES, 3, 90)
    assert result["handoff_proven"] is False
    assert result["nixl_failed_transfers"] == 1
    assert any("NIXL failed transfers grew" in p and "decode-0 +1" in p for p in result["problems"])


def test_proof_kv_without_nixl_transfer_is_not_proven(before):
    after = handoff(before)
    after["decode-0"]["nixl_transfers"] = before["decode-0"]["nixl_transfers"]
    result = vm.evaluate_pd_proof(before, after, ROLES, 3, 90)
    assert result["handoff_proven"] is False
    assert any("NIXL recorded no transfer" in p for p in result["problems"])


def test_proof_no_requests(before):
    result = vm.evaluate_pd_proof(before, before, ROLES, 0, None)
    assert result["handoff_proven"] is False
    assert result["problems"] == [
        "no proof request was served through the router, so the prefill/decode handoff is unproven"
    ]


def test_proof_counter_going_down_means_restart(before):
    after = handoff(before)
    after["decode-0"]["prompt_tokens_local_compute"] = 0
    result = vm.evaluate_pd_proof(before, after, ROLES, 3, 90)
    assert any("decode-0" in p and "restarted" in p for p in result["problems"])


def test_proof_needs_both_roles(before):
    result = vm.evaluate_pd_proof({"d": before["decode-0"]}, {"d": before["decode-0"]}, {"d": "decode"}, 3, 90)
    assert "the PD proof needs at least one instance with role prefill" in result["problems"]


def test_proof_with_absent_nixl_counters_before(before):
    # Before the first transfer vLLM has not created the NIXL counters: summaries give 0, so the delta is whole.
    before = copy.deepcopy(before)
    before["decode-0"].update(nixl_transfers=0, nixl_bytes_transferred=0, nixl_xfer_time_seconds=0.0)
    after = handoff(before, requests=1)
    result = vm.evaluate_pd_proof(before, after, ROLES, 1, 30)
    assert result["handoff_proven"] is True
    assert result["nixl_transfers"] == 1


def test_proof_with_two_decode_instances(before):
    roles = dict(ROLES, **{"decode-1": "decode"})
    before = dict(before, **{"decode-1": copy.deepcopy(before["decode-0"])})
    after = handoff(before, requests=2)
    after["decode-1"] = _bump(before["decode-1"], prompt_tokens_external_kv_transfer=30, nixl_transfers=1)
    after["prefill-0"] = _bump(before["prefill-0"], prompt_tokens_local_compute=90)
    result = vm.evaluate_pd_proof(before, after, roles, 3, 90)
    assert result["handoff_proven"] is True, result["problems"]
    assert result["decode_served"] == {"decode-0": 60, "decode-1": 30}
    assert result["kv_tokens_transferred"] == 90


# --------------------------------------------------------------------------- router metrics


def test_summarize_router_and_deltas():
    text = (
        "# TYPE vllm_router_pd_prefill_requests_total counter\n"
        'vllm_router_pd_prefill_requests_total{worker="http://p:8100"} 4\n'
        "# TYPE vllm_router_pd_decode_requests_total counter\n"
        'vllm_router_pd_decode_requests_total{worker="http://d:8200"} 4\n'
        "# TYPE vllm_router_worker_health gauge\n"
        'vllm_router_worker_health{worker="http://p:8100"} 1\n'
        'vllm_router_worker_health{worker="http://d:8200"} 1\n'
    )
    before = vm.summarize_router(text)
    assert before == {
        "pd_prefill_requests": {"http://p:8100": 4},
        "pd_decode_requests": {"http://d:8200": 4},
        "worker_health": {"http://d:8200": 1, "http://p:8100": 1},
    }
    after = copy.deepcopy(before)
    after["pd_prefill_requests"]["http://p:8100"] = 7
    after["pd_decode_requests"]["http://d:8200"] = 7
    assert vm.router_deltas(before, after) == {"pd_prefill_requests": 3, "pd_decode_requests": 3}
    assert vm.router_deltas(None, after) is None


# --------------------------------------------------------------------------- secrets and excerpts


def test_redact_removes_the_key_and_any_bearer_token():
    text = f'{{"headers": {{"Authorization": "Bearer {KEY}", "X-Other": "Bearer other-token"}}}} {KEY}'
    out = vm.redact(text, [KEY])
    assert KEY not in out and "other-token" not in out
    assert out.count("********") == 3


def test_snippet_is_short_single_line_and_redacted_before_cut():
    body = ("a" * 195) + KEY + ("\n" + "b" * 500)
    out = vm.snippet(body.encode(), [KEY])
    assert len(out) <= vm.SNIPPET_LIMIT + 3 and out.endswith("...")
    assert "\n" not in out
    # Not even the first characters of the key survive the cut.
    assert KEY[:5] not in out


def test_redact_data_walks_nested_results():
    data = {"a": [f"x {KEY} y", {"b": KEY}], "n": 3, "none": None}
    out = vm.redact_data(data, [KEY])
    assert KEY not in repr(out)
    assert out["n"] == 3 and out["none"] is None
