#!/usr/bin/python
# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: vllm_instance_wait
short_description: Wait on a vLLM host until its instances answer /health, or say why they died
version_added: 0.1.0
description:
  - Runs on the vLLM host and waits, in one task, until every instance in O(instances) answers
    C(http://HOST:PORT/health) with HTTP 200, polling all of them every O(interval) seconds for up to
    O(timeout) seconds. Each request times out after at most 5 seconds, and never goes through a proxy.
  - "While it waits, it reads each instance's systemd unit with C(systemctl show -p
    LoadState,ActiveState,SubState,NRestarts,Result,ExecMainStatus,ActiveEnterTimestampMonotonic UNIT)
    and stops waiting at once when vLLM cannot become healthy any more: the unit is C(failed), C(inactive) (stopped,
    exited or not loaded), waiting to be restarted (C(auto-restart)), or was restarted (C(NRestarts) grew during the
    wait: the process died)."
  - "On success it returns one line per instance in RV(msg): how many seconds the instance took from its unit becoming
    active until it was healthy. RV(instances) also has its last journal line."
  - On failure (early or at O(timeout)) the message names the instance, its unit and URL, what was waited for and for
    how long, the unit's state, the journal lines that look like the root cause (the last 10 of the last 400 lines
    matching C(Error), C(Exception), C(Traceback), C(failed), C(Killed) or C(OOM), case-insensitive) and the last
    O(journal_lines) lines of C(journalctl -u UNIT -n N --no-pager -o cat).
  - C(Bearer) tokens and C(api_key=VALUE)-like values in journal lines are replaced by C(********). The API key of an
    instance lives in its EnvironmentFile and is not logged by vLLM; this is a second line of defence.
  - The systemd checks need C(systemctl); reading the journal needs C(journalctl) and root (or the
    C(systemd-journal) group). Without them the module still waits on C(/health) and says what it could not read.
author:
  - inferops.vllm developers (@inferops)
extends_documentation_fragment:
  - inferops.vllm.attributes
attributes:
  check_mode:
    support: full
    details:
      - In check mode the instances were not (re)started, so the module waits for nothing and returns at once,
        saying so in RV(msg).
  diff_mode:
    support: none
options:
  instances:
    description:
      - The vLLM instances of this host to wait for.
    type: list
    elements: dict
    required: true
    suboptions:
      name:
        description:
          - Name of the instance, used in results and messages. Unique in O(instances).
        type: str
        required: true
      port:
        description:
          - Port of the instance's HTTP API, where C(/health) is asked (1 to 65535).
        type: int
        required: true
      unit:
        description:
          - The systemd unit that runs the instance.
          - Defaults to C(vllm@NAME.service), the unit of the C(inferops.vllm.vllm_instance) role, with NAME from
            O(instances[].name).
        type: str
  host:
    description:
      - Address the instances are asked on, from the host itself. An IPv6 address may be given with or without brackets.
    type: str
    default: 127.0.0.1
  timeout:
    description:
      - Seconds to wait, for all instances together (they start in parallel), until every one answers HTTP 200.
      - V(0) checks once.
    type: int
    default: 600
  interval:
    description:
      - Seconds between two rounds of checks.
    type: float
    default: 2.0
  journal_lines:
    description:
      - How many of the unit's last journal lines a failure shows (and returns in RV(journal)).
      - The root-cause lines are picked from the last 400 lines (or O(journal_lines) if more) either way.
    type: int
    default: 40
notes:
  - The instance's own C(/health) access-log lines (this module's polls, as logged by vLLM's HTTP server) are left out
    of the journal lines it shows.
  - RV(instances[].seconds) is measured on the clock of systemd's C(ActiveEnterTimestampMonotonic), C(CLOCK_MONOTONIC),
    which is the clock of Python's C(time.monotonic) on Linux.
  - A unit that is not running is a failure even when something else answers on its port (a stale process, say).
seealso:
  - module: inferops.vllm.vllm_health
    description: Checks the whole prefill/decode deployment from the controller, and proves the KV handoff.
  - module: ansible.builtin.systemd_service
"""

EXAMPLES = r"""
- name: Wait until every vLLM instance of the host answers /health, or show why it died
  inferops.vllm.vllm_instance_wait:
    instances:
      - name: prefill-0
        port: 8100
      - name: prefill-1
        port: 8101
    timeout: 900
  register: vllm_wait

- name: Show how long each instance took
  ansible.builtin.debug:
    msg: "{{ vllm_wait.msg }}"

- name: Wait for an instance run by a unit of another name, with more journal on failure
  inferops.vllm.vllm_instance_wait:
    instances:
      - name: chat
        port: 8000
        unit: vllm-chat.service
    timeout: 300
    interval: 5
    journal_lines: 100
"""

RETURN = r"""
msg:
  description:
    - One line per instance on success, separated by C(; ).
    - On failure, what went wrong per failed instance, with its unit state, root-cause lines and journal, on several
      lines.
  returned: always
  type: str
  sample: "prefill-0 healthy on :8100 after 47 s; prefill-1 already healthy on :8101 (unit active for 3 h 12 min)"
elapsed:
  description: Seconds the module waited.
  returned: always
  type: float
  sample: 46.1
instances:
  description: Each instance of O(instances), in that order.
  returned: always
  type: list
  elements: dict
  contains:
    name:
      description: Name of the instance.
      type: str
      sample: prefill-0
    port:
      description: Port of the instance.
      type: int
      sample: 8100
    unit:
      description: The instance's systemd unit.
      type: str
      sample: vllm@prefill-0.service
    url:
      description: The URL that was polled.
      type: str
      sample: http://127.0.0.1:8100/health
    healthy:
      description: Whether the instance answered HTTP 200; V(null) in check mode.
      type: bool
      sample: true
    seconds:
      description:
        - Seconds from the unit becoming active (C(ActiveEnterTimestampMonotonic)) until the module first saw the
          instance healthy. For an instance that was already running, that is how long it has been up.
        - The module's own waiting time when systemd did not say when the unit became active.
        - V(null) when the instance is not healthy, and in check mode.
      type: float
      sample: 47.2
    waited:
      description:
        - Seconds the module waited for this instance (V(0.0) when it was healthy at the first check).
        - V(null) when the instance is not healthy, and in check mode.
      type: float
      sample: 45.9
    last_log:
      description:
        - The unit's last non-empty journal line (leaving out C(/health) access-log lines), redacted.
        - V(null) when the instance is not healthy, in check mode, or when the journal could not be read.
      type: str
      sample: "INFO:     Application startup complete."
    unit_state:
      description:
        - The unit's properties as C(systemctl show) last reported them; V(null) in check mode or when systemctl
          could not be run.
      type: dict
      sample:
        LoadState: loaded
        ActiveState: active
        SubState: running
        NRestarts: "0"
        Result: success
        ExecMainStatus: "0"
        ActiveEnterTimestampMonotonic: "1234567890"
    error:
      description:
        - Why the instance is not healthy; for an instance that was still starting when another one failed, that it was
          not healthy yet.
        - V(null) when it is healthy, and in check mode.
      type: str
      sample: "its unit vllm@prefill-0.service failed (Result=exit-code, ExecMainStatus=1)"
    root_causes:
      description: The instance's root-cause journal lines, as in RV(root_causes).
      returned: for instances that failed
      type: list
      elements: str
      sample: ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB."]
    journal:
      description: The instance's last O(journal_lines) journal lines, as in RV(journal).
      returned: for instances that failed
      type: list
      elements: str
      sample: ["RuntimeError: Engine core initialization failed. See root cause above."]
journal:
  description:
    - The last O(journal_lines) lines of the first failed instance's journal (C(/health) access-log lines left out),
      redacted. Every failed instance's own lines are in RV(instances[].journal).
  returned: failure
  type: list
  elements: str
  sample:
    - "ERROR 05-09 07:41:12 [core.py:708] EngineCore failed to start."
    - "RuntimeError: Engine core initialization failed. See root cause above."
    - "vllm@prefill-0.service: Main process exited, code=exited, status=1/FAILURE"
root_causes:
  description:
    - The first failed instance's journal lines that look like the cause, the last 10 of the last 400 lines
      that match C(Error), C(Exception), C(Traceback), C(failed), C(Killed) or C(OOM) (case-insensitive), redacted.
  returned: failure
  type: list
  elements: str
  sample:
    - "Traceback (most recent call last):"
    - "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB."
    - "vllm@prefill-0.service: Failed with result 'exit-code'."
"""

import re  # noqa: E402 (imports follow the documentation, as Ansible modules do)
import time  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402
from ansible_collections.inferops.vllm.plugins.module_utils._http import open_shared  # noqa: E402


def argument_spec():
    instance = dict(
        name=dict(type="str", required=True),
        port=dict(type="int", required=True),
        unit=dict(type="str"),
    )
    return dict(
        instances=dict(type="list", elements="dict", required=True, options=instance),
        host=dict(type="str", default="127.0.0.1"),
        timeout=dict(type="int", default=600),
        interval=dict(type="float", default=2.0),
        journal_lines=dict(type="int", default=40),
    )


def redact(line):
    """``line`` with ``Bearer <token>`` and ``api_key=<value>``-like values replaced by ``********``."""
    line = re.sub(r"(?i)(\bbearer\s+)[^\s\"',;}\]]+", r"\g<1>********", line)
    line = re.sub(r"(?i)(api[-_]?key['\"]?\s*[=:]\s*\[)[^\]]*", r"\g<1>********", line)  # a list of keys
    line = re.sub(r"(?i)(--api-key\s+)(?!\*{8})[^\s\"',;}\]]+", r"\g<1>********", line)
    return re.sub(r"""(?i)(api[-_]?key['"]?\s*[=:]\s*\[?\s*['"]?)[^\s\"',;}\]]+""", r"\g<1>********", line)


def clean_line(line, limit=500):
    """A journal line for a message: no terminal colours, no secrets, at most ``limit`` characters."""
    line = redact(re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", line).rstrip())
    # Redacted before it is shortened, so that a secret cut in half cannot survive.
    return line[:limit] + "..." if len(line) > limit else line


def is_health_poll(line):
    """Whether ``line`` is vLLM's access-log line of a /health request (this module's own polls)."""
    return re.search(r"\"(?:GET|HEAD) /health(?:\?[^\"]*)? HTTP/[0-9.]+\" \d{3}", line) is not None


def root_causes(lines, count=10):
    pattern = re.compile(r"error|exception|traceback|failed|killed|\boom", re.IGNORECASE)
    return [line for line in lines if pattern.search(line)][-count:]


def human(seconds):
    seconds = int(round(seconds))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min {seconds % 60} s"
    if seconds < 172800:
        return f"{seconds // 3600} h {seconds % 3600 // 60} min"
    return f"{seconds // 86400} d {seconds % 86400 // 3600} h"


def as_int(value):
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


class VllmInstanceWait:
    # Injectable for tests; on Linux time.monotonic() is CLOCK_MONOTONIC, the clock of systemd's *TimestampMonotonic.
    clock = staticmethod(time.monotonic)
    sleep = staticmethod(time.sleep)
    request_timeout = 5.0
    root_cause_window = 400
    properties = (
        "LoadState",
        "ActiveState",
        "SubState",
        "NRestarts",
        "Result",
        "ExecMainStatus",
        "ActiveEnterTimestampMonotonic",
    )

    def __init__(self, module):
        self.module = module
        self.params = module.params
        self.timeout = module.params["timeout"]
        self.interval = module.params["interval"]
        self.journal_lines = module.params["journal_lines"]
        host = module.params["host"].strip()
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        self.instances = [
            dict(
                name=item["name"],
                port=item["port"],
                unit=item.get("unit") or f"vllm@{item['name']}.service",
                url=f"http://{host}:{item['port']}/health",
                healthy=None,
                seconds=None,
                waited=None,
                last_log=None,
                unit_state=None,
                error=None,
            )
            for item in module.params["instances"]
        ]
        # Per instance name: NRestarts when first seen, why the unit state could not be read, the last /health
        # answer, whether systemd said when the unit became active.
        self.restarts_at_start = {}
        self.state_errors = {}
        self.last_check = {}
        self.active_known = {}
        self.systemctl = None
        self.journalctl = None

    # ----------------------------------------------------------------------- checks of the parameters

    def config_problems(self):
        problems = []
        seen = set()
        for inst in self.instances:
            if inst["name"] in seen:
                problems.append(f"instance name {inst['name']} is used more than once")
            seen.add(inst["name"])
            if not 0 < inst["port"] < 65536:
                problems.append(f"instance {inst['name']}: port must be 1 to 65535, got {inst['port']}")
        if not self.params["host"].strip():
            problems.append("host must not be empty")
        if self.timeout < 0:
            problems.append(f"timeout must be 0 or more, got {self.timeout}")
        if not self.interval > 0:
            problems.append(f"interval must be more than 0, got {self.interval}")
        if self.journal_lines < 0:
            problems.append(f"journal_lines must be 0 or more, got {self.journal_lines}")
        return problems

    # ----------------------------------------------------------------------- systemd

    def read_unit(self, inst):
        """Refresh ``inst['unit_state']`` from ``systemctl show``; remember why when it cannot be read."""
        if self.systemctl is None:
            self.state_errors[inst["name"]] = "systemctl not found"
            return
        rc, out, err = self.module.run_command(
            [self.systemctl, "show", "-p", ",".join(self.properties), inst["unit"]], expand_user_and_vars=False
        )
        if rc != 0:
            self.state_errors[inst["name"]] = f"systemctl show failed (rc={rc}): {' '.join((err or out).split())}"
            return
        props = {}
        for line in out.splitlines():
            key, sep, value = line.partition("=")
            if sep and key.strip() in self.properties:
                props[key.strip()] = value.strip()
        inst["unit_state"] = props
        self.state_errors.pop(inst["name"], None)
        self.restarts_at_start.setdefault(inst["name"], as_int(props.get("NRestarts")))

    def dead_reason(self, inst):
        """Why the instance's unit cannot become healthy any more, or None."""
        props = inst["unit_state"]
        if props is None or inst["name"] in self.state_errors:
            return None
        unit = inst["unit"]
        active, sub = props.get("ActiveState"), props.get("SubState", "")
        detail = f"Result={props.get('Result')}, ExecMainStatus={props.get('ExecMainStatus')}"
        if props.get("LoadState") == "not-found":
            return f"its unit {unit} does not exist (LoadState=not-found)"
        if active == "failed":
            return f"its unit {unit} failed ({detail})"
        if active == "inactive":
            return f"its unit {unit} is inactive: it was stopped, or vLLM exited ({detail})"
        if sub.startswith("auto-restart"):
            return f"the vLLM process of {unit} died and systemd is about to restart it ({detail})"
        before, now = self.restarts_at_start.get(inst["name"]), as_int(props.get("NRestarts"))
        if before is not None and now is not None and now > before:
            return f"the vLLM process of {unit} died and systemd restarted it (NRestarts {before} -> {now}; {detail})"
        return None

    def unit_state_text(self, inst):
        error = self.state_errors.get(inst["name"])
        if error or inst["unit_state"] is None:
            return f"unknown ({error or 'not read'})"
        return ", ".join(f"{key}={inst['unit_state'][key]}" for key in self.properties if key in inst["unit_state"])

    def active_since(self, inst):
        """Clock time at which the unit became active, or None."""
        usec = as_int((inst["unit_state"] or {}).get("ActiveEnterTimestampMonotonic"))
        if not usec:
            return None
        return usec / 1e6

    def journal(self, inst, lines):
        """(last ``lines`` cleaned journal lines without /health polls, error text or None)."""
        if self.journalctl is None:
            return [], "journalctl not found"
        cmd = [self.journalctl, "-u", inst["unit"], "-n", str(lines), "--no-pager", "-o", "cat"]
        rc, out, err = self.module.run_command(cmd, expand_user_and_vars=False)
        if rc != 0:
            return [], clean_line(f"journalctl failed (rc={rc}): {' '.join((err or out).split())}")
        kept = []
        for line in out.splitlines():
            if not line.strip() or line.startswith("-- No entries --") or is_health_poll(line):
                continue
            kept.append(clean_line(line))
        return kept, None

    # ----------------------------------------------------------------------- HTTP

    def probe(self, inst, deadline):
        """(healthy, text of the answer) of one GET /health."""
        timeout = max(1.0, min(self.request_timeout, deadline - self.clock()))
        try:
            resp = open_shared(
                inst["url"], method="GET", timeout=timeout, use_proxy=False, follow_redirects="none", use_netrc=False
            )
        except Exception as exc:  # HTTPError (503 while the engine is not ready), URLError, TimeoutError, ...
            code = getattr(exc, "code", None)
            if isinstance(code, int):  # an HTTPError, which holds the open response
                exc.close()
                return False, f"HTTP {code}"
            reason = getattr(exc, "reason", None) or exc
            text = " ".join(str(reason).split()) or type(exc).__name__
            if isinstance(reason, TimeoutError) or "timed out" in text:
                text = f"no answer within {timeout:g} s ({text})"
            return False, text
        try:
            status = resp.getcode()
            resp.read()
        except Exception as exc:  # ConnectionResetError, http.client.IncompleteRead, ...
            return False, f"reading the answer failed: {exc}"
        finally:
            resp.close()
        return status == 200, f"HTTP {status}"

    # ----------------------------------------------------------------------- run

    def result_instances(self):
        return [dict(inst) for inst in self.instances]

    def run(self):
        problems = self.config_problems()
        if problems:
            self.module.fail_json(msg="Invalid parameters: " + "; ".join(problems), problems=problems)
        if self.module.check_mode:
            self.module.exit_json(
                changed=False,
                elapsed=0.0,
                instances=self.result_instances(),
                msg="Check mode: waited for nothing, because the instances were not started in check mode.",
            )
        if not self.instances:
            self.module.exit_json(changed=False, elapsed=0.0, instances=[], msg="No instances to wait for.")
        self.systemctl = self.module.get_bin_path("systemctl")
        self.journalctl = self.module.get_bin_path("journalctl")
        self.wait()

    def wait(self):
        started = self.clock()
        deadline = started + self.timeout
        pending = list(self.instances)
        first_round = True
        while True:
            dead = []
            for inst in list(pending):
                self.read_unit(inst)
                reason = self.dead_reason(inst)
                if reason:
                    inst["healthy"] = False
                    inst["error"] = reason
                    dead.append(inst)
                    pending.remove(inst)
                    continue
                healthy, answer = self.probe(inst, deadline)
                self.last_check[inst["name"]] = answer
                if healthy:
                    self.healthy(inst, started, first_round)
                    pending.remove(inst)
            if dead:
                self.fail(dead, pending, started)
            now = self.clock()
            if not pending:
                break
            if now >= deadline:
                for inst in pending:
                    inst["healthy"] = False
                    inst["error"] = f"{inst['url']} did not answer HTTP 200 within timeout={self.timeout}s"
                self.fail(pending, [], started)
            first_round = False
            self.sleep(min(self.interval, deadline - now))
        self.succeed(started)

    def healthy(self, inst, started, first_round):
        now = self.clock()
        inst["healthy"] = True
        inst["waited"] = round(0.0 if first_round else now - started, 1)
        since = self.active_since(inst)
        seconds = now - since if since is not None and since <= now else None
        inst["seconds"] = round(seconds if seconds is not None else now - started, 1)
        self.active_known[inst["name"]] = seconds is not None
        lines, _error = self.journal(inst, 50)
        inst["last_log"] = lines[-1] if lines else None

    def succeed(self, started):
        parts = []
        for inst in self.instances:
            where = f"on :{inst['port']}"
            if inst["waited"] > 0:
                parts.append(f"{inst['name']} healthy {where} after {human(inst['seconds'])}")
            elif self.active_known[inst["name"]]:
                parts.append(f"{inst['name']} already healthy {where} (unit active for {human(inst['seconds'])})")
            else:
                parts.append(f"{inst['name']} already healthy {where}")
        self.module.exit_json(
            changed=False,
            elapsed=round(self.clock() - started, 1),
            instances=self.result_instances(),
            msg="; ".join(parts),
        )

    def fail(self, failed, pending, started):
        elapsed = self.clock() - started
        window = max(self.root_cause_window, self.journal_lines)
        blocks = []
        for inst in failed:
            lines, error = self.journal(inst, window)
            inst["root_causes"] = root_causes(lines)
            inst["journal"] = lines[-self.journal_lines :] if self.journal_lines else []
            block = [
                f"vLLM instance {inst['name']} is not healthy: {inst['error']}.",
                f"  waited for: {inst['url']} to answer HTTP 200 (timeout={self.timeout}s, every {self.interval:g} s), "
                f"for {elapsed:.1f} s",
                f"  last check: {self.last_check.get(inst['name'], 'none (the unit was not running)')}",
                f"  unit {inst['unit']}: {self.unit_state_text(inst)}",
            ]
            if error:
                block.append(f"  journal: could not be read: {error}")
            else:
                block.append(
                    f"  root cause (the last {len(inst['root_causes'])} of the last {window} journal lines matching "
                    "Error|Exception|Traceback|failed|Killed|OOM):"
                )
                block.extend(f"    {line}" for line in inst["root_causes"] or ["(none)"])
                command = f"journalctl -u {inst['unit']} -n {self.journal_lines} --no-pager -o cat"
                block.append(f"  last {len(inst['journal'])} journal lines ({command}):")
                block.extend(f"    {line}" for line in inst["journal"] or ["(none)"])
            blocks.append("\n".join(block))
        for inst in pending:
            inst["healthy"] = False
            inst["error"] = f"not healthy yet when the wait stopped (last check: {self.last_check[inst['name']]})"
        msg = "\n\n".join(blocks)
        if len(failed) > 1:
            msg = f"{len(failed)} of {len(self.instances)} vLLM instances are not healthy.\n\n" + msg
        if pending:
            msg += "\n\nNot waited for further: " + ", ".join(inst["name"] for inst in pending) + "."
        self.module.fail_json(
            msg=msg,
            changed=False,
            elapsed=round(elapsed, 1),
            instances=self.result_instances(),
            journal=failed[0]["journal"],
            root_causes=failed[0]["root_causes"],
        )


def main():
    module = AnsibleModule(argument_spec=argument_spec(), supports_check_mode=True)
    VllmInstanceWait(module).run()


if __name__ == "__main__":
    main()
