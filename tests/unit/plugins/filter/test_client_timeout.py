"""The clients' timeout (inferops.vllm.client_timeout) is the preflight's client rule itself, and
inferops.vllm.instance_limits gives what a request must fit (plugins/plugin_utils/_preflight.py)."""

from __future__ import annotations

import math

import pytest
from ansible_collections.inferops.vllm.plugins.plugin_utils import _preflight as pf
from ansible_collections.inferops.vllm.plugins.plugin_utils._preflight import (
    client_timeout,
    instance_limits,
    pd_preflight,
)
from ansible_collections.inferops.vllm.tests.unit.plugins.filter.test_preflight import instance, inventory

QWEN = {"num_attention_heads": 40, "num_key_value_heads": 8, "num_hidden_layers": 48, "hidden_size": 5120,
        "torch_dtype": "bfloat16", "max_position_embeddings": 131072}


def longest(decode_len: int = 512, prefill_len: int = 512):
    return inventory(prefill={"p1": instance("prefill", address="10.0.0.11", max_model_len=prefill_len)},
                     decode={"d1": instance("decode", address="10.0.0.21", max_model_len=decode_len)})


@pytest.mark.parametrize(("length", "rate"), [(512, 20), (131072, 20), (8192, 7.5), (1, 20), (4000, 20)])
def test_the_timeout_is_the_rule_the_preflight_checks(length, rate):
    published, groups = longest(length, length)
    options = {"min_tokens_per_second": rate}
    out = client_timeout(published, groups, options)
    assert out["problems"] == []
    assert out["seconds"] == out["rule_seconds"] == pf.request_seconds(length, rate) == math.ceil(length / rate)
    assert out["source"] == "max_model_len / inferops_min_tokens_per_second"
    # The same rule as the preflight's client check: it accepts exactly this timeout and refuses a second less.
    assert [p for p in pd_preflight(published, groups, {**options, "client_timeout_seconds": out["seconds"]})
            if p.startswith("[client]")] == []
    if out["seconds"] > 1:
        refused = pd_preflight(published, groups, {**options, "client_timeout_seconds": out["seconds"] - 1})
        assert any(p.startswith("[client]") for p in refused), refused


def test_the_longest_max_model_len_of_all_instances_counts():
    out = client_timeout(*longest(decode_len=131072, prefill_len=4096))
    assert (out["max_model_len"], out["instance"], out["seconds"]) == (131072, "d1", 6554)


def test_a_configured_timeout_is_used_when_the_preflight_accepts_it():
    out = client_timeout(*longest(), {"client_timeout_seconds": 300})
    assert (out["seconds"], out["source"], out["rule_seconds"]) == (300, "inferops_client_timeout_seconds", 26)


def test_a_configured_timeout_below_the_rule_is_the_preflights_own_problem():
    published, groups = longest(decode_len=131072)
    out = client_timeout(published, groups, {"client_timeout_seconds": 120})
    assert out["seconds"] is None
    found = pd_preflight(published, groups, {"client_timeout_seconds": 120})
    client_lines = [p for p in found if p.startswith("[client]")]
    assert out["problems"] == client_lines and "is 120 s, but one request of max_model_len 131072" in client_lines[0]


def test_an_unknown_max_model_len_is_refused_with_the_fix():
    facts = {k: v for k, v in QWEN.items() if k != "max_position_embeddings"}
    published, groups = inventory(
        prefill={"p1": instance("prefill", address="10.0.0.11", max_model_len=0, facts=facts)},
        decode={"d1": instance("decode", address="10.0.0.21", max_model_len=0, facts=facts)})
    out = client_timeout(published, groups)
    assert out["seconds"] is None and len(out["problems"]) == 1
    assert out["problems"][0].startswith("[client] p1, d1: vllm_instance_max_model_len: is 0 (the model's own)")
    # The model's own length counts when it is known.
    published, groups = inventory(
        prefill={"p1": instance("prefill", address="10.0.0.11", max_model_len=0, facts=QWEN)},
        decode={"d1": instance("decode", address="10.0.0.21", max_model_len=0, facts=QWEN)})
    assert client_timeout(published, groups)["seconds"] == 6554


def test_a_bad_rate_and_no_instance_are_problems():
    out = client_timeout(*longest(), {"min_tokens_per_second": 0})
    assert out["seconds"] is None and "inferops_min_tokens_per_second: is 0" in out["problems"][0]
    out = client_timeout({}, {"prefill": [], "decode": [], "router": []})
    assert out["seconds"] is None and "no prefill or decode instance" in out["problems"][0]


def test_instance_limits():
    published, groups = inventory(
        prefill={"p1": instance("prefill", address="10.0.0.11", max_model_len=1024, kv_cache_dtype="fp8")},
        decode={"d1": instance("decode", address="10.0.0.21", max_model_len=512)})
    limits = instance_limits(published, groups)
    assert [(x["label"], x["group"], x["max_model_len"], x["kv_cache_dtype"], x["served_model_name"], x["port"])
            for x in limits] == [("p1", "prefill", 1024, "fp8", "m", 8100), ("d1", "decode", 512, "auto", "m", 8200)]
