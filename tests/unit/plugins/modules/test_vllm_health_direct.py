"""Unit tests for the direct handoff of plugins/modules/vllm_health.py (handoff: direct).

Builds on the fakes of test_vllm_health.py (real HTTP servers on 127.0.0.1, /metrics from captured fixtures).
Here no router hands the proof requests over: the module itself sends the prompt to prefill with
kv_transfer_params.do_remote_decode and max_tokens=1, then the original request to decode with the
kv_transfer_params prefill answered. The fake prefill answers such parameters as a NIXL kv_producer does, and
the fake decode counts the prompt as received by NIXL only when it gets exactly parameters that prefill issued
(a used or unknown set is recomputed, as vLLM recomputes a prompt whose KV it cannot pull).
"""

from __future__ import annotations

import json
import threading
import uuid

import pytest
from ansible.module_utils import basic
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.test_vllm_health import (
    CLIENT_KEY,
    INSTANCE_KEY,
    MODEL,
    SRC,
    FakeRouter,
    FakeVllm,
    _json,
    authorized,
    prompt_tokens,
    run_module,
    unauthorized,
)
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import exit_json as _exit_json
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import fail_json as _fail_json


@pytest.fixture(autouse=True)
def module_harness(monkeypatch):
    monkeypatch.setattr(basic.AnsibleModule, "exit_json", _exit_json)
    monkeypatch.setattr(basic.AnsibleModule, "fail_json", _fail_json)
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")


class PdVllm(FakeVllm):
    """A FakeVllm that also serves POST /v1/completions as a NIXL prefill (kv_producer) or decode (kv_consumer).

    ``answer`` (prefill only): what prefill puts in kv_transfer_params: ``params`` (a NIXL producer's), ``null``
    (vLLM without a KV connector), ``absent`` (no such key) or ``string`` (not a mapping).
    """

    def __init__(self, fixture, role, key=INSTANCE_KEY, answer="params"):
        self.role = role
        self.answer = answer
        self.completions = []  # (request body, Authorization header)
        self.issued = []  # the kv_transfer_params prefill answered, in order
        self.peer = None  # decode: its prefill, whose issued parameters it can pull
        self.completion_lock = threading.Lock()
        super().__init__(fixture, key=key)

    def handle(self, method, path, headers, body):
        if method == "POST" and path == "/v1/completions":
            self.requests.append((method, path, headers.get("Authorization")))
            if not authorized(headers, self.key):
                return unauthorized(headers)
            request = json.loads(body)
            with self.completion_lock:
                self.completions.append((request, headers.get("Authorization")))
                return self.prefill(request) if self.role == "prefill" else self.decode(request)
        return super().handle(method, path, headers, body)

    def prefill(self, request):
        tokens = prompt_tokens(request)
        self.add(SRC, tokens, source="local_compute")
        answer = completion(request, tokens, text=" The")
        kv = request.get("kv_transfer_params") or {}
        if self.answer == "params" and kv.get("do_remote_decode") is True:
            params = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": [len(self.issued) * 4 + i for i in range(4)],
                "remote_engine_id": str(uuid.uuid4()),
                "remote_host": "127.0.0.1",
                "remote_port": 5600,
                "tp_size": 1,
            }
            self.issued.append(params)
            answer["kv_transfer_params"] = params
        elif self.answer == "null":
            answer["kv_transfer_params"] = None
        elif self.answer == "string":
            answer["kv_transfer_params"] = "do_remote_prefill"
        return _json(200, answer)

    def decode(self, request):
        tokens = prompt_tokens(request)
        kv = request.get("kv_transfer_params")
        issued = self.peer.issued if self.peer else []
        if isinstance(kv, dict) and kv.get("do_remote_prefill") and kv in issued:
            issued.remove(kv)  # prefill frees the blocks once decode pulled them
            self.add(SRC, tokens - 1, source="external_kv_transfer")
            self.add(SRC, 1, source="local_compute")
            self.add("vllm:nixl_xfer_time_seconds_count", 1)
            self.add("vllm:nixl_xfer_time_seconds_sum", 0.02)
            self.add("vllm:nixl_bytes_transferred_count", 1)
            self.add("vllm:nixl_bytes_transferred_sum", 983040)
        else:
            self.add(SRC, tokens, source="local_compute")
        return _json(200, completion(request, tokens))


def completion(request, tokens, text=" The capital of France is Paris"):
    return {
        "id": f"cmpl-{uuid.uuid4().hex[:8]}",
        "object": "text_completion",
        "model": MODEL,
        "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
        "usage": {"prompt_tokens": tokens, "completion_tokens": request["max_tokens"],
                  "total_tokens": tokens + request["max_tokens"]},
    }


class Pair:
    """Prefill and decode instances (``decodes`` of them, the first one listed first) without a router."""

    def __init__(self, key=INSTANCE_KEY, answer="params", prefills=1, decodes=1):
        self.prefills = [PdVllm("prefill_metrics.txt", "prefill", key=key, answer=answer)
                         for unused_index in range(prefills)]
        self.decodes = [PdVllm("decode_metrics.txt", "decode", key=key) for unused_index in range(decodes)]
        for d in self.decodes:
            d.peer = self.prefills[0]
        self.prefill, self.decode = self.prefills[0], self.decodes[0]

    def args(self, **overrides):
        args = {
            "instances": [
                *({"name": f"prefill-{i}", "url": p.url, "role": "prefill"} for i, p in enumerate(self.prefills)),
                *({"name": f"decode-{i}", "url": d.url, "role": "decode"} for i, d in enumerate(self.decodes)),
            ],
            "model": MODEL,
            "vllm_version": "0.32.0",
            "instance_api_key": INSTANCE_KEY,
            "handoff": "direct",
            "wait_timeout": 5,
            "request_timeout": 5,
            "proof_settle_timeout": 0,
        }
        args.update(overrides)
        return args

    def close(self):
        for server in (*self.prefills, *self.decodes):
            server.server.close()


@pytest.fixture()
def pair():
    fakes = Pair()
    yield fakes
    fakes.close()


# --------------------------------------------------------------------------- the proof


def test_direct_handoff_proven_without_a_router(pair):
    result = run_module(pair.args())

    assert result["problems"] == []
    assert result["router"] is None
    proof = result["proof"]
    assert proof["handoff_proven"] is True
    assert proof["requests"] == 3 and proof["requests_failed"] == 0
    assert proof["router_requests"] is None
    assert [q["handoff_proven"] for q in proof["per_request"]] == [True, True, True]
    n = prompt_tokens(pair.decode.completions[0][0])
    assert proof["prefill_served"] == {"prefill-0": 3 * n}
    assert proof["decode_served"] == {"decode-0": 3 * (n - 1)}
    assert proof["nixl_transfers"] == 3 and proof["decode_local_compute_tokens"] == 3
    # The usage is decode's answer: the original max_tokens, not prefill's 1.
    assert proof["completion_tokens"] == 3 * 8
    assert proof["sample_text"] == " The capital of France is Paris"


def test_prefill_gets_the_prompt_for_a_remote_decode(pair):
    run_module(pair.args(proof_max_tokens=5, proof_requests=2))

    sent = [request for request, _auth in pair.prefill.completions]
    assert len(sent) == 2
    for request in sent:
        assert request["max_tokens"] == 1 and request["stream"] is False
        assert request["kv_transfer_params"] == {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        assert request["model"] == MODEL and request["temperature"] == 0
    assert len({request["prompt"] for request in sent}) == 2  # each prompt unique


def test_decode_gets_exactly_what_prefill_answered_and_the_original_request(pair):
    issued = []
    original_prefill = pair.prefill.prefill

    def recording_prefill(request):
        status, ctype, payload = original_prefill(request)
        issued.append(json.loads(payload)["kv_transfer_params"])
        return status, ctype, payload

    pair.prefill.prefill = recording_prefill
    result = run_module(pair.args(proof_max_tokens=5, proof_requests=2))
    assert result["proof"]["handoff_proven"] is True

    to_prefill = [request for request, _auth in pair.prefill.completions]
    to_decode = [request for request, _auth in pair.decode.completions]
    assert len(to_decode) == 2 and len(issued) == 2
    for number, (first, second) in enumerate(zip(to_prefill, to_decode, strict=True)):
        assert second["kv_transfer_params"] == issued[number]
        assert second["max_tokens"] == 5
        assert second["prompt"] == first["prompt"]
        assert second["model"] == MODEL and second["temperature"] == 0 and second["stream"] is False
    assert pair.prefill.issued == []  # decode pulled every block set that prefill issued


def test_requests_carry_the_instance_key_at_both_instances(pair):
    run_module(pair.args(api_key=CLIENT_KEY, instance_api_key=INSTANCE_KEY))

    for server in (pair.prefill, pair.decode):
        assert [auth for _request, auth in server.completions] == [f"Bearer {INSTANCE_KEY}"] * 3
        for method, path, auth in server.requests:
            # The instance key goes to every route but /health (the instances require it there too, issue #25);
            # the client key never to an instance.
            assert auth == (None if path == "/health" else f"Bearer {INSTANCE_KEY}"), (method, path)


def test_api_key_is_the_instance_key_when_no_instance_key():
    fakes = Pair(key=CLIENT_KEY)
    try:
        result = run_module(fakes.args(api_key=CLIENT_KEY, instance_api_key=None, proof_requests=1))
    finally:
        fakes.close()
    assert result["proof"]["handoff_proven"] is True
    for server in (fakes.prefill, fakes.decode):
        assert [auth for _request, auth in server.completions] == [f"Bearer {CLIENT_KEY}"]


def test_wrong_instance_key_fails_before_the_proof():
    fakes = Pair(key="sk-other-instance-key-0000")
    try:
        result = run_module(fakes.args(), expect="fail")
    finally:
        fakes.close()
    assert "HTTP 401" in result["msg"] and result["proof"] is None
    assert fakes.prefill.completions == [] and fakes.decode.completions == []


def test_the_first_prefill_and_the_first_decode_are_the_pair():
    fakes = Pair(prefills=2, decodes=2)
    try:
        result = run_module(fakes.args(proof_requests=2))
    finally:
        fakes.close()
    proof = result["proof"]
    assert proof["handoff_proven"] is True
    assert len(fakes.prefills[0].completions) == 2 and fakes.prefills[1].completions == []
    assert len(fakes.decodes[0].completions) == 2 and fakes.decodes[1].completions == []
    n = prompt_tokens(fakes.decode.completions[0][0])
    # The deltas are still summed over every prefill and every decode instance.
    assert proof["prefill_served"] == {"prefill-0": 2 * n, "prefill-1": 0}
    assert proof["decode_served"] == {"decode-0": 2 * (n - 1), "decode-1": 0}


def test_direct_handoff_with_a_router_leaves_the_router_out():
    fakes = Pair()
    router = FakeRouter(fakes.prefill, [fakes.decode], key=CLIENT_KEY)
    try:
        result = run_module(fakes.args(router_url=router.url, api_key=CLIENT_KEY, proof_requests=2))
    finally:
        router.close()
        fakes.close()
    assert result["router"]["healthy"] is True and result["router"]["models"] == [MODEL]
    assert result["proof"]["handoff_proven"] is True
    assert router.completions == []
    assert len(fakes.prefill.completions) == 2 and len(fakes.decode.completions) == 2


# --------------------------------------------------------------------------- failures


@pytest.mark.parametrize("answer", ["absent", "null", "string"])
def test_prefill_without_kv_transfer_params_fails_the_proof(answer):
    fakes = Pair(answer=answer)
    try:
        result = run_module(fakes.args(), expect="fail")
    finally:
        fakes.close()
    url = f"{fakes.prefill.url}/v1/completions"
    for number in (1, 2, 3):
        assert (
            f"PD proof request {number}/3 from prefill-0 to decode-0: POST {url} (prefill prefill-0) answered no "
            "kv_transfer_params: is it a NIXL kv_producer?"
        ) in result["msg"]
    assert "kv_producer" in result["msg"]
    proof = result["proof"]
    assert proof["handoff_proven"] is False
    assert proof["requests"] == 0 and proof["requests_failed"] == 3
    # Decode never got a request without parameters to pull from.
    assert fakes.decode.completions == []
    assert len(fakes.prefill.completions) == 3


def test_prefill_that_fails_fails_the_proof(pair):
    pair.prefill.prefill = lambda request: _json(500, {"error": "KV connector not configured"})
    result = run_module(pair.args(proof_requests=1), expect="fail")
    assert f"POST {pair.prefill.url}/v1/completions returned HTTP 500" in result["msg"]
    assert "KV connector not configured" in result["msg"]
    assert result["proof"]["requests_failed"] == 1 and pair.decode.completions == []


def test_decode_that_recomputes_fails_the_proof(pair):
    pair.decode.peer = None  # decode cannot pull what prefill issued: it recomputes the prompt
    result = run_module(pair.args(proof_requests=1), expect="fail")
    assert result["proof"]["handoff_proven"] is False
    assert result["proof"]["requests"] == 1
    assert "no KV arrived by external_kv_transfer on decode (decode-0)" in result["msg"]


# --------------------------------------------------------------------------- configuration


def test_pd_proof_without_router_url_needs_handoff_direct(pair):
    result = run_module(pair.args(handoff="router", pd_proof=True), expect="fail")
    assert result["msg"].startswith("Invalid parameters: ")
    assert "pd_proof needs router_url (the proof requests go through it) or handoff=direct" in result["msg"]
    assert pair.prefill.requests == [] and pair.decode.requests == []  # nothing was asked


def test_without_router_url_the_proof_is_off_by_default_with_handoff_router(pair):
    result = run_module(pair.args(handoff="router"))
    assert result["proof"] is None
    assert pair.prefill.completions == [] and pair.decode.completions == []


def test_handoff_direct_turns_the_proof_on_and_needs_both_roles(pair):
    args = pair.args()
    args["instances"] = [i for i in args["instances"] if i["role"] == "decode"]
    result = run_module(args, expect="fail")
    assert result["msg"] == "Invalid parameters: pd_proof needs at least one instance with role prefill"
    assert pair.decode.requests == []


def test_handoff_direct_with_the_proof_off(pair):
    result = run_module(pair.args(pd_proof=False))
    assert result["proof"] is None and result["problems"] == []
    assert pair.prefill.completions == [] and pair.decode.completions == []
