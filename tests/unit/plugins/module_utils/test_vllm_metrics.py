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
R = vm.RECOMPUTED_PROMPT_TOKENS


def _bump(metrics, **deltas):
    out = copy.deepcopy(metrics)
    for key, value in deltas.items():
        out[key] = out[key] + value
    return out


@pytest.fixture()
def before(prefill, decode):
    return {"prefill-0": prefill["metrics"], "decode-0": decode["metrics"]}


def serve(
    before,
    prompt=PROMPT,
    external=None,
    local=None,
    cache_hit=0,
    prefilled=None,
    transfers=1,
    failed=0,
    decode="decode-0",
    prefill="prefill-0",
):
    """The metrics after one request of ``prompt`` tokens; by default a full handoff (decode recomputes R)."""
    external = prompt - R if external is None else external
    local = prompt - external - cache_hit if local is None else local
    after = copy.deepcopy(before)
    after[prefill] = _bump(before[prefill], prompt_tokens_local_compute=prompt if prefilled is None else prefilled)
    after[decode] = _bump(
        before[decode],
        prompt_tokens_external_kv_transfer=external,
        prompt_tokens_local_compute=local,
        prompt_tokens_local_cache_hit=cache_hit,
        nixl_transfers=transfers,
        nixl_bytes_transferred=983040 * transfers,
        nixl_xfer_time_seconds=0.02 * transfers,
        nixl_failed_transfers=failed,
    )
    return after


def run_proof(before, requests, roles=None, usage=True):
    """Evaluate ``requests`` (keyword arguments of :func:`serve`) one after the other, as the module does."""
    roles = roles or ROLES
    evaluations = []
    for number, kwargs in enumerate(requests, start=1):
        after = serve(before, **kwargs)
        prompt = kwargs.get("prompt", PROMPT) if usage else None
        evaluations.append(vm.evaluate_proof_request(before, after, roles, prompt, number, len(requests)))
        before = after
    return vm.evaluate_pd_proof(evaluations, roles)


def test_request_full_handoff(before):
    result = vm.evaluate_proof_request(before, serve(before), ROLES, PROMPT, 1, 3)
    assert result["problems"] == []
    assert result["handoff_proven"] is True
    assert result["request"] == 1
    assert result["prompt_tokens"] == PROMPT
    assert result["kv_tokens_expected"] == PROMPT - R
    assert result["kv_tokens_transferred"] == PROMPT - R
    assert result["decode_local_compute_tokens"] == R
    assert result["prefill_served"] == {"prefill-0": PROMPT}
    assert result["decode_served"] == {"decode-0": PROMPT - R}
    assert result["nixl_transfers"] == 1
    assert result["nixl_failed_transfers"] == 0
    assert result["nixl_bytes_transferred"] == 983040
    assert result["nixl_xfer_time_seconds"] == pytest.approx(0.02)


def test_request_whole_prompt_received(before):
    result = vm.evaluate_proof_request(before, serve(before, external=PROMPT), ROLES, PROMPT)
    assert result["handoff_proven"] is True, result["problems"]
    assert result["decode_local_compute_tokens"] == 0


def test_request_partial_handoff_recomputed_on_decode(before):
    result = vm.evaluate_proof_request(before, serve(before, external=10), ROLES, PROMPT, 2, 3)
    assert result["handoff_proven"] is False
    assert result["kv_tokens_transferred"] == 10
    assert result["decode_local_compute_tokens"] == PROMPT - 10
    assert result["problems"] == [
        f"request 2 of 3 ({PROMPT} prompt tokens): decode (decode-0) received 10 of {PROMPT - R} expected prompt "
        f"tokens by NIXL (external_kv_transfer), computed {PROMPT - 10} itself: only part of the prompt's KV was "
        f"handed over; the prompt was recomputed on decode instead of received from prefill "
        f"(at most {R} local token per request is expected)"
    ]


def test_request_partial_handoff_rest_from_decode_cache(before):
    # Decode computed only the last token but took the rest from its own prefix cache, not from prefill.
    after = serve(before, external=10, local=R, cache_hit=PROMPT - 10 - R)
    result = vm.evaluate_proof_request(before, after, ROLES, PROMPT, 1, 1)
    assert result["handoff_proven"] is False
    assert len(result["problems"]) == 1
    assert f"received 10 of {PROMPT - R} expected" in result["problems"][0]
    assert f"found {PROMPT - 10 - R} in its own prefix cache" in result["problems"][0]
    assert "only part of the prompt's KV was handed over" in result["problems"][0]


def test_request_one_token_short_is_a_failure(before):
    after = serve(before, external=PROMPT - R - 1, local=R, cache_hit=1)
    assert vm.evaluate_proof_request(before, after, ROLES, PROMPT)["handoff_proven"] is False


def test_request_two_recomputed_tokens_are_a_failure(before):
    after = serve(before, external=PROMPT - R, local=R + 1)
    result = vm.evaluate_proof_request(before, after, ROLES, PROMPT)
    assert result["handoff_proven"] is False
    assert any("recomputed on decode" in p for p in result["problems"])


def test_request_served_without_handoff(before):
    # The router sent the request straight to decode, which computed it itself.
    after = serve(before, external=0, prefilled=0, transfers=0)
    result = vm.evaluate_proof_request(before, after, ROLES, PROMPT, 3, 3)
    assert result["handoff_proven"] is False
    text = " | ".join(result["problems"])
    assert f"request 3 of 3 ({PROMPT} prompt tokens): decode (decode-0) received 0 of {PROMPT - R}" in text
    assert "no KV arrived by external_kv_transfer on decode (decode-0)" in text
    assert "recomputed on decode" in text
    assert "request 3 of 3" in text and "did not go through prefill" in text
    assert "request 3 of 3: NIXL recorded no transfer" in text
    assert result["kv_tokens_transferred"] == 0
    assert result["decode_local_compute_tokens"] == PROMPT


def test_request_decode_recomputed_after_prefill(before):
    after = serve(before, external=0, transfers=0)
    result = vm.evaluate_proof_request(before, after, ROLES, PROMPT)
    assert result["handoff_proven"] is False
    assert any(f"computed {PROMPT} itself" in p for p in result["problems"])
    assert not any("did not go through prefill" in p for p in result["problems"])


def test_request_without_nixl_transfer_is_not_proven(before):
    result = vm.evaluate_proof_request(before, serve(before, transfers=0), ROLES, PROMPT, 1, 2)
    assert result["handoff_proven"] is False
    assert result["problems"] == [
        "request 1 of 2: NIXL recorded no transfer (vllm:nixl_xfer_time_seconds_count did not grow on prefill-0, "
        f"decode-0) although decode received {PROMPT - R} prompt tokens by external_kv_transfer"
    ]


def test_request_nixl_failure_grew(before):
    result = vm.evaluate_proof_request(before, serve(before, failed=1), ROLES, PROMPT)
    assert result["handoff_proven"] is False
    assert result["nixl_failed_transfers"] == 1
    assert result["nixl_failed_by_instance"] == {"decode-0": 1}
    assert result["problems"] == ["request 1 of 1: NIXL failed transfers grew (decode-0 +1)"]


def test_the_proof_says_once_how_to_heal_failed_transfers(before):
    """Every request on a broken path fails its transfer: the per-request problems say so, and the proof adds once
    what to do (the path stays broken for those instances until they restart), naming each failing instance once."""
    requests = [vm.evaluate_proof_request(before, serve(before, failed=1), ROLES, PROMPT, n, 3) for n in (1, 2, 3)]
    proof = vm.evaluate_pd_proof(requests, ROLES)
    assert proof["handoff_proven"] is False
    hints = [p for p in proof["problems"] if "rolling_restart.yml" in p]
    assert len(hints) == 1, proof["problems"]
    assert """rolling_restart.yml -e '{"vllm_rollout_instances": ["decode-0"]}'""" in hints[0], hints[0]
    assert proof["problems"][-1] == hints[0]
    assert sum("NIXL failed transfers grew (decode-0 +1)" in p for p in proof["problems"]) == 3
    # A proof without failures has no hint.
    clean = vm.evaluate_pd_proof([vm.evaluate_proof_request(before, serve(before), ROLES, PROMPT)], ROLES)
    assert clean["problems"] == [] and clean["per_request"][0]["nixl_failed_by_instance"] == {}


def test_request_not_prefilled(before):
    result = vm.evaluate_proof_request(before, serve(before, prefilled=3), ROLES, PROMPT)
    assert result["handoff_proven"] is False
    assert any(
        "prefill (prefill-0) computed 3 prompt tokens" in p and "did not go through prefill" in p
        for p in result["problems"]
    )


def test_request_counter_going_down_means_restart(before):
    after = serve(before)
    after["decode-0"]["prompt_tokens_local_compute"] = 0
    result = vm.evaluate_proof_request(before, after, ROLES, PROMPT, 2, 3)
    assert result["handoff_proven"] is False
    assert any(p.startswith("request 2 of 3: instance decode-0") and "restarted" in p for p in result["problems"])


def test_request_without_usage_uses_the_instances_counts(before):
    assert vm.evaluate_proof_request(before, serve(before), ROLES, None)["handoff_proven"] is True
    # Without usage a partial handoff still fails: the prompt is as long as the instances counted it.
    after = serve(before, external=10, local=R, cache_hit=PROMPT - 10 - R)
    result = vm.evaluate_proof_request(before, after, ROLES, None)
    assert result["handoff_proven"] is False
    assert result["prompt_tokens"] is None
    assert result["kv_tokens_expected"] == PROMPT - R
    assert "the response reported no usage" in result["problems"][0]
    # Decode counted nothing at all: prefill's count stands in.
    after = serve(before, external=0, local=0, transfers=0)
    result = vm.evaluate_proof_request(before, after, ROLES, None)
    assert result["handoff_proven"] is False
    assert result["kv_tokens_expected"] == PROMPT - R


def test_request_with_absent_nixl_counters_before(before):
    # Before the first transfer vLLM has not created the NIXL counters: summaries give 0, so the delta is whole.
    before = copy.deepcopy(before)
    before["decode-0"].update(nixl_transfers=0, nixl_bytes_transferred=0, nixl_xfer_time_seconds=0.0)
    result = vm.evaluate_proof_request(before, serve(before), ROLES, PROMPT)
    assert result["handoff_proven"] is True
    assert result["nixl_transfers"] == 1


def test_request_on_the_second_decode_instance(before):
    roles = dict(ROLES, **{"decode-1": "decode"})
    before = dict(before, **{"decode-1": copy.deepcopy(before["decode-0"])})
    result = vm.evaluate_proof_request(before, serve(before, decode="decode-1"), roles, PROMPT)
    assert result["handoff_proven"] is True, result["problems"]
    assert result["decode_served"] == {"decode-0": 0, "decode-1": PROMPT - R}
    # Partial on decode-1: the message names the instance that served it.
    result = vm.evaluate_proof_request(before, serve(before, decode="decode-1", external=5), roles, PROMPT)
    assert result["handoff_proven"] is False
    assert "decode (decode-1) received 5 of" in result["problems"][0]


def test_request_split_over_two_decode_instances_is_summed(before):
    # The deltas of a request are summed over the decode instances (for example with several engines behind one).
    roles = dict(ROLES, **{"decode-1": "decode"})
    before = dict(before, **{"decode-1": copy.deepcopy(before["decode-0"])})
    after = serve(before, external=10, local=0, transfers=1)
    after["decode-1"] = _bump(
        before["decode-1"], prompt_tokens_external_kv_transfer=PROMPT - R - 10, prompt_tokens_local_compute=R
    )
    result = vm.evaluate_proof_request(before, after, roles, PROMPT)
    assert result["handoff_proven"] is True, result["problems"]
    assert result["kv_tokens_transferred"] == PROMPT - R


def test_proof_every_request_handed_over(before):
    result = run_proof(before, [{}, {}, {"external": PROMPT}])
    assert result["problems"] == []
    assert result["handoff_proven"] is True
    assert result["requests"] == 3
    assert result["prompt_tokens"] == 3 * PROMPT
    assert result["prefill_served"] == {"prefill-0": 3 * PROMPT}
    assert result["decode_served"] == {"decode-0": 3 * PROMPT - 2 * R}
    assert result["kv_tokens_transferred"] == 3 * PROMPT - 2 * R
    assert result["decode_local_compute_tokens"] == 2 * R
    assert result["nixl_transfers"] == 3
    assert result["nixl_bytes_transferred"] == 3 * 983040
    assert result["nixl_xfer_time_seconds"] == pytest.approx(0.06)
    assert result["nixl_failed_transfers"] == 0
    assert [item["request"] for item in result["per_request"]] == [1, 2, 3]
    assert all(item["handoff_proven"] for item in result["per_request"])
    assert all("problems" not in item for item in result["per_request"])


def test_proof_one_request_handed_over_for_three_is_a_failure(before):
    # The case: decode received 29 of 87 prompt tokens with 1 NIXL transfer for 3 requests; the other two
    # prompts were computed by prefill but decode took them from elsewhere (here its own cache) with no transfer.
    prompt = 29
    untransferred = {"prompt": prompt, "external": 0, "local": R, "cache_hit": prompt - R, "transfers": 0}
    result = run_proof(before, [{"prompt": prompt, "external": prompt, "local": 0}, untransferred, untransferred])
    assert result["prompt_tokens"] == 87 and result["kv_tokens_transferred"] == 29 and result["nixl_transfers"] == 1
    assert result["decode_local_compute_tokens"] <= result["requests"]  # the totals alone looked fine
    assert result["handoff_proven"] is False
    assert [item["handoff_proven"] for item in result["per_request"]] == [True, False, False]
    text = " | ".join(result["problems"])
    assert "request 1 of 3" not in text
    for number in (2, 3):
        assert (
            f"request {number} of 3 ({prompt} prompt tokens): decode (decode-0) received 0 of {prompt - R} expected "
            f"prompt tokens by NIXL (external_kv_transfer), computed {R} itself, found {prompt - R} in its own "
            "prefix cache: no KV arrived by external_kv_transfer on decode (decode-0)"
        ) in text
        assert f"request {number} of 3: NIXL recorded no transfer" in text


def test_proof_partial_handoffs_with_one_transfer_are_a_failure(before):
    # 29 of 87 prompt tokens by NIXL spread over the 3 requests, 1 transfer in all, the rest computed on decode.
    prompt = 29
    requests = [
        {"prompt": prompt, "external": 10, "transfers": 1},
        {"prompt": prompt, "external": 10, "transfers": 0},
        {"prompt": prompt, "external": 9, "transfers": 0},
    ]
    result = run_proof(before, requests)
    assert result["kv_tokens_transferred"] == 29 and result["nixl_transfers"] == 1
    assert result["handoff_proven"] is False
    assert all(item["handoff_proven"] is False for item in result["per_request"])
    assert (
        f"request 1 of 3 ({prompt} prompt tokens): decode (decode-0) received 10 of {prompt - R} expected prompt "
        f"tokens by NIXL (external_kv_transfer), computed {prompt - 10} itself"
    ) in result["problems"][0]


def test_proof_mixed_two_handed_over_one_computed_on_decode(before):
    result = run_proof(before, [{}, {"external": 0, "transfers": 0}, {}])
    assert result["handoff_proven"] is False
    assert [item["handoff_proven"] for item in result["per_request"]] == [True, False, True]
    assert result["nixl_transfers"] == 2
    assert all(p.startswith("request 2 of 3") for p in result["problems"]), result["problems"]
    assert any("recomputed on decode" in p for p in result["problems"])


def test_proof_zero_transfers(before):
    result = run_proof(before, [{"transfers": 0}] * 3)
    assert result["handoff_proven"] is False
    assert result["nixl_transfers"] == 0
    assert result["kv_tokens_transferred"] == 3 * (PROMPT - R)
    for number in (1, 2, 3):
        assert any(p.startswith(f"request {number} of 3: NIXL recorded no transfer") for p in result["problems"])


def test_proof_one_transfer_missing(before):
    result = run_proof(before, [{}, {"transfers": 0}, {}])
    assert result["handoff_proven"] is False
    assert [p.split(":")[0] for p in result["problems"]] == ["request 2 of 3"]


def test_proof_without_usage(before):
    result = run_proof(before, [{}, {}, {}], usage=False)
    assert result["handoff_proven"] is True, result["problems"]
    assert result["prompt_tokens"] is None


def test_proof_no_requests():
    result = vm.evaluate_pd_proof([], ROLES)
    assert result["handoff_proven"] is False
    assert result["problems"] == [
        "no proof request was served through the router, so the prefill/decode handoff is unproven"
    ]
    assert result["requests"] == 0 and result["prompt_tokens"] is None and result["per_request"] == []
    assert result["prefill_served"] == {"prefill-0": 0} and result["kv_tokens_transferred"] == 0


def test_proof_needs_both_roles(before):
    roles = {"d": "decode"}
    before = {"d": before["decode-0"]}
    evaluation = vm.evaluate_proof_request(before, before, roles, PROMPT)
    result = vm.evaluate_pd_proof([evaluation], roles)
    assert result["problems"] == ["the PD proof needs at least one instance with role prefill"]
    assert result["handoff_proven"] is False


def test_proof_requests_on_two_decode_instances(before):
    roles = dict(ROLES, **{"decode-1": "decode"})
    before = dict(before, **{"decode-1": copy.deepcopy(before["decode-0"])})
    result = run_proof(before, [{}, {"decode": "decode-1"}, {}], roles=roles)
    assert result["handoff_proven"] is True, result["problems"]
    assert result["decode_served"] == {"decode-0": 2 * (PROMPT - R), "decode-1": PROMPT - R}
    assert result["per_request"][1]["decode_served"] == {"decode-0": 0, "decode-1": PROMPT - R}
    assert result["kv_tokens_transferred"] == 3 * (PROMPT - R)
    # The request on decode-1 partial: only it fails.
    result = run_proof(before, [{}, {"decode": "decode-1", "external": 3}, {}], roles=roles)
    assert [item["handoff_proven"] for item in result["per_request"]] == [True, False, True]
    assert "request 2 of 3" in result["problems"][0] and "decode (decode-1) received 3 of" in result["problems"][0]


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


# --------------------------------------------------------------------------- the KV throughput


def test_kv_throughput_is_bytes_over_nixl_time():
    judged = vm.judge_kv_throughput(8847360, 0.071, "tcp", 1)
    assert judged == {"kv_transport": "tcp", "nixl_throughput_mib_s": 118.838, "throughput_bound_mib_s": 1.0,
                      "throughput_ok": True, "slow_requests": [], "problems": []}


def test_kv_throughput_below_the_rdma_bound_says_tcp_fallback():
    # The field reports: 1.8 s per transfer instead of 3 ms. 3 MiB in 1.8 s is 1.7 MiB/s.
    judged = vm.judge_kv_throughput(3 * 1048576, 1.8, "rdma", 1024)
    assert judged["throughput_ok"] is False and judged["nixl_throughput_mib_s"] == 1.667
    (problem,) = judged["problems"]
    assert problem.startswith("NIXL moved the proof's KV at 1.667 MiB/s (3145728 bytes in 1800.0 ms of transfers), "
                              "below the 1024 MiB/s expected over rdma: that is the speed of TCP")


def test_kv_throughput_is_not_judged_without_a_bound_or_without_transfers():
    assert vm.judge_kv_throughput(983040, 0.02)["throughput_ok"] is None
    nothing = vm.judge_kv_throughput(0, 0.0, "tcp", 1)
    assert nothing["nixl_throughput_mib_s"] is None and nothing["throughput_ok"] is None and not nothing["problems"]
    slow = vm.judge_kv_throughput(1048576, 2.0, "tcp", 1)
    assert slow["throughput_ok"] is False and "expected over tcp (a crowded CPU" in slow["problems"][0]


def test_each_proof_request_is_judged_on_its_own_and_the_slow_one_named():
    """Issue #24: after a prefill restart a decode's transfers took 20-36 s each while the others took ~30 ms; the
    proof said PROVEN. One crawling request fails the proof by name, even when the total passes."""
    fast = {"request": 1, "nixl_bytes_transferred": 983040, "nixl_xfer_time_seconds": 0.02}
    crawled = {"request": 2, "nixl_bytes_transferred": 983040, "nixl_xfer_time_seconds": 20.5123}
    judged = vm.judge_kv_throughput(983040 * 2, 20.5323, "tcp", 0.09, [fast, crawled])
    assert judged["nixl_throughput_mib_s"] >= 0.09  # the total alone would pass
    assert judged["throughput_ok"] is False and judged["slow_requests"] == [2]
    assert judged["problems"] == ["NIXL moved these proof requests' KV below the 0.09 MiB/s expected: request 2 at "
                                  "0.0457 MiB/s (983040 bytes in 20512.3 ms)"]
    both = vm.judge_kv_throughput(983040 * 2, 0.04, "tcp", 10, [fast, {**fast, "request": 2}])
    assert both["throughput_ok"] is True and both["slow_requests"] == [] and both["problems"] == []
    # A request without transfers (none counted) is not judged; without a bound nothing is.
    assert vm.judge_kv_throughput(983040, 0.02, "tcp", 10, [fast, {"request": 2}])["slow_requests"] == []
    assert vm.judge_kv_throughput(983040, 20.0, "tcp", 0, [crawled])["slow_requests"] == []
