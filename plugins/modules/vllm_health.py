#!/usr/bin/python
# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: vllm_health
short_description: Check vLLM instances and prove the prefill/decode KV handoff
version_added: 0.1.0
description:
  - Waits until every vLLM instance answers C(/health), then checks each instance's C(/version),
    served models (C(/v1/models)) and live KV-cache configuration (the C(vllm:cache_config_info) labels
    of C(/metrics)) against what was asked for.
  - Checks the router (for example vllm-router in PD mode, or the nginx front in front of it) the same way
    when O(router_url) is set.
  - With O(pd_proof), sends O(proof_requests) completions through the router, one after the other, and proves
    from the instances' metric deltas around each request that prefill computed its prompt and decode received
    the KV of the whole prompt by NIXL (C(vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}))
    instead of recomputing it. Every request must be handed over on its own; totals over the requests are not enough.
  - Collects every problem of every instance and fails once, with all problems and the partial results.
  - "Run it where the URLs are reachable, usually on the controller (C(delegate_to: localhost) and C(run_once: true))."
author:
  - inferops.vllm developers (@inferops)
requirements:
  - prometheus_client
extends_documentation_fragment:
  - inferops.vllm.attributes
attributes:
  check_mode:
    support: full
    details:
      - The module only reads and sends completions, which change no state, so it does the same
        in check mode.
  diff_mode:
    support: none
options:
  instances:
    description:
      - The vLLM instances to check.
    type: list
    elements: dict
    required: true
    suboptions:
      name:
        description:
          - Name of the instance, used in results and messages.
        type: str
        required: true
      url:
        description:
          - Base URL of the instance, without a path, for example V(http://10.0.0.11:8100).
        type: str
        required: true
      role:
        description:
          - The instance's part in prefill/decode disaggregation.
          - V(prefill) instances compute prompts and produce KV, V(decode) instances receive that KV and generate,
            V(none) instances are colocated and take no part in the PD proof.
        type: str
        required: true
        choices: [prefill, decode, none]
      host:
        description:
          - Inventory host the instance runs on. Informational, returned in RV(instances).
        type: str
      kv_transfer_port:
        description:
          - NIXL side-channel port of the instance. Informational only, not checked.
        type: int
      port:
        description:
          - Port of the instance's HTTP API, as the P(inferops.vllm.pd_instances#filter) filter gives it. Informational
            only (O(instances[].url) is what is asked).
        type: int
      shutdown_timeout:
        description:
          - The instance's drain on stop, as the P(inferops.vllm.pd_instances#filter) filter gives it. Informational
            only.
        type: int
      expected:
        description:
          - The KV-cache settings the instance must run with. Only the keys that are given are checked,
            against the labels of C(vllm:cache_config_info) in the instance's C(/metrics).
        type: dict
        suboptions:
          kv_cache_dtype:
            description:
              - Expected KV-cache dtype (C(--kv-cache-dtype)), compared exactly with the live C(cache_dtype),
                for example V(auto) or V(fp8).
              - An V(fp8) KV cache that is not live is a failure.
            type: str
          block_size:
            description:
              - Expected KV-cache block size in tokens.
            type: int
          kv_cache_size_tokens:
            description:
              - Expected KV-cache capacity in tokens.
            type: int
          num_gpu_blocks:
            description:
              - Expected number of KV-cache blocks.
            type: int
  router_url:
    description:
      - Base URL that clients use, for example the vllm-router or the nginx front in front of it.
      - Its C(/health) and C(/v1/models) are checked, and the PD proof sends its completions there.
    type: str
  router_metrics_url:
    description:
      - URL of the router's own Prometheus metrics, for example V(http://10.0.0.10:29000/metrics).
      - Optional extra; a failure to read or parse it is reported as a warning only.
    type: str
  api_key:
    description:
      - "API key sent as C(Authorization: Bearer <key>) to every request to O(router_url), and to the instances
        when O(instance_api_key) is unset."
      - Never sent to C(/health) of the instances or to O(router_metrics_url).
      - It never appears in results or messages. An empty string means no key.
    type: str
  instance_api_key:
    description:
      - API key for the instances (their C(VLLM_API_KEY)), sent to their C(/v1/*), C(/version) and C(/metrics)
        (the vllm_instance role's instances require it on every route but C(/health)), when it differs from the
        key clients send to the router. Defaults to O(api_key) when unset or empty.
      - It never appears in results or messages.
    type: str
  model:
    description:
      - The served model name that every instance and the router must list in C(/v1/models),
        and that the proof requests ask for.
    type: str
    required: true
  vllm_version:
    description:
      - Expected vLLM version from C(/version). V(0.32.0) must match exactly, V(0.32) accepts any 0.32.x;
        a local version label such as C(+cpu) is ignored.
    type: str
  wait_timeout:
    description:
      - Total seconds to wait until every instance (and the router) answers C(/health) with HTTP 200,
        polling every 2 seconds. vLLM takes tens of seconds to load a model.
    type: int
    default: 600
  request_timeout:
    description:
      - Timeout in seconds of each HTTP request. Completions on a CPU build take several seconds each.
    type: int
    default: 120
  validate_certs:
    description:
      - Whether to validate TLS certificates of HTTPS URLs.
    type: bool
    default: true
  handoff:
    description:
      - How the proof requests reach the instances.
      - V(router) sends them through O(router_url), which picks the instances.
      - V(direct) does the handoff itself, as vllm-router does for NIXL, between the first V(prefill) and the first
        V(decode) instance of O(instances); the prompt goes to prefill with C(kv_transfer_params.do_remote_decode) and
        C(max_tokens=1), then the request to decode with the C(kv_transfer_params) prefill answered. This proves
        one given pair, for example an instance out of the router's rotation during a rolling restart. The
        requests carry O(instance_api_key).
    type: str
    choices: [router, direct]
    default: router
  pd_proof:
    description:
      - Whether to prove the prefill/decode handoff with proof requests (see O(handoff)).
      - Defaults to V(true) when O(router_url) is set or O(handoff=direct), V(false) otherwise. V(true) needs
        O(router_url) (unless O(handoff=direct)) and at least one V(prefill) and one V(decode) instance.
      - The metrics are read right before and after each proof request, and the deltas are summed over the
        prefill instances and over the decode instances (the router may pick any of them).
      - The proof fails when a proof request failed or none was served, or when for any one request decode
        received fewer than its prompt tokens minus one by external KV transfer (vLLM always recomputes the
        last prompt token on decode), decode computed more than one of its prompt tokens itself, prefill did
        not compute the prompt, NIXL recorded no transfer, or NIXL failed transfers grew.
      - Each problem names the request and its figures, for example that decode received 29 of 86 expected
        prompt tokens of request 2 of 3 by NIXL and computed 58 itself.
      - The metrics deltas include any other traffic the instances serve meanwhile, so run it on a quiet service.
    type: bool
  proof_requests:
    description:
      - Number of proof completions, sent one after the other. Each one is judged on its own.
    type: int
    default: 3
  proof_prompt:
    description:
      - Prompt of the proof completions. Each request gets a unique tag in front of it, so that no instance
        can answer it from its prefix cache.
      - It must be several tokens long; vLLM never transfers the KV of a one-token prompt.
    type: str
    default: >-
      Question: which city is the capital of France, the city of the famous iron tower that was built
      there for a world fair? Answer: The capital of France is
  proof_max_tokens:
    description:
      - C(max_tokens) of each proof completion (sent with temperature 0).
    type: int
    default: 8
  proof_settle_timeout:
    description:
      - vLLM updates some counters (the NIXL ones in particular) a moment after it answers.
        After each proof request, the metrics are read again every second for up to this many seconds
        until they show that request's handoff, so a failing proof takes up to this long per request.
    type: int
    default: 10
  kv_transport:
    description:
      - How the deployment carries KV between prefill and decode, V(rdma) or V(tcp) (the instances'
        C(kv_fabric.transport)); named in RV(proof.kv_transport) and in the throughput problem.
      - With V(rdma) the instances' E(UCX_TLS) holds no TCP transport, so a transfer that happened went over RDMA;
        its speed shows whether it went well.
    type: str
    choices: [rdma, tcp]
  min_kv_throughput_mib_s:
    description:
      - The least NIXL throughput, in MiB/s, expected over O(kv_transport) during the proof (bytes moved divided by
        the time NIXL spent on the transfers); a slower proof is a problem. V(0) judges nothing.
    type: float
    default: 0.0
notes:
  - The PD proof reads the counters C(vllm:prompt_tokens_by_source_total), C(vllm:nixl_xfer_time_seconds),
    C(vllm:nixl_bytes_transferred) and C(vllm:nixl_num_failed_transfers_total) before and after each proof request.
    NIXL counters that vLLM has not created yet count as 0.
  - Response bodies appear in messages only as short, redacted excerpts.
seealso:
  - name: vLLM metrics
    description: The Prometheus metrics of a vLLM server.
    link: https://docs.vllm.ai/en/latest/design/metrics.html
"""

EXAMPLES = r"""
- name: Wait for the PD service and prove the KV handoff
  inferops.vllm.vllm_health:
    model: smollm2-135m-instruct
    vllm_version: 0.32.0
    api_key: "{{ vault_vllm_api_key }}"
    router_url: https://llm.example.com
    router_metrics_url: http://10.0.0.10:29000/metrics
    instances:
      - name: prefill-0
        url: http://10.0.0.11:8100
        role: prefill
        expected:
          kv_cache_dtype: fp8
          block_size: 16
      - name: decode-0
        url: http://10.0.0.12:8200
        role: decode
        expected:
          kv_cache_dtype: fp8
          block_size: 16
  delegate_to: localhost
  run_once: true
  register: vllm_health

- name: Show how much KV went from prefill to decode
  ansible.builtin.debug:
    msg: "{{ vllm_health.proof.kv_tokens_transferred }} tokens in {{ vllm_health.proof.nixl_transfers }} NIXL transfers"

- name: Only check that a colocated instance is up, serves the model and runs an fp8 KV cache (no proof)
  inferops.vllm.vllm_health:
    model: smollm2-135m-instruct
    wait_timeout: 300
    request_timeout: 30
    instances:
      - name: single-0
        url: http://10.0.0.13:8000
        role: none
        expected:
          kv_cache_dtype: fp8
  delegate_to: localhost
  run_once: true
"""

RETURN = r"""
instances:
  description: What each instance reports, in the order of O(instances).
  returned: always
  type: list
  elements: dict
  contains:
    name:
      description: Name of the instance.
      type: str
      sample: decode-0
    url:
      description: Base URL of the instance.
      type: str
      sample: http://10.0.0.12:8200
    role:
      description: Role of the instance.
      type: str
      sample: decode
    host:
      description: The inventory host given in O(instances[].host), V(null) if not given.
      type: str
      sample: inferops-decode-1
    healthy:
      description: Whether C(/health) answered HTTP 200 within O(wait_timeout).
      type: bool
      sample: true
    version:
      description: The vLLM version from C(/version), V(null) if it could not be read.
      type: str
      sample: 0.32.0
    models:
      description: The model ids from C(/v1/models), V(null) if they could not be read.
      type: list
      elements: str
      sample: [smollm2-135m-instruct]
    metrics:
      description: Summary of C(/metrics) (summed over engines), V(null) if it could not be read.
      type: dict
      contains:
        num_requests_running:
          description: Requests in model execution batches.
          type: int
          sample: 0
        num_requests_waiting:
          description: Requests waiting to be scheduled.
          type: int
          sample: 0
        kv_cache_usage_perc:
          description: KV-cache usage, 1 means 100 percent (largest of the engines); V(null) if not reported.
          type: float
          sample: 0.0
        prefix_cache_hit_rate:
          description: Prefix-cache hits divided by queries (in tokens), V(null) before the first query.
          type: float
          sample: 0.0
        prompt_tokens_local_compute:
          description: Prompt tokens the instance computed itself.
          type: int
          sample: 21
        prompt_tokens_local_cache_hit:
          description: Prompt tokens found in the instance's own prefix cache.
          type: int
          sample: 0
        prompt_tokens_external_kv_transfer:
          description: Prompt tokens whose KV arrived from another instance (decode receiving from prefill).
          type: int
          sample: 21
        nixl_transfers:
          description: NIXL KV transfers (count of C(vllm:nixl_xfer_time_seconds)).
          type: int
          sample: 1
        nixl_failed_transfers:
          description: Failed NIXL KV transfers.
          type: int
          sample: 0
        nixl_bytes_transferred:
          description: Bytes moved by NIXL.
          type: int
          sample: 2949120
        nixl_xfer_time_seconds:
          description: Total time of the NIXL transfers.
          type: float
          sample: 0.024077
    cache_config:
      description: >-
        The live KV-cache configuration from the C(vllm:cache_config_info) labels (values V(null) when absent).
      type: dict
      contains:
        block_size:
          description: KV-cache block size in tokens.
          type: int
          sample: 128
        cache_dtype:
          description: KV-cache dtype as vLLM was given it.
          type: str
          sample: auto
        kv_cache_size_tokens:
          description: KV-cache capacity in tokens.
          type: int
          sample: 46592
        num_gpu_blocks:
          description: Number of KV-cache blocks.
          type: int
          sample: 364
router:
  description: What the router reports; V(null) without O(router_url).
  returned: always
  type: dict
  contains:
    url:
      description: The router URL.
      type: str
      sample: https://llm.example.com
    healthy:
      description: Whether its C(/health) answered HTTP 200 within O(wait_timeout).
      type: bool
      sample: true
    models:
      description: The model ids from its C(/v1/models).
      type: list
      elements: str
      sample: [smollm2-135m-instruct]
    metrics:
      description: Per-worker counters from O(router_metrics_url), V(null) without it or when it could not be read.
      type: dict
      sample:
        pd_prefill_requests: {"http://10.0.0.11:8100": 3}
        pd_decode_requests: {"http://10.0.0.12:8200": 3}
        worker_health: {"http://10.0.0.11:8100": 1, "http://10.0.0.12:8200": 1}
proof:
  description: Result of the PD proof; V(null) when O(pd_proof) is off or was skipped because of earlier problems.
  returned: always
  type: dict
  contains:
    requests:
      description: Proof requests the router served.
      type: int
      sample: 3
    requests_failed:
      description: Proof requests that failed.
      type: int
      sample: 0
    prompt_tokens:
      description: Total prompt tokens of the served requests (from their C(usage)), V(null) if not reported for all.
      type: int
      sample: 111
    completion_tokens:
      description: Total generated tokens of the served requests, V(null) if not reported.
      type: int
      sample: 24
    sample_text:
      description: The text of the first served completion.
      type: str
      sample: " The capital of France is Paris, and"
    mean_request_seconds:
      description: Mean client-side latency of the served (non-streaming) requests.
      type: float
      sample: 6.412
    prefill_served:
      description: >-
        Instance name to prompt tokens it computed during the served proof requests, for each prefill instance.
      type: dict
      sample: {"prefill-0": 111}
    decode_served:
      description: >-
        Instance name to prompt tokens it received by external KV transfer during the served proof requests,
        for each decode instance.
      type: dict
      sample: {"decode-0": 108}
    decode_local_compute_tokens:
      description: Prompt tokens the decode instances computed themselves (one per request is normal).
      type: int
      sample: 3
    kv_tokens_transferred:
      description: Prompt tokens all decode instances received by external KV transfer.
      type: int
      sample: 108
    nixl_transfers:
      description: NIXL transfers during the served proof requests.
      type: int
      sample: 3
    nixl_failed_transfers:
      description: NIXL failed transfers during the served proof requests.
      type: int
      sample: 0
    nixl_bytes_transferred:
      description: Bytes NIXL moved during the served proof requests.
      type: int
      sample: 8847360
    nixl_xfer_time_seconds:
      description: Time NIXL spent transferring during the served proof requests.
      type: float
      sample: 0.071
    kv_transport:
      description: The KV transport the deployment declared (O(kv_transport)), V(null) when not given.
      type: str
      sample: tcp
    nixl_throughput_mib_s:
      description: >-
        RV(proof.nixl_bytes_transferred) in MiB divided by RV(proof.nixl_xfer_time_seconds); V(null) when nothing
        was transferred.
      type: float
      sample: 118.833
    throughput_bound_mib_s:
      description: O(min_kv_throughput_mib_s), V(null) when it is 0.
      type: float
      sample: 1.0
    throughput_ok:
      description: >-
        Whether RV(proof.nixl_throughput_mib_s) reached the bound, and every proof request's own throughput too;
        V(null) without a bound or without transfers (a failure of a slower proof is in RV(problems)).
      type: bool
      sample: true
    slow_requests:
      description: >-
        The numbers of the proof requests whose own KV moved below the bound (named in RV(problems)): one request
        whose KV crawled, as after a prefill restart whose peer kept a stale agent, fails the proof even when the
        others are fast.
      type: list
      elements: int
      sample: []
    per_request:
      description: >-
        The figures of each served proof request, from the metrics read right before it and after its answer,
        summed over the prefill and over the decode instances. The proof needs every one of them handed over.
      type: list
      elements: dict
      contains:
        request:
          description: Number of the request, from 1 to O(proof_requests).
          type: int
          sample: 2
        prompt_tokens:
          description: Prompt tokens of the request from its C(usage), V(null) if not reported.
          type: int
          sample: 37
        kv_tokens_expected:
          description: >-
            Prompt tokens decode had to receive by external KV transfer: the prompt tokens minus the one
            that vLLM always recomputes on decode (without C(usage), the prompt as the instances counted it).
          type: int
          sample: 36
        kv_tokens_transferred:
          description: Prompt tokens the decode instances received by external KV transfer for the request.
          type: int
          sample: 36
        decode_local_compute_tokens:
          description: Prompt tokens the decode instances computed themselves for the request (at most one passes).
          type: int
          sample: 1
        prefill_served:
          description: Instance name to prompt tokens it computed for the request, for each prefill instance.
          type: dict
          sample: {"prefill-0": 37}
        decode_served:
          description: >-
            Instance name to prompt tokens it received by external KV transfer for the request,
            for each decode instance.
          type: dict
          sample: {"decode-0": 36}
        nixl_transfers:
          description: NIXL transfers for the request (at least one is needed).
          type: int
          sample: 1
        nixl_failed_transfers:
          description: NIXL failed transfers for the request (none is allowed).
          type: int
          sample: 0
        nixl_failed_by_instance:
          description: >-
            Instance name to NIXL failed transfers for the request, for each instance whose count grew (empty when none
            did). The proof's problems name these instances once, with the roll that heals them.
          type: dict
          sample: {}
        nixl_bytes_transferred:
          description: Bytes NIXL moved for the request.
          type: int
          sample: 2949120
        nixl_xfer_time_seconds:
          description: Time NIXL spent transferring for the request.
          type: float
          sample: 0.024
        handoff_proven:
          description: Whether the request's metrics show that prefill handed its whole prompt's KV to decode over NIXL.
          type: bool
          sample: true
    router_requests:
      description: Growth of the router's PD request counters, V(null) without O(router_metrics_url).
      type: dict
      sample: {"pd_prefill_requests": 3, "pd_decode_requests": 3}
    handoff_proven:
      description: >-
        Whether every proof request was served and its metrics prove that prefill handed the KV of its whole
        prompt to decode over NIXL.
      type: bool
      sample: true
problems:
  description: Every problem found, each naming the instance or router and its URL; empty on success.
  returned: always
  type: list
  elements: str
  sample: ["instance decode-0 (http://10.0.0.12:8200): expected kv_cache_dtype=fp8 but live cache_dtype=auto"]
"""

import json  # noqa: E402 (imports follow the documentation, as Ansible modules do)
import time  # noqa: E402
import uuid  # noqa: E402
from urllib.parse import urlparse  # noqa: E402

from ansible.module_utils.basic import AnsibleModule, missing_required_lib  # noqa: E402
from ansible_collections.inferops.vllm.plugins.module_utils._http import fetch  # noqa: E402
from ansible_collections.inferops.vllm.plugins.module_utils.vllm_metrics import (  # noqa: E402
    HAS_PROMETHEUS_CLIENT,
    PROMETHEUS_CLIENT_IMPORT_ERROR,
    MetricsError,
    compare_expected,
    evaluate_pd_proof,
    evaluate_proof_request,
    judge_kv_throughput,
    redact,
    redact_data,
    router_deltas,
    snippet,
    summarize_instance,
    summarize_router,
    version_matches,
)


def argument_spec():
    expected = dict(
        kv_cache_dtype=dict(type="str"),
        block_size=dict(type="int"),
        kv_cache_size_tokens=dict(type="int", no_log=False),
        num_gpu_blocks=dict(type="int"),
    )
    instance = dict(
        name=dict(type="str", required=True),
        url=dict(type="str", required=True),
        role=dict(type="str", required=True, choices=["prefill", "decode", "none"]),
        host=dict(type="str"),
        kv_transfer_port=dict(type="int"),
        port=dict(type="int"),
        shutdown_timeout=dict(type="int"),
        expected=dict(type="dict", options=expected),
    )
    return dict(
        instances=dict(type="list", elements="dict", required=True, options=instance),
        router_url=dict(type="str"),
        router_metrics_url=dict(type="str"),
        api_key=dict(type="str", no_log=True),
        instance_api_key=dict(type="str", no_log=True),
        model=dict(type="str", required=True),
        vllm_version=dict(type="str"),
        wait_timeout=dict(type="int", default=600),
        request_timeout=dict(type="int", default=120),
        validate_certs=dict(type="bool", default=True),
        handoff=dict(type="str", default="router", choices=["router", "direct"]),
        pd_proof=dict(type="bool"),
        proof_requests=dict(type="int", default=3),
        proof_prompt=dict(
            type="str",
            default=(
                "Question: which city is the capital of France, the city of the famous iron tower that was built "
                "there for a world fair? Answer: The capital of France is"
            ),
        ),
        proof_max_tokens=dict(type="int", default=8, no_log=False),
        proof_settle_timeout=dict(type="int", default=10),
        kv_transport=dict(type="str", choices=["rdma", "tcp"]),
        min_kv_throughput_mib_s=dict(type="float", default=0.0),
    )


class HttpResult:
    """Outcome of one HTTP request: ``ok`` with ``body``, or ``error`` (already redacted)."""

    def __init__(self, status, body=None, error=None):
        self.status = status
        self.body = body
        self.error = error

    @property
    def ok(self):
        return self.error is None


class VllmHealth:
    def __init__(self, module):
        self.module = module
        self.params = module.params
        self.api_key = module.params["api_key"] or None
        self.instance_key = module.params["instance_api_key"] or self.api_key
        self.secrets = [key for key in (self.api_key, self.instance_key) if key]
        self.request_timeout = module.params["request_timeout"]
        self.problems = []
        self.instances = [
            dict(
                name=item["name"],
                url=item["url"].rstrip("/"),
                role=item["role"],
                host=item.get("host"),
                expected=item.get("expected") or {},
            )
            for item in module.params["instances"]
        ]
        self.router_url = module.params["router_url"].rstrip("/") if module.params["router_url"] else None
        self.direct = module.params["handoff"] == "direct"
        pd_proof = module.params["pd_proof"]
        self.pd_proof = (bool(self.router_url) or self.direct) if pd_proof is None else pd_proof

    # ----------------------------------------------------------------------- plumbing

    def problem(self, msg):
        self.problems.append(redact(msg, self.secrets))

    def warn(self, msg):
        self.module.warn(redact(msg, self.secrets))

    def request(self, url, method="GET", body=None, key=None, timeout=None):
        """One HTTP request; ``key`` is sent as bearer token when given."""
        timeout = self.request_timeout if timeout is None else timeout
        headers = {"Accept": "application/json, text/plain;q=0.9, */*;q=0.5"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        data = None
        if body is not None:
            data = json.dumps(body)
            headers["Content-Type"] = "application/json"
        resp, info = fetch(url, data=data, headers=headers, method=method, timeout=timeout,
                           validate_certs=self.module.params["validate_certs"])
        status = info.get("status", -1)
        if status is not None and 200 <= status < 300 and resp is not None:
            try:
                content = resp.read()
            except Exception as exc:  # TimeoutError, ConnectionResetError, http.client.IncompleteRead, ...
                return HttpResult(-1, error=self.failure(method, url, f"reading the response failed: {exc}", timeout))
            finally:
                resp.close()
            return HttpResult(status, body=content)
        if status is None or status < 0:
            return HttpResult(-1, error=self.failure(method, url, info.get("msg") or "request failed", timeout))
        hint = ""
        if status in (401, 403):
            hint = " (the API key was rejected)" if key else " (it requires an API key and none was sent)"
        body_text = snippet(info.get("body") or "", self.secrets)
        error = f"{method} {url} returned HTTP {status}{hint}"
        if body_text:
            error += f": {body_text}"
        return HttpResult(status, error=redact(error, self.secrets))

    def failure(self, method, url, msg, timeout):
        return redact(f"{method} {url} failed: {snippet(msg, self.secrets)} (request_timeout={timeout}s)", self.secrets)

    def get_json(self, url, key=None):
        """(data, error) of a JSON GET."""
        result = self.request(url, key=key)
        if not result.ok:
            return None, result.error
        try:
            return json.loads(result.body), None
        except ValueError:
            return None, f"GET {url} did not return JSON: {snippet(result.body, self.secrets)}"

    def get_metrics(self, url, key=None):
        """(summary, error) of a vLLM /metrics page."""
        result = self.request(url, key=key)
        if not result.ok:
            return None, result.error
        try:
            return summarize_instance(result.body), None
        except MetricsError as exc:
            return None, f"GET {url}: {redact(str(exc), self.secrets)}"

    # ----------------------------------------------------------------------- checks

    def config_problems(self):
        problems = []
        seen = set()
        for inst in self.instances:
            if inst["name"] in seen:
                problems.append(f"instance name {inst['name']} is used more than once")
            seen.add(inst["name"])
            problems.extend(self._url_problem(f"instance {inst['name']}: url", inst["url"]))
        for option in ("router_url", "router_metrics_url"):
            if self.params[option]:
                problems.extend(self._url_problem(option, self.params[option]))
        for option in ("wait_timeout", "proof_settle_timeout"):
            if self.params[option] < 0:
                problems.append(f"{option} must be 0 or more, got {self.params[option]}")
        if self.request_timeout <= 0:
            problems.append(f"request_timeout must be more than 0, got {self.request_timeout}")
        if self.pd_proof:
            if not self.router_url and not self.direct:
                problems.append("pd_proof needs router_url (the proof requests go through it) or handoff=direct")
            roles = {inst["role"] for inst in self.instances}
            for role in ("prefill", "decode"):
                if role not in roles:
                    problems.append(f"pd_proof needs at least one instance with role {role}")
            if self.params["proof_requests"] < 1:
                problems.append(f"proof_requests must be 1 or more, got {self.params['proof_requests']}")
            if self.params["proof_max_tokens"] < 1:
                problems.append(f"proof_max_tokens must be 1 or more, got {self.params['proof_max_tokens']}")
            if not self.params["proof_prompt"].strip():
                problems.append("proof_prompt must not be empty")
        return problems

    @staticmethod
    def _url_problem(what, url):
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            return [f"{what} {url!r} is not an http:// or https:// URL"]
        return []

    def wait_healthy(self):
        """Poll /health of every instance and the router until all answer 200 or wait_timeout passes.

        HTTP 401/403 end the wait for that target at once: a wrong key does not heal by waiting.
        Returns {target key: None (healthy) or a problem text (without the target's name)}.
        """
        wait_timeout = self.params["wait_timeout"]
        targets = {("instance", inst["name"]): (f"{inst['url']}/health", None) for inst in self.instances}
        if self.router_url:
            targets[("router", self.router_url)] = (f"{self.router_url}/health", self.api_key)
        last = dict.fromkeys(targets, "not checked")
        pending = list(targets)
        deadline = time.monotonic() + wait_timeout
        while True:
            for key in list(pending):
                url, api_key = targets[key]
                remaining = deadline - time.monotonic()
                timeout = max(1, min(self.request_timeout, int(remaining) + 1))
                result = self.request(url, key=api_key, timeout=timeout)
                if result.ok:
                    last[key] = None
                    pending.remove(key)
                elif result.status in (401, 403):
                    last[key] = result.error
                    pending.remove(key)
                else:
                    last[key] = f"not healthy within wait_timeout={wait_timeout}s: {result.error}"
            remaining = deadline - time.monotonic()
            if not pending or remaining <= 0:
                break
            time.sleep(min(2.0, remaining))
        return last

    def check_instance(self, inst, health_error):
        name, url = inst["name"], inst["url"]
        out = dict(
            name=name,
            url=url,
            role=inst["role"],
            host=inst["host"],
            healthy=health_error is None,
            version=None,
            models=None,
            metrics=None,
            cache_config=None,
        )
        where = f"instance {name} ({url})"
        if health_error is not None:
            self.problem(f"{where}: {health_error}")
            return out

        data, error = self.get_json(f"{url}/version", key=self.instance_key)
        if error:
            self.problem(f"{where}: {error}")
        else:
            out["version"] = data.get("version") if isinstance(data, dict) else None
            expected = self.params["vllm_version"]
            if expected and not version_matches(expected, out["version"]):
                self.problem(f"{where}: expected vLLM version {expected} but /version reports {out['version']}")

        out["models"] = self.check_models(where, f"{url}/v1/models", self.instance_key)

        summary, error = self.get_metrics(f"{url}/metrics", key=self.instance_key)
        if error:
            self.problem(f"{where}: {error}")
        else:
            out["metrics"] = summary["metrics"]
            out["cache_config"] = summary["cache_config"]
            for msg in compare_expected(name, url, summary["cache_config"], inst["expected"]):
                self.problem(msg)
        return out

    def check_models(self, where, url, key):
        data, error = self.get_json(url, key=key)
        if error:
            self.problem(f"{where}: {error}")
            return None
        try:
            models = [str(item["id"]) for item in data["data"]]
        except (KeyError, TypeError):
            self.problem(f"{where}: GET {url} did not return an OpenAI model list: {snippet(json.dumps(data))}")
            return None
        if self.params["model"] not in models:
            self.problem(f"{where}: does not serve model {self.params['model']}; GET {url} lists {models}")
        return models

    def router_metrics(self):
        url = self.params["router_metrics_url"]
        if not url:
            return None
        result = self.request(url)
        if not result.ok:
            self.warn(f"router metrics: {result.error}")
            return None
        try:
            return summarize_router(result.body)
        except MetricsError as exc:
            self.warn(f"router metrics: GET {url}: {exc}")
            return None

    def check_router(self, health_error):
        if not self.router_url:
            return None
        out = dict(url=self.router_url, healthy=health_error is None, models=None, metrics=None)
        where = f"router ({self.router_url})"
        if health_error is not None:
            self.problem(f"{where}: {health_error}")
        else:
            out["models"] = self.check_models(where, f"{self.router_url}/v1/models", self.api_key)
        out["metrics"] = self.router_metrics()
        return out

    # ----------------------------------------------------------------------- PD proof

    def snapshot(self, instances):
        """{name: metrics} of the PD instances, or None (with problems recorded) if one cannot be read."""
        metrics = {}
        for inst in instances:
            summary, error = self.get_metrics(f"{inst['url']}/metrics", key=self.instance_key)
            if error:
                self.problem(f"PD proof: instance {inst['name']} ({inst['url']}): {error}")
                return None
            metrics[inst["name"]] = summary["metrics"]
        return metrics

    def settled_request(self, pd, roles, before, prompt_tokens, number, count):
        """Evaluation of one proof request, reading the metrics again until they show its handoff.

        vLLM updates some counters (the NIXL ones in particular) a moment after it answers, so the
        metrics are read every second for up to proof_settle_timeout seconds. None if a read failed.
        """
        deadline = time.monotonic() + self.params["proof_settle_timeout"]
        while True:
            after = self.snapshot(pd)
            if after is None:
                return None
            evaluation = evaluate_proof_request(before, after, roles, prompt_tokens, number, count)
            remaining = deadline - time.monotonic()
            if evaluation["handoff_proven"] or remaining <= 0:
                return evaluation
            time.sleep(min(1.0, remaining))

    @staticmethod
    def pair(pd):
        """The prefill and decode instance of a direct handoff: the first of each role."""
        return (next(inst for inst in pd if inst["role"] == "prefill"),
                next(inst for inst in pd if inst["role"] == "decode"))

    def send_proof(self, pd, body):
        """(url, HttpResult) of one proof completion: through the router, or handed over directly.

        Direct: what vllm-router does for NIXL. Prefill gets the prompt with max_tokens=1 and
        kv_transfer_params.do_remote_decode, so it keeps the computed KV for a remote decode and
        answers where to pull it from; decode gets the original request with those parameters.
        """
        if not self.direct:
            url = f"{self.router_url}/v1/completions"
            return url, self.request(url, method="POST", body=body, key=self.api_key)
        prefill, decode = self.pair(pd)
        url = f"{prefill['url']}/v1/completions"
        first = dict(body, max_tokens=1, stream=False, kv_transfer_params=dict(
            do_remote_decode=True, do_remote_prefill=False, remote_engine_id=None,
            remote_block_ids=None, remote_host=None, remote_port=None))
        result = self.request(url, method="POST", body=first, key=self.instance_key)
        if not result.ok:
            return url, result
        try:
            params = json.loads(result.body)["kv_transfer_params"]
        except (ValueError, KeyError, TypeError):
            params = None
        if not isinstance(params, dict):
            return url, HttpResult(None, error=(
                f"POST {url} (prefill {prefill['name']}) answered no kv_transfer_params: is it a NIXL "
                f"kv_producer? {snippet(result.body, self.secrets)}"))
        url = f"{decode['url']}/v1/completions"
        return url, self.request(url, method="POST", body=dict(body, kv_transfer_params=params), key=self.instance_key)

    def prove_handoff(self):
        """Send the proof requests one after the other and judge each from its own metrics deltas."""
        pd = [inst for inst in self.instances if inst["role"] in ("prefill", "decode")]
        roles = {inst["name"]: inst["role"] for inst in pd}
        router_before = self.router_metrics()

        count = self.params["proof_requests"]
        tag = uuid.uuid4().hex[:12]
        served = failed = 0
        prompt_tokens = completion_tokens = 0
        usage_known = True
        seconds = []
        sample_text = None
        evaluations = []
        for number in range(1, count + 1):
            # Read right before each request, so that its deltas are its own.
            before = self.snapshot(pd)
            if before is None:
                return None
            body = dict(
                model=self.params["model"],
                prompt=f"[proof {tag} {number}/{count}] {self.params['proof_prompt']}",
                max_tokens=self.params["proof_max_tokens"],
                temperature=0,
                stream=False,
            )
            started = time.monotonic()
            url, result = self.send_proof(pd, body)
            elapsed = time.monotonic() - started
            route = "through the router"
            if self.direct:
                route = f"from {self.pair(pd)[0]['name']} to {self.pair(pd)[1]['name']}"
            where = f"PD proof request {number}/{count} {route}"
            if not result.ok:
                failed += 1
                self.problem(f"{where}: {result.error}")
                continue
            try:
                data = json.loads(result.body)
                text = data["choices"][0].get("text")
                if text is None:  # a chat-style answer from an unusual router
                    text = (data["choices"][0].get("message") or {}).get("content")
            except (ValueError, KeyError, IndexError, TypeError, AttributeError):
                failed += 1
                self.problem(f"{where}: POST {url} did not return a completion: {snippet(result.body, self.secrets)}")
                continue
            served += 1
            seconds.append(elapsed)
            if sample_text is None:
                sample_text = text
            usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
            request_prompt_tokens = None
            if isinstance(usage.get("prompt_tokens"), int) and isinstance(usage.get("completion_tokens"), int):
                request_prompt_tokens = usage["prompt_tokens"]
                prompt_tokens += usage["prompt_tokens"]
                completion_tokens += usage["completion_tokens"]
            else:
                usage_known = False
            evaluation = self.settled_request(pd, roles, before, request_prompt_tokens, number, count)
            if evaluation is None:
                return None
            evaluations.append(evaluation)

        proof = evaluate_pd_proof(evaluations, roles)
        router_after = self.router_metrics() if router_before is not None else None

        for msg in proof.pop("problems"):
            self.problem(f"PD proof: {msg}")
        proof.update(
            requests=served,
            requests_failed=failed,
            prompt_tokens=prompt_tokens if served and usage_known else None,
            completion_tokens=completion_tokens if served and usage_known else None,
            sample_text=sample_text,
            mean_request_seconds=round(sum(seconds) / len(seconds), 3) if seconds else None,
            router_requests=router_deltas(router_before, router_after),
        )
        proof["handoff_proven"] = proof["handoff_proven"] and failed == 0
        speed = judge_kv_throughput(proof["nixl_bytes_transferred"], proof["nixl_xfer_time_seconds"],
                                    self.params["kv_transport"], self.params["min_kv_throughput_mib_s"],
                                    proof.get("per_request"))
        for msg in speed.pop("problems"):
            self.problem(f"PD proof: {msg}")
        proof.update(speed)
        return proof

    # ----------------------------------------------------------------------- run

    def run(self):
        config_problems = self.config_problems()
        if config_problems:
            self.module.fail_json(
                msg=redact("Invalid parameters: " + "; ".join(config_problems), self.secrets),
                problems=redact_data(config_problems, self.secrets),
            )

        health = self.wait_healthy()
        instances = [self.check_instance(inst, health[("instance", inst["name"])]) for inst in self.instances]
        router = self.check_router(health.get(("router", self.router_url))) if self.router_url else None

        proof = None
        if self.pd_proof:
            if not self.problems:
                proof = self.prove_handoff()

        result = redact_data(
            dict(changed=False, instances=instances, router=router, proof=proof, problems=self.problems),
            self.secrets,
        )
        if self.problems:
            count = len(self.problems)
            noun = "problem" if count == 1 else "problems"
            msg = f"vLLM health check found {count} {noun}: " + "; ".join(result["problems"])
            if self.pd_proof and proof is None:
                msg += " (PD proof not run or not finished because of these problems)"
            self.module.fail_json(msg=msg, **result)
        self.module.exit_json(**result)


def main():
    module = AnsibleModule(argument_spec=argument_spec(), supports_check_mode=True)
    if not HAS_PROMETHEUS_CLIENT:
        module.fail_json(msg=missing_required_lib("prometheus_client"), exception=PROMETHEUS_CLIENT_IMPORT_ERROR)
    VllmHealth(module).run()


if __name__ == "__main__":
    main()
