#!/usr/bin/python
# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: prometheus_status
short_description: Wait until Prometheus is ready and has scraped its targets, and list its alert rule groups
version_added: 0.3.0
description:
  - Runs on the Prometheus host, in one module run, what the monitoring role needs to know after it (re)started or
    reloaded Prometheus - that it is ready, which of its targets it can scrape, and which alert rule groups it
    loaded.
  - "Why: each M(ansible.builtin.uri) task costs a module run on the host, about 0.3 s of CPU on our 2-core test
    machines, most of it compiling C(ansible.module_utils); three of them ran on every deploy, also when nothing
    changed."
  - First it waits until C(GET URL/-/ready) answers 200, for up to O(ready_timeout) seconds.
  - Then it reads C(URL/api/v1/targets?state=active) every O(interval) seconds until no active target's health is
    C(unknown) (Prometheus scrapes each target at its own offset within the scrape interval) and either every target
    is C(up) or O(targets_grace) seconds have passed since the first read (a service that was just restarted gets
    that long to come up). When that does not happen within O(targets_timeout) seconds it fails, naming the targets
    Prometheus has not scraped yet.
  - Last it reads C(URL/api/v1/rules?type=alert) and returns the names of the alert rule groups in RV(rule_groups).
  - It does not judge the targets that are down or the rule groups; it returns them (RV(down), RV(rule_groups)) for
    the caller to check, so that a run can name every problem.
  - Requests never go through a proxy and time out after 10 seconds each.
author:
  - inferops.vllm developers (@inferops)
extends_documentation_fragment:
  - inferops.vllm.attributes
attributes:
  check_mode:
    support: full
    details:
      - It only reads; check mode returns the same result.
  diff_mode:
    support: none
options:
  url:
    description:
      - Prometheus' base URL, for example V(http://127.0.0.1:9090).
    type: str
    required: true
  ready_timeout:
    description:
      - Seconds to wait for C(/-/ready) to answer 200.
    type: int
    default: 60
  targets_timeout:
    description:
      - Seconds to wait, from the first read of the targets, until every target was scraped (and is up, or had
        O(targets_grace) seconds to come up).
    type: int
    default: 120
  targets_grace:
    description:
      - Seconds a target that is not up gets to come up, from the first read of the targets, before it is returned
        in RV(down). The monitoring role gives two scrape intervals and 5 seconds.
    type: float
    default: 0
  interval:
    description:
      - Seconds between two reads of C(/-/ready) or of the targets.
    type: float
    default: 3
"""

EXAMPLES = r"""
- name: Wait until Prometheus is ready and has scraped every target, and read its alert rule groups
  inferops.vllm.prometheus_status:
    url: http://127.0.0.1:9090
    targets_timeout: 120
    targets_grace: 35
  register: prometheus

- name: Check that every target is up and the rules are loaded
  ansible.builtin.assert:
    that:
      - prometheus.down | length == 0
      - "'inferops-vllm-pd' in prometheus.rule_groups"
"""

RETURN = r"""
targets:
  description: Every active target, as Prometheus last reported it.
  returned: success
  type: list
  elements: dict
  contains:
    job:
      description: The C(job) label.
      type: str
    instance_name:
      description: The C(instance_name) label, or null.
      type: str
    host:
      description: The C(host) label, or null.
      type: str
    scrape_url:
      description: The URL Prometheus scrapes.
      type: str
    health:
      description: C(up), C(down) or C(unknown).
      type: str
    error:
      description: The last scrape's error, or an empty string.
      type: str
  sample:
    - job: node
      instance_name: null
      host: decode-1
      scrape_url: http://10.0.0.21:9100/metrics
      health: up
      error: ""
down:
  description:
    - One line for each target that is not up - its job and instance name, its host, its scrape URL, and the last
      error (or its health).
  returned: success
  type: list
  elements: str
  sample:
    - "node on decode-1 (http://10.0.0.21:9100/metrics): connect: connection refused"
rule_groups:
  description: The names of the alert rule groups Prometheus loaded, once per group.
  returned: success
  type: list
  elements: str
  sample: [inferops-vllm-pd]
waited:
  description: Seconds the module waited in all.
  returned: success
  type: float
  sample: 3.2
"""

import json  # noqa: E402 (imports follow the documentation, as Ansible modules do)
import time  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402
from ansible_collections.inferops.vllm.plugins.module_utils._http import fetch  # noqa: E402


def argument_spec():
    return dict(
        url=dict(type="str", required=True),
        ready_timeout=dict(type="int", default=60),
        targets_timeout=dict(type="int", default=120),
        targets_grace=dict(type="float", default=0),
        interval=dict(type="float", default=3),
    )


def target_record(target):
    """The parts of one of Prometheus' activeTargets the caller reads."""
    labels = target.get("labels") or {}
    return {
        "job": labels.get("job"),
        "instance_name": labels.get("instance_name"),
        "host": labels.get("host"),
        "scrape_url": target.get("scrapeUrl"),
        "health": target.get("health"),
        "error": target.get("lastError") or "",
    }


def down_line(record):
    """What a run says of a target that is not up."""
    name = record["job"] or "?"
    if record["instance_name"]:
        name += " " + record["instance_name"]
    return f"{name} on {record['host'] or '?'} ({record['scrape_url']}): {record['error'] or record['health']}"


class PrometheusStatus:
    # Injectable for tests.
    clock = staticmethod(time.monotonic)
    sleep = staticmethod(time.sleep)
    request_timeout = 10

    def __init__(self, module):
        self.module = module
        self.url = module.params["url"].rstrip("/")
        self.started = self.clock()

    def get(self, path):
        """(status, parsed JSON or None, message) of GET URL+path."""
        resp, info = fetch(self.url + path, timeout=self.request_timeout, use_proxy=False)
        if resp is None:
            return info["status"], None, info.get("msg", "")
        try:
            body = resp.read()
        finally:
            resp.close()
        try:
            return info["status"], json.loads(body), ""
        except ValueError:
            return info["status"], None, f"not JSON: {body[:200]!r}"

    def fail(self, msg):
        self.module.fail_json(msg=msg, waited=round(self.clock() - self.started, 1))

    def wait_ready(self):
        deadline = self.clock() + self.module.params["ready_timeout"]
        while True:
            status, _data, message = self.get("/-/ready")
            if status == 200:
                return
            if self.clock() >= deadline:
                self.fail(f"Prometheus at {self.url} is not ready after {self.module.params['ready_timeout']} s: "
                          f"/-/ready answered {status if status != -1 else 'nothing'} {message}".rstrip())
            self.sleep(self.module.params["interval"])

    def wait_targets(self):
        first = self.clock()
        deadline = first + self.module.params["targets_timeout"]
        while True:
            status, data, message = self.get("/api/v1/targets?state=active")
            records = None
            if status == 200 and isinstance(data, dict):
                active = (data.get("data") or {}).get("activeTargets")
                if isinstance(active, list):
                    records = [target_record(t) for t in active]
            if records is not None:
                unknown = [r for r in records if r["health"] == "unknown"]
                not_up = [r for r in records if r["health"] != "up"]
                if not unknown and (not not_up or self.clock() - first >= self.module.params["targets_grace"]):
                    return records
            if self.clock() >= deadline:
                if records is None:
                    why = f"/api/v1/targets answered {status if status != -1 else 'nothing'} {message}".rstrip()
                elif unknown:
                    why = "not scraped yet: " + "; ".join(down_line(r) for r in unknown)
                else:  # not reached with a grace shorter than the timeout
                    why = "not up: " + "; ".join(down_line(r) for r in not_up)
                self.fail(f"Prometheus at {self.url} has not scraped every target after "
                          f"{self.module.params['targets_timeout']} s: {why}")
            self.sleep(self.module.params["interval"])

    def rule_groups(self):
        status, data, message = self.get("/api/v1/rules?type=alert")
        groups = ((data or {}).get("data") or {}).get("groups") if isinstance(data, dict) else None
        if status != 200 or not isinstance(groups, list):
            self.fail(f"Prometheus at {self.url} did not list its alert rules: /api/v1/rules answered "
                      f"{status if status != -1 else 'nothing'} {message}".rstrip())
        return [g.get("name") for g in groups if isinstance(g, dict)]

    def run(self):
        self.wait_ready()
        records = self.wait_targets()
        groups = self.rule_groups()
        self.module.exit_json(
            changed=False,
            targets=records,
            down=[down_line(r) for r in records if r["health"] != "up"],
            rule_groups=groups,
            waited=round(self.clock() - self.started, 1),
        )


def main():
    module = AnsibleModule(argument_spec=argument_spec(), supports_check_mode=True)
    PrometheusStatus(module).run()


if __name__ == "__main__":
    main()
