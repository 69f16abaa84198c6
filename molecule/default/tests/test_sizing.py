"""The KV sizing calculator used by the preflight (plugins/plugin_utils/_kv_sizing.py) against vLLM's own
figure (`vllm:cache_config_info{kv_cache_size_tokens}`) on the live server, for 16-bit and fp8 KV.

The deployed pair runs 16-bit ("auto") KV; the fallback tests' "cloud" (a plain vLLM instance the role deploys in a
container of its own, molecule/default/cloud.yml) runs fp8 KV with the same budget.
"""

from __future__ import annotations

import json
import os
import re
import sys
import urllib.request
from pathlib import Path

import yaml
from conftest import cloud_deployed, container_ip, deploy_playbook, instance_auth, metric_samples, molecule_only
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, os.environ["ANSIBLE_COLLECTIONS_PATH"].split(":")[0])
from ansible_collections.inferops.vllm.plugins.plugin_utils._kv_sizing import kv_blocks, kv_bytes_per_token  # noqa: E402

# The sandbox's (and molecule's) KV budget, read where the deployment takes it from.
with open(Path(__file__).resolve().parents[3] / "inventories" / "sandbox" / "group_vars" / "all" / "vllm.yml") as _f:
    BUDGET = int(yaml.safe_load(_f)["vllm_instance_kv_cache_memory_bytes"])
BLOCK = 128  # vLLM's default block size on the CPU


def model_config() -> dict:
    with open(os.path.join(os.environ["INFEROPS_MODEL_DIR"], "config.json")) as f:
        return json.load(f)


def predicted_tokens(dtype_bytes: int) -> int:
    c = model_config()
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    bpt = kv_bytes_per_token(c["num_hidden_layers"], c["num_key_value_heads"], head_dim, dtype_bytes)
    return kv_blocks(BUDGET, BLOCK, bpt) * BLOCK


def live_cache_config(url: str, key: str | None = None) -> dict:
    request = urllib.request.Request(f"{url}/metrics", headers=instance_auth(key))
    with urllib.request.urlopen(request, timeout=30) as resp:
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


def test_sizing_matches_vllm_for_fp8_kv():
    """The test "cloud" (molecule/default/cloud.yml) runs the role's instance with fp8 KV and the sandbox's budget:
    no extra vLLM process for this check."""
    cloud_dir = cloud_deployed()
    with open(os.path.join(cloud_dir, "api_key")) as f:
        key = f.read().split()[0]
    url = f"http://{container_ip(os.environ.get('INFEROPS_CLOUD_HOST', 'molecule-cloud'))}:8100"
    live = live_cache_config(url, key)
    assert live["cache_dtype"] == "fp8"
    assert int(live["kv_cache_size_tokens"]) == predicted_tokens(1)
    # fp8 doubles the tokens the same budget holds.
    assert predicted_tokens(1) == 2 * predicted_tokens(2)
    assert metric_samples(f"{url}/metrics", key=key)  # the page parses with prometheus_client
