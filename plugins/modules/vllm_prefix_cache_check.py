#!/usr/bin/python
# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: vllm_prefix_cache_check
short_description: Measure what vLLM's prefix cache saves on a repeated long system prompt
version_added: 0.1.0
description:
  - Sends two streamed chat completions through O(url) (the front of a deployment) with the same long system prompt
    and different user messages, one after the other, and measures the time to the first token (TTFT) of each.
    The second one's prompt starts with the tokens of the first one's, so an instance with prefix caching finds
    their KV in its cache instead of computing it again.
  - >-
    Reads C(/metrics) of every instance right before the first request, after each answer (once the counters
    settled), and reports the growth of C(vllm:prefix_cache_queries_total) and C(vllm:prefix_cache_hits_total)
    (tokens) per instance and request, which explains the TTFT drop; and the cache settings each instance runs with
    (C(vllm:cache_config_info): KV cache dtype, prefix caching on or off, block size).
  - The system prompt starts with a random tag, so no earlier request has its KV cached, and is sized through the
    front's C(/tokenize) route to about O(prompt_tokens) tokens with the chat template (estimated from its length
    when C(/tokenize) does not answer). vLLM caches whole blocks only, so hits come in multiples of the block size.
  - With O(send_requests=false), only the cache settings and counters are read.
  - Run it where the front and every instance's C(/metrics) are reachable, for example on the router host, whose
    address the instances' firewall lets through (C(roles/vllm_firewall)). Other traffic meanwhile is counted too.
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
      - The module only reads metrics and sends two completions, which change no state, so it does the same in
        check mode.
  diff_mode:
    support: none
options:
  url:
    description:
      - The front's root URL, without C(/v1), for example V(https://10.0.0.5:8000).
    type: str
    required: true
  api_key:
    description:
      - "A client key of the front, sent as C(Authorization: Bearer <key>) to O(url) only, never to the instances."
    type: str
  instance_api_key:
    description:
      - The instances' key (their C(VLLM_API_KEY)), sent to their C(/metrics) only. The instances of the
        vllm_instance role require it on every route but C(/health). Empty or unset sends none.
    type: str
  model:
    description:
      - The served model name.
    type: str
    required: true
  instances:
    description:
      - The vLLM instances whose C(/metrics) are read.
    type: list
    elements: dict
    required: true
    suboptions:
      name:
        description: Name of the instance, used in results and messages.
        type: str
        required: true
      url:
        description: Base URL of the instance, without a path, for example V(http://10.0.0.11:8100).
        type: str
        required: true
      role:
        description: V(prefill), V(decode) or V(none) (colocated).
        type: str
        required: true
        choices: [prefill, decode, none]
  prompt_tokens:
    description:
      - The length in tokens that each request's prompt (system prompt, user message and chat template) should
        reach without exceeding it. Keep it and O(max_tokens) within the instances' C(max_model_len).
    type: int
    default: 1024
  max_tokens:
    description: Output tokens of each request.
    type: int
    default: 8
  send_requests:
    description: Send the two requests; V(false) only reads the instances' cache settings and counters.
    type: bool
    default: true
  validate_certs:
    description: Verify the front's TLS certificate.
    type: bool
    default: true
  ca_path:
    description: A PEM file of the CA that signed the front's certificate; the system's CA store when unset.
    type: path
  request_timeout:
    description: Seconds each HTTP request may take.
    type: int
    default: 300
  settle_timeout:
    description:
      - After each answer, how many seconds the metrics are read again (every half second) until the instances'
        prefix cache counters grew and stopped changing.
    type: int
    default: 10
seealso:
  - name: vLLM automatic prefix caching
    description: How vLLM finds a prompt's KV blocks in its cache.
    link: https://docs.vllm.ai/en/latest/design/prefix_caching.html
"""

EXAMPLES = r"""
- name: Measure the prefix cache through the front, from the router host
  inferops.vllm.vllm_prefix_cache_check:
    url: https://10.0.0.5:8000
    api_key: "{{ vllm_router_api_keys | first }}"
    model: qwen2.5-14b-instruct
    ca_path: /tmp/front-ca.pem
    prompt_tokens: 2048
    instances:
      - {name: prefill-0, url: "http://10.0.0.11:8100", role: prefill}
      - {name: decode-0, url: "http://10.0.0.21:8200", role: decode}
  vars:
    ansible_python_interpreter: /opt/vllm-router/venv/bin/python
  register: prefix_check

- name: Only read which KV cache dtype and prefix caching the instances run with
  inferops.vllm.vllm_prefix_cache_check:
    url: https://10.0.0.5:8000
    model: qwen2.5-14b-instruct
    send_requests: false
    instances:
      - {name: prefill-0, url: "http://10.0.0.11:8100", role: prefill}
"""

RETURN = r"""
instances:
  description: Each instance's live cache settings and the prefix cache counters read before the first request.
  returned: always
  type: list
  elements: dict
  contains:
    name:
      description: Instance name.
      type: str
      sample: prefill-0
    role:
      description: Its role.
      type: str
      sample: prefill
    url:
      description: Its URL as given in O(instances) (without a trailing C(/)), to tell instances of one name apart.
      type: str
      sample: http://10.0.0.11:8100
    cache_dtype:
      description: C(cache_dtype) of C(vllm:cache_config_info) (the KV cache dtype asked for, C(auto) or C(fp8)).
      type: str
      sample: auto
    enable_prefix_caching:
      description: Whether the instance runs with prefix caching; V(null) when its metrics do not say.
      type: bool
      sample: true
    block_size:
      description: Tokens per KV block.
      type: int
      sample: 128
    queries:
      description: C(vllm:prefix_cache_queries_total) before the first request (tokens).
      type: int
      sample: 21
    hits:
      description: C(vllm:prefix_cache_hits_total) before the first request (tokens).
      type: int
      sample: 0
check:
  description: The two requests and what the prefix cache did for them; V(null) with O(send_requests=false).
  returned: always
  type: dict
  contains:
    system_prompt_tag:
      description: The random tag the system prompt starts with.
      type: str
      sample: 3f9a0c1e
    prompt_tokens_source:
      description: V(tokenize) when the front's C(/tokenize) sized the prompt, V(estimate) when it did not answer.
      type: str
      sample: tokenize
    requests:
      description: One entry per request, in order.
      type: list
      elements: dict
      contains:
        ttft_ms:
          description: Milliseconds from sending the request to its first token.
          type: float
          sample: 812.4
        latency_ms:
          description: Milliseconds until the answer ended.
          type: float
          sample: 1020.7
        prompt_tokens:
          description: Prompt tokens (the answer's usage, else C(/tokenize)); V(null) when unknown.
          type: int
          sample: 1019
        completion_tokens:
          description: Output tokens of the answer's usage; V(null) when unknown.
          type: int
          sample: 8
        queries:
          description: Growth of the prefix cache queries over all instances during the request (tokens).
          type: int
          sample: 2038
        hits:
          description: Growth of the prefix cache hits over all instances during the request (tokens).
          type: int
          sample: 1792
        per_instance:
          description: Instance name to its C({queries, hits}) growth during the request.
          type: dict
          sample: {"prefill-0": {"queries": 1019, "hits": 896}, "decode-0": {"queries": 1019, "hits": 896}}
    ttft_drop_percent:
      description: (first TTFT - second TTFT) / first TTFT x 100; negative when the second was slower.
      type: float
      sample: 58.3
    hits_delta:
      description: Growth of C(vllm:prefix_cache_hits_total) over all instances during the second request.
      type: int
      sample: 1792
    summary:
      description: One line that says it all.
      type: str
      sample: >-
        TTFT 812 ms -> 339 ms (-58.3 %) for the same 1019-token system prompt; second request:
        vllm:prefix_cache_hits_total +896 on prefill-0, +896 on decode-0 (first: +0).
"""

import json  # noqa: E402
import math  # noqa: E402
import secrets  # noqa: E402
import time  # noqa: E402
from urllib.parse import urlparse  # noqa: E402

from ansible.module_utils.basic import AnsibleModule, missing_required_lib  # noqa: E402
from ansible_collections.inferops.vllm.plugins.module_utils._http import fetch  # noqa: E402
from ansible_collections.inferops.vllm.plugins.module_utils.vllm_metrics import (  # noqa: E402
    HAS_PROMETHEUS_CLIENT,
    PROMETHEUS_CLIENT_IMPORT_ERROR,
    MetricsError,
    parse_metrics,
    prefix_cache_state,
    redact,
    snippet,
)


def argument_spec():
    instance = dict(
        name=dict(type="str", required=True),
        url=dict(type="str", required=True),
        role=dict(type="str", required=True, choices=["prefill", "decode", "none"]),
    )
    return dict(
        url=dict(type="str", required=True),
        api_key=dict(type="str", no_log=True),
        instance_api_key=dict(type="str", no_log=True),
        model=dict(type="str", required=True),
        instances=dict(type="list", elements="dict", required=True, options=instance),
        prompt_tokens=dict(type="int", default=1024, no_log=False),
        max_tokens=dict(type="int", default=8, no_log=False),
        send_requests=dict(type="bool", default=True),
        validate_certs=dict(type="bool", default=True),
        ca_path=dict(type="path"),
        request_timeout=dict(type="int", default=300),
        settle_timeout=dict(type="int", default=10),
    )


class PrefixCacheCheck:
    # The system prompt's rules, repeated (numbered) until it is long enough. A code-review assistant, as in the
    # sources' example of a shared system prompt.
    RULES = (
        "Read the whole change before commenting, and say first what it does in one sentence.",
        "Point out bugs before style: wrong results, crashes, races, leaks and security holes come first.",
        "Name the file and the line of every finding, quote the code, and say why it is wrong.",
        "Suggest the smallest fix that works, as a patch, and say how to test it.",
        "Check error handling: every failure must be reported with what failed, where, and what to do about it.",
        "Check names: a function says what it does, a variable what it holds, nothing is abbreviated for no reason.",
        "Check tests: each new behaviour has a test that fails without the change and passes with it.",
        "Keep the tone factual and short; do not repeat what the author already explained in the description.",
    )
    USER_MESSAGES = (
        "Review this code: def add(a, b): return a + b",
        "Review this code: def sub(a, b): return a - b",
    )
    # Characters per token when /tokenize does not answer: English text is ~4; 3 keeps the estimate short of
    # the target rather than over it.
    CHARS_PER_TOKEN_ESTIMATE = 3

    @classmethod
    def system_prompt(cls, tag, rules):
        lines = [f"Session {tag}. You are a careful code-review assistant. Follow these rules."]
        lines += [f"Rule {i + 1}: {cls.RULES[i % len(cls.RULES)]}" for i in range(rules)]
        return "\n".join(lines)

    @classmethod
    def messages(cls, tag, rules, user):
        return [{"role": "system", "content": cls.system_prompt(tag, rules)}, {"role": "user", "content": user}]

    def __init__(self, module):
        self.module = module
        self.params = module.params
        self.url = module.params["url"].rstrip("/")
        self.key = module.params["api_key"] or None
        self.instance_key = module.params["instance_api_key"] or None
        self.secrets = [k for k in (self.key, self.instance_key) if k]
        self.timeout = module.params["request_timeout"]
        self.instances = [dict(name=i["name"], url=i["url"].rstrip("/"), role=i["role"])
                          for i in module.params["instances"]]

    def fail(self, msg, **kwargs):
        self.module.fail_json(msg=redact(msg, self.secrets), **kwargs)

    def config_problems(self):
        problems = []
        for what, url in [("url", self.url)] + [(f"instance {i['name']}: url", i["url"]) for i in self.instances]:
            parsed = urlparse(url)
            if parsed.scheme not in ("http", "https") or not parsed.netloc:
                problems.append(f"{what} {url!r} is not an http:// or https:// URL")
        if not self.instances:
            problems.append("instances is empty: there is no /metrics to read")
        for option, minimum in (("prompt_tokens", 2), ("max_tokens", 1), ("request_timeout", 1),
                                ("settle_timeout", 0)):
            if self.params[option] < minimum:
                problems.append(f"{option} must be {minimum} or more, got {self.params[option]}")
        return problems

    # ----------------------------------------------------------------------- HTTP

    def _open(self, url, body=None, key=None, timeout=None):
        headers = {"Accept": "application/json, text/event-stream;q=0.9, text/plain;q=0.8"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        data = None
        if body is not None:
            data = json.dumps(body)
            headers["Content-Type"] = "application/json"
        resp, info = fetch(url, data=data, headers=headers, method="POST" if body is not None else "GET",
                           timeout=timeout or self.timeout, validate_certs=self.params["validate_certs"],
                           ca_path=self.params["ca_path"])
        status = info.get("status", -1)
        if status is not None and 200 <= status < 300 and resp is not None:
            return resp, None
        if status is None or status < 0:
            reason = snippet(info.get("msg") or "request failed", self.secrets)
            return None, (f"{'POST' if body is not None else 'GET'} {url} failed: {reason} "
                          f"(request_timeout={self.timeout}s)")
        hint = ""
        if status in (401, 403):
            hint = " (it refused the API key)" if key else " (it requires an API key and none was sent)"
        text = snippet(info.get("body") or "", self.secrets)
        return None, f"{'POST' if body is not None else 'GET'} {url} returned HTTP {status}{hint}" + (
            f": {text}" if text else "")

    def _json(self, url, body=None, key=None):
        resp, error = self._open(url, body, key)
        if error:
            return None, error
        try:
            return json.loads(resp.read()), None
        except ValueError as exc:
            return None, f"{url} did not answer JSON: {exc}"
        finally:
            resp.close()

    def read_metrics(self):
        """Instance name -> prefix_cache_state; fails the module naming the instance that cannot be read."""
        out = {}
        for inst in self.instances:
            url = f"{inst['url']}/metrics"
            resp, error = self._open(url, key=self.instance_key, timeout=min(self.timeout, 30))
            if error:
                self.fail(f"instance {inst['name']}: {error}. The prefix-cache check reads every instance's /metrics: "
                          "run it where they are reachable (the router host; see roles/vllm_firewall).")
            try:
                samples = parse_metrics(resp.read())
            except MetricsError as exc:
                self.fail(f"instance {inst['name']}: GET {url}: {exc}")
            finally:
                resp.close()
            out[inst["name"]] = prefix_cache_state(samples)
        return out

    # ----------------------------------------------------------------------- the prompt

    def count_tokens(self, msgs):
        """Prompt tokens of ``msgs`` with the chat template, from the front's /tokenize; None if it does not answer."""
        data, error = self._json(f"{self.url}/tokenize", {"model": self.params["model"], "messages": msgs,
                                                          "add_generation_prompt": True}, self.key)
        if error or not isinstance(data, dict) or not isinstance(data.get("count"), int):
            return None
        return data["count"]

    def size_prompt(self, tag):
        """(rules, prompt tokens of the longer request or None, 'tokenize' | 'estimate')."""
        target = self.params["prompt_tokens"]
        longest = max(self.USER_MESSAGES, key=len)
        low, high = 4, 8
        n_low = self.count_tokens(self.messages(tag, low, longest))
        n_high = self.count_tokens(self.messages(tag, high, longest)) if n_low is not None else None
        if n_low is None or n_high is None or n_high <= n_low:
            text_low = len(self.system_prompt(tag, low)) + len(longest)
            per_rule = (len(self.system_prompt(tag, high)) - len(self.system_prompt(tag, low))) / (high - low)
            rules = max(0, int((target * self.CHARS_PER_TOKEN_ESTIMATE - text_low) / per_rule) + low)
            return rules, None, "estimate"
        per_rule = (n_high - n_low) / (high - low)
        rules = max(0, int((target - n_low) / per_rule) + low)
        count = self.count_tokens(self.messages(tag, rules, longest))
        for _attempt in range(20):
            if count is None or count <= target or rules == 0:
                break
            rules = max(0, rules - max(1, math.ceil((count - target) / per_rule)))
            count = self.count_tokens(self.messages(tag, rules, longest))
        if count is not None and count > target:
            self.fail(f"the system prompt cannot be made short enough for prompt_tokens={target}: even with "
                      f"{rules} rules the prompt has {count} tokens. Raise prompt_tokens.")
        return rules, count, "tokenize"

    # ----------------------------------------------------------------------- one request

    def chat(self, msgs):
        """Send one streamed chat completion; (ttft seconds, latency seconds, usage dict)."""
        body = {"model": self.params["model"], "messages": msgs, "max_tokens": self.params["max_tokens"],
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        start = time.monotonic()
        resp, error = self._open(f"{self.url}/v1/chat/completions", body, self.key)
        if error:
            self.fail(f"the prefix-cache check's request failed: {error}")
        first_event = first_token = None
        usage = {}
        try:
            while True:
                line = resp.readline()
                if not line:
                    break
                line = line.decode("utf-8", errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                now = time.monotonic()
                if first_event is None:
                    first_event = now
                try:
                    event = json.loads(payload)
                except ValueError:
                    continue
                if isinstance(event.get("usage"), dict):
                    usage = event["usage"]
                if "error" in event:
                    self.fail(f"POST {self.url}/v1/chat/completions answered an error in its stream: "
                              f"{snippet(json.dumps(event['error']), self.secrets)}")
                for choice in event.get("choices") or []:
                    if first_token is None and (choice.get("delta") or {}).get("content"):
                        first_token = now
        except Exception as exc:  # TimeoutError, ConnectionResetError, http.client.IncompleteRead, ...
            self.fail(f"reading the answer of POST {self.url}/v1/chat/completions failed: {exc} "
                      f"(request_timeout={self.timeout}s)")
        finally:
            resp.close()
        end = time.monotonic()
        if first_event is None:
            self.fail(f"POST {self.url}/v1/chat/completions streamed no event: is {self.params['model']!r} the "
                      "served model name?")
        return (first_token or first_event) - start, end - start, usage

    def settle(self, before):
        """Read the metrics until they grew since ``before`` and stopped changing (or settle_timeout passed)."""
        deadline = time.monotonic() + self.params["settle_timeout"]
        previous = self.read_metrics()
        while time.monotonic() < deadline:
            time.sleep(0.5)
            current = self.read_metrics()
            grew = sum(v["queries"] or 0 for v in current.values()) > sum(v["queries"] or 0 for v in before.values())
            if grew and current == previous:
                return current
            previous = current
        return previous

    # ----------------------------------------------------------------------- the check

    @staticmethod
    def deltas(before, after):
        per = {name: {"queries": (after[name]["queries"] or 0) - (before[name]["queries"] or 0),
                      "hits": (after[name]["hits"] or 0) - (before[name]["hits"] or 0)} for name in before}
        return per, sum(v["queries"] for v in per.values()), sum(v["hits"] for v in per.values())

    def run(self):
        problems = self.config_problems()
        if problems:
            self.fail("invalid arguments: " + "; ".join(problems))
        start = self.read_metrics()
        instances = [dict(name=i["name"], role=i["role"], url=i["url"], **{k: start[i["name"]][k] for k in (
            "cache_dtype", "enable_prefix_caching", "block_size", "queries", "hits")}) for i in self.instances]
        if not self.params["send_requests"]:
            self.module.exit_json(changed=False, instances=instances, check=None)
        tag = secrets.token_hex(4)
        rules, counted, source = self.size_prompt(tag)
        snapshots = [start]
        requests = []
        for user in self.USER_MESSAGES:
            msgs = self.messages(tag, rules, user)
            ttft, latency, usage = self.chat(msgs)
            snapshots.append(self.settle(snapshots[-1]))
            per, queries, hits = self.deltas(snapshots[-2], snapshots[-1])
            prompt_tokens = usage.get("prompt_tokens")
            if not isinstance(prompt_tokens, int):
                prompt_tokens = self.count_tokens(msgs) if source == "tokenize" else None
            requests.append(dict(ttft_ms=round(ttft * 1000, 1), latency_ms=round(latency * 1000, 1),
                                 prompt_tokens=prompt_tokens, completion_tokens=usage.get("completion_tokens"),
                                 queries=queries, hits=hits, per_instance=per))
        first, second = requests
        drop = round((first["ttft_ms"] - second["ttft_ms"]) / first["ttft_ms"] * 100, 1) if first["ttft_ms"] else None
        check = dict(system_prompt_tag=tag, prompt_tokens_source=source, requests=requests, ttft_drop_percent=drop,
                     hits_delta=second["hits"], summary=self.summary(requests, drop, instances, counted))
        self.module.exit_json(changed=False, instances=instances, check=check)

    @staticmethod
    def summary(requests, drop, instances, counted):
        first, second = requests
        tokens = second["prompt_tokens"] or counted
        where = ", ".join(f"+{v['hits']} on {name}" for name, v in second["per_instance"].items() if v["queries"]
                          or v["hits"]) or "+0 (no instance counted a query)"
        text = (f"TTFT {first['ttft_ms']:.0f} ms -> {second['ttft_ms']:.0f} ms "
                f"({'-' if drop is not None and drop >= 0 else '+'}{abs(drop or 0):.1f} %) for the same "
                f"{f'{tokens}-token ' if tokens else ''}system prompt; second request: vllm:prefix_cache_hits_total "
                f"{where} (first: +{first['hits']}).")
        off = [i["name"] for i in instances if i["enable_prefix_caching"] is False]
        if off:
            text += f" Prefix caching is off on {', '.join(off)}."
        return text


def main():
    module = AnsibleModule(argument_spec=argument_spec(), supports_check_mode=True)
    if not HAS_PROMETHEUS_CLIENT:
        module.fail_json(msg=missing_required_lib("prometheus_client"), exception=PROMETHEUS_CLIENT_IMPORT_ERROR)
    PrefixCacheCheck(module).run()


if __name__ == "__main__":
    main()
