#!/usr/bin/python
# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: vllm_instance_drain
short_description: Wait until a vLLM instance runs no request any more
version_added: 0.1.0
description:
  - Runs on the vLLM host, after the instance was taken out of the router (M(inferops.vllm.vllm_router_workers)),
    and reads its C(/metrics) every second until C(vllm:num_requests_running) and C(vllm:num_requests_waiting) are
    both 0 in O(quiet) reads in a row, for up to O(timeout) seconds.
  - It never fails on the timeout; the instance is stopped next, and vLLM's own C(--shutdown-timeout) gives the
    requests still running their last seconds. RV(drained) and RV(msg) say what happened.
  - It fails when C(/metrics) cannot be read (the instance is not there to drain).
author:
  - inferops.vllm developers (@inferops)
extends_documentation_fragment:
  - inferops.vllm.attributes
attributes:
  check_mode:
    support: full
    details:
      - The module only reads metrics; in check mode it reads them once and returns.
  diff_mode:
    support: none
options:
  port:
    description:
      - Port of the instance's HTTP API.
    type: int
    required: true
  host:
    description:
      - Address the instance is asked on, from the host itself.
    type: str
    default: 127.0.0.1
  timeout:
    description:
      - Seconds to wait for the instance to run no request.
    type: int
    default: 60
  quiet:
    description:
      - Reads in a row (one a second) that must show no running and no waiting request.
    type: int
    default: 2
  api_key:
    description:
      - "The instance's key (its C(VLLM_API_KEY)), sent as C(Authorization: Bearer <key>) to its C(/metrics): the
        vllm_instance role's instances require it on every route but C(/health). Empty sends none."
      - It never appears in results or messages.
    type: str
    default: ""
"""

EXAMPLES = r"""
- name: Wait until decode-0 has finished its requests
  inferops.vllm.vllm_instance_drain:
    port: 8200
    timeout: 60
"""

RETURN = r"""
drained:
  description: Whether the instance ran no request at the end.
  returned: always
  type: bool
seconds:
  description: How long the wait took.
  returned: always
  type: float
running:
  description: Requests running (and waiting) at the last read.
  returned: always
  type: int
msg:
  description: What happened, in one line.
  returned: always
  type: str
"""

import http.client  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
import urllib.error  # noqa: E402
import urllib.request  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402


def busy(url, key=""):
    """Running plus waiting requests, summed over engines, from a /metrics page."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    with opener.open(request, timeout=5) as resp:
        text = resp.read().decode("utf-8", "replace")
    gauges = re.compile(r"^vllm:num_requests_(running|waiting)(\{[^}]*\})?\s+(\S+)", re.MULTILINE)
    values = gauges.findall(text)
    if not values:
        raise ValueError(f"{url} has no vllm:num_requests_running: is it a vLLM instance?")
    return int(sum(float(v) for unused_kind, unused_labels, v in values))


def main():
    module = AnsibleModule(
        argument_spec=dict(
            port=dict(type="int", required=True),
            host=dict(type="str", default="127.0.0.1"),
            timeout=dict(type="int", default=60),
            quiet=dict(type="int", default=2),
            api_key=dict(type="str", default="", no_log=True),
        ),
        supports_check_mode=True,
    )
    host = module.params["host"]
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    url = f"http://{host}:{module.params['port']}/metrics"
    started = time.monotonic()
    quiet = 0
    running = None
    while True:
        try:
            running = busy(url, module.params["api_key"])
        except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:
            hint = ""
            if getattr(exc, "code", None) in (401, 403):
                hint = (" (the API key was refused)" if module.params["api_key"]
                        else " (it requires the instance key: api_key)")
            module.fail_json(msg=f"cannot read {url}: {getattr(exc, 'reason', exc)}{hint}", drained=False,
                             seconds=round(time.monotonic() - started, 1), running=-1)
        quiet = quiet + 1 if running == 0 else 0
        elapsed = time.monotonic() - started
        if quiet >= max(1, module.params["quiet"]) or module.check_mode:
            break
        if elapsed >= module.params["timeout"]:
            break
        time.sleep(1)
    seconds = round(time.monotonic() - started, 1)
    drained = running == 0
    if module.check_mode:
        msg = f"check mode: {running} request(s) running or waiting now"
    elif drained:
        msg = f"no request running after {seconds} s"
    else:
        msg = (f"still {running} request(s) running or waiting after {seconds} s; vLLM's --shutdown-timeout gives them "
               "the rest of their time when the instance stops")
    module.exit_json(changed=False, drained=drained, seconds=seconds, running=running, msg=msg)


if __name__ == "__main__":
    main()
