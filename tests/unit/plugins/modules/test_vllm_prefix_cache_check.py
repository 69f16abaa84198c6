"""Unit tests for plugins/modules/vllm_prefix_cache_check.py.

main() runs as in the other module tests (exit_json/fail_json raise), against real HTTP servers on 127.0.0.1:
two fake vLLM instances whose /metrics come from the sandbox's captured pages, and a fake front that counts
tokens for /tokenize, streams chat completions as server-sent events and, like vLLM's prefix cache, counts
the blocks of a system prompt it has seen before as hits on both instances (and answers those faster).
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import yaml
from ansible.module_utils import basic
from ansible_collections.inferops.vllm.plugins.modules import vllm_prefix_cache_check as mod
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.test_vllm_health import (
    MODEL,
    FakeServer,
    FakeVllm,
    _json,
    authorized,
    unauthorized,
)
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import (
    assert_documented_as_specified,
    assert_no_globals_besides_documentation,
)
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import exit_json as _exit_json
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import fail_json as _fail_json
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import run_module as run_module_main

KEY = "sk-client-SECRET-prefix-7e1d"
BLOCK = 128
TEMPLATE_TOKENS = 10


@pytest.fixture(autouse=True)
def module_harness(monkeypatch):
    monkeypatch.setattr(basic.AnsibleModule, "exit_json", _exit_json)
    monkeypatch.setattr(basic.AnsibleModule, "fail_json", _fail_json)
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")


def tokens(messages):
    """The fake tokenizer: one token a word, plus the chat template's."""
    return sum(len(m["content"].split()) for m in messages) + TEMPLATE_TOKENS


class FakeFront:
    """The authenticating front: /tokenize and streamed /v1/chat/completions, with a prefix cache."""

    def __init__(self, prefill, decode, key=KEY, tokenize=True, miss_delay=0.8, hit_delay=0.05):
        self.prefill, self.decode, self.key, self.tokenize = prefill, decode, key, tokenize
        self.miss_delay, self.hit_delay = miss_delay, hit_delay
        self.seen = set()
        self.chats = []
        self.lock = threading.Lock()
        self.server = FakeServer(self)
        self.url = self.server.url

    def handle(self, method, path, headers, body):
        if not authorized(headers, self.key):
            return unauthorized(headers)
        data = json.loads(body) if body else {}
        if path == "/tokenize" and method == "POST":
            if not self.tokenize:
                return _json(404, {"detail": "Not Found"})
            n = tokens(data["messages"])
            return _json(200, {"count": n, "max_model_len": 512, "tokens": list(range(n))})
        if path == "/v1/chat/completions" and method == "POST":
            return self.chat(data)
        return _json(404, {"detail": "Not Found"})

    def chat(self, data):
        assert data["stream"] is True and data["model"] == MODEL
        self.chats.append(data)
        system = data["messages"][0]["content"]
        prompt = tokens(data["messages"])
        with self.lock:
            hit = (len(system.split()) + TEMPLATE_TOKENS) // BLOCK * BLOCK if system in self.seen else 0
            self.seen.add(system)
        for inst in (self.prefill, self.decode):
            inst.add("vllm:prefix_cache_queries_total", prompt)
            inst.add("vllm:prefix_cache_hits_total", hit)
        time.sleep(self.hit_delay if hit else self.miss_delay)
        events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
        events += [{"choices": [{"index": 0, "delta": {"content": word}}]} for word in (" Looks", " fine", ".")]
        events.append({"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": 3}})
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return 200, "text/event-stream", text

    def close(self):
        self.server.close()


@pytest.fixture
def deployment():
    prefill = FakeVllm("prefill_metrics.txt")
    decode = FakeVllm("decode_metrics.txt")
    fronts = []

    def make(**kwargs):
        front = FakeFront(prefill, decode, **kwargs)
        fronts.append(front)
        return front

    yield prefill, decode, make
    for front in fronts:
        front.close()
    prefill.server.close()
    decode.server.close()


def args(prefill, decode, front, **overrides):
    return {"url": front.url, "api_key": KEY, "model": MODEL, "prompt_tokens": 300, "settle_timeout": 3,
            "instances": [{"name": "prefill-0", "url": prefill.url, "role": "prefill"},
                          {"name": "decode-0", "url": decode.url + "/", "role": "decode"}], **overrides}


def run(arguments, expect="exit"):
    result = run_module_main(mod.main, arguments, expect)
    assert KEY not in json.dumps(result, default=str)
    return result


def test_documentation_matches_the_argument_spec():
    doc = yaml.safe_load(mod.DOCUMENTATION)
    assert_documented_as_specified(doc["options"], mod.argument_spec())
    yaml.safe_load(mod.EXAMPLES)
    yaml.safe_load(mod.RETURN)
    assert_no_globals_besides_documentation(mod)


def test_the_second_request_hits_the_cache_and_the_report_says_so(deployment):
    prefill, decode, make = deployment
    front = make()
    result = run(args(prefill, decode, front))
    check = result["check"]
    first, second = check["requests"]
    # Both requests have the same system prompt, sized through /tokenize to at most prompt_tokens.
    systems = [c["messages"][0]["content"] for c in front.chats]
    assert len(systems) == 2 and systems[0] == systems[1]
    assert systems[0].startswith(f"Session {check['system_prompt_tag']}.")
    assert [c["messages"][1]["content"] for c in front.chats] == list(mod.PrefixCacheCheck.USER_MESSAGES)
    assert check["prompt_tokens_source"] == "tokenize"
    assert 250 <= first["prompt_tokens"] <= 300 and 250 <= second["prompt_tokens"] <= 300
    # The first found nothing cached, the second its system prompt's whole blocks, on both instances.
    assert first["hits"] == 0 and first["queries"] == 2 * first["prompt_tokens"]
    assert second["per_instance"]["prefill-0"]["hits"] == 256 and second["per_instance"]["decode-0"]["hits"] == 256
    assert check["hits_delta"] == 512
    # The fake answers a hit 0.75 s sooner (the loopback adds its own few ms to both).
    assert first["ttft_ms"] > second["ttft_ms"] > 0 and check["ttft_drop_percent"] > 25
    assert first["completion_tokens"] == 3
    assert "vllm:prefix_cache_hits_total +256 on prefill-0, +256 on decode-0 (first: +0)" in check["summary"]
    # The live cache settings of each instance, from vllm:cache_config_info.
    live = [(i["name"], i["cache_dtype"], i["enable_prefix_caching"], i["block_size"]) for i in result["instances"]]
    assert live == [("prefill-0", "auto", True, 128), ("decode-0", "auto", True, 128)]
    # Each with the URL it was read at, which vllm_benchmark's colocated runs match their instance by.
    assert [i["url"] for i in result["instances"]] == [prefill.url.rstrip("/"), decode.url.rstrip("/")]
    assert result["changed"] is False


def test_only_the_cache_settings_without_requests(deployment):
    prefill, decode, make = deployment
    front = make()
    result = run(args(prefill, decode, front, send_requests=False))
    assert result["check"] is None and front.chats == []
    assert {i["name"]: i["enable_prefix_caching"] for i in result["instances"]} == {"prefill-0": True, "decode-0": True}


def test_without_tokenize_the_prompt_is_estimated_short(deployment):
    prefill, decode, make = deployment
    front = make(tokenize=False)
    check = run(args(prefill, decode, front))["check"]
    assert check["prompt_tokens_source"] == "estimate"
    # Three characters a token is a conservative estimate: the prompt stays under the target.
    assert check["requests"][0]["prompt_tokens"] <= 300


def test_a_wrong_key_fails_without_showing_it(deployment):
    prefill, decode, make = deployment
    front = make(key="sk-other-key-000000000")
    result = run(args(prefill, decode, front), expect="fail")
    assert "refused the API key" in result["msg"] and "/v1/chat/completions" in result["msg"]


def test_unreadable_metrics_fail_naming_the_instance(deployment):
    prefill, decode, make = deployment
    front = make()
    bad = args(prefill, decode, front)
    bad["instances"][1]["url"] = "http://127.0.0.1:9"
    result = run(bad, expect="fail")
    assert result["msg"].startswith("instance decode-0: GET http://127.0.0.1:9/metrics failed")
    assert "router host" in result["msg"] and front.chats == []


def test_bad_arguments_are_refused_before_any_request(deployment):
    prefill, decode, make = deployment
    front = make()
    result = run(args(prefill, decode, front, url="ftp://x", prompt_tokens=1), expect="fail")
    assert "url 'ftp://x' is not an http:// or https:// URL" in result["msg"]
    assert "prompt_tokens must be 2 or more" in result["msg"] and front.chats == []


INSTANCE_KEY = "sk-instance-prefix-0123456789"


def test_the_instance_key_goes_to_the_instances_metrics_and_the_client_key_never(deployment):
    """Issue #25: the instances require their key on /metrics; the module sends instance_api_key there, and
    the front's client key only to the front."""
    prefill, decode, make = deployment
    prefill.key = decode.key = INSTANCE_KEY  # the fakes now refuse /metrics without it
    front = make()
    result = run(args(prefill, decode, front, instance_api_key=INSTANCE_KEY, send_requests=False))
    assert INSTANCE_KEY not in json.dumps(result, default=str)
    for server in (prefill, decode):
        seen = [(path, auth) for _method, path, auth in server.requests if path == "/metrics"]
        assert seen and all(auth == f"Bearer {INSTANCE_KEY}" for _path, auth in seen), seen


def test_without_the_instance_key_the_module_says_the_instances_want_one(deployment):
    prefill, decode, make = deployment
    prefill.key = decode.key = INSTANCE_KEY
    result = run(args(prefill, decode, make(), send_requests=False), expect="fail")
    assert "401" in result["msg"] and "none was sent" in result["msg"], result["msg"]
