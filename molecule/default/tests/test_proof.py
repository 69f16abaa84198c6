"""The PD proof's judgement (plugins/module_utils/vllm_metrics.py, what the vllm_health module runs)
against the running instances: a request through the front is handed over; a request that skips
prefill, alone or beside a handed-over one, is not, and the proof says why. And playbooks/verify.yml on
its own, as a user runs it after scripts/sandbox/up.sh."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import ssl
import time
import urllib.request

import pytest
from conftest import deploy_playbook, front_ca, instance_auth, molecule_only, secret

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def vllm_metrics():
    project = os.environ.get("MOLECULE_PROJECT_DIRECTORY") or os.path.join(os.path.dirname(__file__), "..", "..", "..")
    path = os.path.join(project, "plugins", "module_utils", "vllm_metrics.py")
    spec = importlib.util.spec_from_file_location("inferops_vllm_metrics", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def roles(decode_urls) -> dict[str, str]:
    return {"prefill-0": "prefill", **dict.fromkeys(decode_urls, "decode")}


def snapshot(vllm_metrics, prefill_url, decode_urls):
    """Every instance's metrics: the front may send a request to any decode instance of the pool."""
    out = {}
    for name, url in (("prefill-0", prefill_url), *decode_urls.items()):
        with urllib.request.urlopen(urllib.request.Request(f"{url}/metrics", headers=instance_auth()),
                                    timeout=30) as resp:
            out[name] = vllm_metrics.summarize_instance(resp.read().decode())["metrics"]
    return out


def complete(url: str, key: str, prompt: str) -> int:
    """One completion; its prompt tokens."""
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    context = ssl.create_default_context(cafile=front_ca()) if url.startswith("https") else None
    with urllib.request.urlopen(req, timeout=180, context=context) as resp:
        return json.loads(resp.read())["usage"]["prompt_tokens"]


def settled(vllm_metrics, before, prefill_url, decode_urls, prompt_tokens):
    """Evaluate once the counters have settled (NIXL's grow a moment after the answer): read them
    until two reads a second apart agree, at most 10 s."""
    after = snapshot(vllm_metrics, prefill_url, decode_urls)
    for _attempt in range(10):
        time.sleep(1)
        again = snapshot(vllm_metrics, prefill_url, decode_urls)
        if again == after:
            break
        after = again
    return vllm_metrics.evaluate_proof_request(before, after, roles(decode_urls), prompt_tokens)


def test_a_request_through_the_front_is_handed_over(vllm_metrics, front_url, prefill_url, decode_urls):
    before = snapshot(vllm_metrics, prefill_url, decode_urls)
    tokens = complete(front_url, secret("client_api_key"), "Proof one: the sun rises in the east and sets in the")
    evaluation = settled(vllm_metrics, before, prefill_url, decode_urls, tokens)
    assert evaluation["handoff_proven"], evaluation["problems"]
    assert evaluation["kv_tokens_transferred"] >= tokens - vllm_metrics.RECOMPUTED_PROMPT_TOKENS


def test_a_request_that_skips_prefill_fails_the_proof(vllm_metrics, prefill_url, decode_url, decode_urls):
    before = snapshot(vllm_metrics, prefill_url, decode_urls)
    tokens = complete(decode_url, secret("instance_api_key"), "Proof two: rivers flow down from the hills into the")
    evaluation = settled(vllm_metrics, before, prefill_url, decode_urls, tokens)
    assert not evaluation["handoff_proven"], evaluation
    assert evaluation["decode_local_compute_tokens"] > vllm_metrics.RECOMPUTED_PROMPT_TOKENS
    assert any("recomputed on decode" in p or "no KV arrived" in p for p in evaluation["problems"]), evaluation


def test_a_partial_handoff_fails_the_proof(vllm_metrics, front_url, prefill_url, decode_url, decode_urls):
    """Two requests judged as one: the first handed over, the second computed by decode itself. Compared
    as totals against one transfer, this passed before; judged against the whole prompt it must fail."""
    before = snapshot(vllm_metrics, prefill_url, decode_urls)
    handed = complete(front_url, secret("client_api_key"), "Proof three: the cat sat on the warm mat by the")
    direct = complete(decode_url, secret("instance_api_key"), "Proof four: birds sing in the tall green trees at")
    evaluation = settled(vllm_metrics, before, prefill_url, decode_urls, handed + direct)
    assert not evaluation["handoff_proven"], evaluation
    assert 0 < evaluation["kv_tokens_transferred"] < handed + direct - 1, evaluation
    assert evaluation["nixl_transfers"] >= 1


@molecule_only
def test_verify_yml_alone_proves_the_deployment_with_no_environment_but_the_cache_dir():
    """playbooks/verify.yml as the README runs it after up.sh, in a new shell (issue #28): no INFEROPS_* variable but
    the cache directory (conftest.playbook_environment), the sandbox's group_vars deriving the model, wheelhouses and
    keys from it. It proves the handoff and changes nothing. test_day2.py runs rolling_restart.yml and deploy_pd.yml
    the same way (deploy_playbook); tests/unit/test_sandbox_inventory.py resolves the inventory on the controller."""
    run = deploy_playbook(os.path.join(os.environ["MOLECULE_EPHEMERAL_DIRECTORY"], "inventory"), "verify.yml")
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    assert "KV handoff PROVEN" in " ".join(output.split()), output[-4000:]  # YAML output may wrap the line
    recap = re.findall(r"^(\S+)\s+: ok=\d+\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", output, re.M)
    assert recap and all(r[1:] == ("0", "0", "0") for r in recap), (recap, output[-4000:])
