"""The KV sizing calculator used by the preflight (plugins/module_utils/_kv_sizing.py) against vLLM's own
figure (`vllm:cache_config_info{kv_cache_size_tokens}`) on the live server, for 16-bit and fp8 KV.

The deployed pair runs 16-bit ("auto") KV. For fp8, a third, plain vLLM instance is started on the
decode host with the same budget and `quant_dtype = "fp8"`, through the role's unit template, and
stopped afterwards; the deployed pair is not touched, so the tests run in any order.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import urllib.request

import pytest
from conftest import container_ip, deploy_playbook, instance_auth, journal_tail, metric_samples, molecule_only
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, os.environ["ANSIBLE_COLLECTIONS_PATH"].split(":")[0])
from ansible_collections.inferops.vllm.plugins.module_utils._kv_sizing import kv_blocks, kv_bytes_per_token  # noqa: E402

BUDGET = 1073741824  # vllm_instance_kv_cache_memory_bytes of the sandbox
BLOCK = 128  # vLLM's default block size on the CPU


def model_config() -> dict:
    with open(os.path.join(os.environ["INFEROPS_MODEL_DIR"], "config.json")) as f:
        return json.load(f)


def predicted_tokens(dtype_bytes: int) -> int:
    c = model_config()
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    bpt = kv_bytes_per_token(c["num_hidden_layers"], c["num_key_value_heads"], head_dim, dtype_bytes)
    return kv_blocks(BUDGET, BLOCK, bpt) * BLOCK


def live_cache_config(url: str) -> dict:
    with urllib.request.urlopen(urllib.request.Request(f"{url}/metrics", headers=instance_auth()), timeout=30) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info":
                return dict(sample.labels)
    raise AssertionError(f"no vllm:cache_config_info at {url}/metrics")


def test_sizing_matches_vllm_for_16_bit_kv(decode_url):
    live = live_cache_config(decode_url)
    assert live["cache_dtype"] == "auto"
    assert int(live["block_size"]) == BLOCK
    assert int(live["kv_cache_size_tokens"]) == predicted_tokens(2)


@molecule_only
def test_sizing_playbook_prints_what_each_live_instance_has(prefill_host, decode_host, prefill_url, decode_urls):
    """playbooks/sizing.yml on the deployment's inventory (no host contacted) says, per instance, the tokens its KV
    cache holds: exactly what each running vLLM reports."""
    run = deploy_playbook(os.path.join(os.environ["MOLECULE_EPHEMERAL_DIRECTORY"], "inventory"), "sizing.yml")
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    printed = dict(re.findall(r"\S+/(\S+) \((?:prefill|decode)\): (?:at most )?(\d+) tokens in", output))
    live = {"prefill-0": prefill_url, **decode_urls}
    assert set(printed) == set(live), (printed, output[-3000:])
    for name, url in live.items():
        assert int(printed[name]) == int(live_cache_config(url)["kv_cache_size_tokens"]), (name, output[-3000:])


STOP_BOUND_SECONDS = 25  # the unit's TimeoutStopSec (20) and a margin: a stop must not hang


@pytest.fixture()
def fp8_instance(decode_host):
    """A third vLLM instance, `vllm@sizing-fp8` from the role's own unit template, beside decode-0 (which
    keeps serving: three vLLM processes fit on 2 cores once idle NIXL workers do not spin). Its stop
    is checked too: bounded, clean (unit inactive, not failed) and leaving no process behind."""
    unit = "vllm@sizing-fp8.service"
    model = decode_host.check_output("sed -n 's/^name = //p' /etc/vllm/decode-0.toml")
    toml = (
        '[server]\nhost = "0.0.0.0"\nport = 8299\n'
        f"[model]\nname = {model}\ndtype = \"bfloat16\"\nmax_model_len = 512\nenforce_eager = true\n"
        f'[kv_cache]\nquant_dtype = "fp8"\nmemory_bytes = {BUDGET}\n'
        '[cpu]\nomp_threads_bind = "1"\n'
    )
    written = decode_host.run(
        f"cat > /etc/vllm/sizing-fp8.toml <<'EOF'\n{toml}EOF\n: > /etc/vllm/sizing-fp8.env && "
        "chown root:vllm /etc/vllm/sizing-fp8.toml /etc/vllm/sizing-fp8.env && "
        "chmod 0640 /etc/vllm/sizing-fp8.toml /etc/vllm/sizing-fp8.env"
    )
    assert written.rc == 0, written.stderr
    started = decode_host.run(f"systemctl start {unit}")
    assert started.rc == 0, f"{started.stderr}\n{journal_tail(decode_host, unit)}"
    url = f"http://{container_ip(os.environ.get('INFEROPS_DECODE_HOST', 'molecule-decode'))}:8299"
    try:
        yield url, unit
    finally:
        began = time.monotonic()
        stopped = decode_host.run(f"systemctl stop {unit}")
        took = time.monotonic() - began
        shown = decode_host.run(f"systemctl show -p ActiveState,Result {unit}").stdout
        state = dict(line.split("=", 1) for line in shown.split())
        left = decode_host.run(f"ps -eo pid=,unit= | grep -F ' {unit}' || true").stdout.strip()
        decode_host.run(f"systemctl reset-failed {unit}; rm -f /etc/vllm/sizing-fp8.toml /etc/vllm/sizing-fp8.env")
        assert stopped.rc == 0 and took < STOP_BOUND_SECONDS, (
            f"stopping {unit} took {took:.1f} s (rc {stopped.rc})\n{journal_tail(decode_host, unit)}"
        )
        assert state == {"ActiveState": "inactive", "Result": "success"}, (
            f"{unit} after stop: {state}\n{journal_tail(decode_host, unit)}"
        )
        assert not left, f"processes of {unit} left after stop:\n{left}"


def test_sizing_matches_vllm_for_fp8_kv(fp8_instance, decode_host):
    url, unit = fp8_instance
    deadline = time.monotonic() + 300
    while True:
        try:
            live = live_cache_config(url)
            break
        except (OSError, AssertionError) as exc:
            active = decode_host.run(f"systemctl is-active {unit}").stdout.strip()
            if time.monotonic() > deadline or active not in ("active", "activating"):
                raise AssertionError(
                    f"{unit} did not serve {url}/metrics ({exc}; unit {active}). Its journal:\n"
                    f"{journal_tail(decode_host, unit)}"
                ) from exc
            time.sleep(3)
    assert live["cache_dtype"] == "fp8"
    assert int(live["kv_cache_size_tokens"]) == predicted_tokens(1)
    # fp8 doubles the tokens the same budget holds.
    assert predicted_tokens(1) == 2 * predicted_tokens(2)
    assert metric_samples(f"{url}/metrics")  # the page parses with prometheus_client
