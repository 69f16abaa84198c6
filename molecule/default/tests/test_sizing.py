"""The KV sizing calculator used by the preflight (plugins/filter/preflight.py) against vLLM's own
figure (`vllm:cache_config_info{kv_cache_size_tokens}`) on the live server, for 16-bit and fp8 KV.

The deployed pair runs 16-bit ("auto") KV. For fp8, decode-0 is stopped and one plain vLLM
instance is started on the decode host with the same budget and `quant_dtype = "fp8"` (never more
than two vLLM processes on our 2 cores), then decode-0 is started again (not waited for). Runs last (file name).
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request

import pytest
from conftest import container_ip, metric_samples
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, os.environ["ANSIBLE_COLLECTIONS_PATH"].split(":")[0])
from ansible_collections.inferops.vllm.plugins.filter.preflight import kv_blocks, kv_bytes_per_token  # noqa: E402

BUDGET = 1073741824  # vllm_instance_kv_cache_memory_bytes of the sandbox
BLOCK = 128  # vLLM's default block size on the CPU
LAUNCHER = "/opt/vllm/venv/bin/python /usr/local/lib/inferops-vllm/inferops_vllm_launch.py"


def model_config() -> dict:
    with open(os.path.join(os.environ["INFEROPS_MODEL_DIR"], "config.json")) as f:
        return json.load(f)


def predicted_tokens(dtype_bytes: int) -> int:
    c = model_config()
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    bpt = kv_bytes_per_token(c["num_hidden_layers"], c["num_key_value_heads"], head_dim, dtype_bytes)
    return kv_blocks(BUDGET, BLOCK, bpt) * BLOCK


def live_cache_config(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
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


@pytest.fixture()
def fp8_instance(decode_host):
    model = decode_host.check_output("sed -n 's/^name = //p' /etc/vllm/decode-0.toml")
    toml = (
        '[server]\nhost = "0.0.0.0"\nport = 8299\n'
        f"[model]\nname = {model}\ndtype = \"bfloat16\"\nmax_model_len = 512\nenforce_eager = true\n"
        f'[kv_cache]\nquant_dtype = "fp8"\nmemory_bytes = {BUDGET}\n'
        '[cpu]\nomp_threads_bind = "1"\n'
    )
    decode_host.run(f"cat > /tmp/sizing-fp8.toml <<'EOF'\n{toml}EOF\nchmod 0644 /tmp/sizing-fp8.toml")
    assert decode_host.run("systemctl stop vllm@decode-0").rc == 0
    started = decode_host.run(
        "systemd-run --unit inferops-sizing-fp8 -p User=vllm -p KillMode=mixed -p TimeoutStopSec=20 "
        "--setenv=HOME=/var/lib/vllm --setenv=VLLM_TARGET_DEVICE=cpu --setenv=HF_HUB_OFFLINE=1 "
        f"{LAUNCHER} --config /tmp/sizing-fp8.toml --vllm-bin /opt/vllm/venv/bin/vllm"
    )
    assert started.rc == 0, started.stderr
    url = f"http://{container_ip(os.environ.get('INFEROPS_DECODE_HOST', 'molecule-decode'))}:8299"
    try:
        yield url
    finally:
        decode_host.run("systemctl stop inferops-sizing-fp8; systemctl reset-failed inferops-sizing-fp8")
        decode_host.run("rm -f /tmp/sizing-fp8.toml")
        # decode-0 is started again (it answers again about a minute later); nothing after this test
        # needs it, so the test does not wait for it.
        assert decode_host.run("systemctl start vllm@decode-0").rc == 0
        assert decode_host.run("systemctl is-active vllm@decode-0").rc == 0


def test_sizing_matches_vllm_for_fp8_kv(fp8_instance):
    deadline = time.monotonic() + 300
    while True:
        try:
            live = live_cache_config(fp8_instance)
            break
        except (OSError, AssertionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(3)
    assert live["cache_dtype"] == "fp8"
    assert int(live["kv_cache_size_tokens"]) == predicted_tokens(1)
    # fp8 doubles the tokens the same budget holds.
    assert predicted_tokens(1) == 2 * predicted_tokens(2)
    assert metric_samples(f"{fp8_instance}/metrics")  # the page parses with prometheus_client
