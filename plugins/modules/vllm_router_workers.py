#!/usr/bin/python
# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: vllm_router_workers
short_description: Take a vLLM instance out of vllm-router's rotation, or check that it is in it
version_added: 0.1.0
description:
  - Runs on the router host and talks to each vllm-router process in O(routers) on its own port (its admin
    routes are unauthenticated and bound to loopback by the C(inferops.vllm.vllm_router) role; the front never
    passes them on).
  - V(absent) removes O(url) from every router with C(POST /remove_worker?url=), then reads C(GET /list_workers)
    to confirm that it is gone. New requests then go to the other instances of its pool, while the requests it is
    running finish.
  - Before any removal, V(absent) with O(url) reads each router's C(GET /workers) and refuses, changing nothing,
    when a router that lists the instance counts no other healthy worker of its kind (another instance of the pool
    already down, or being rolled at the same time), because taking it out would leave that router without a prefill
    or a decode worker and every request would fail. O(allow_empty_pool) takes it out anyway.
  - With O(keep) instead of O(url), V(absent) takes out of every router each worker that is not in O(keep) (the
    instances leaving the deployment - a host or an instance removed from the inventory), and refuses, before any
    change, when that would leave a running router without a prefill or without a decode worker, unless
    O(allow_empty_pool). Routers that do not answer (not started yet, on a new router host) are skipped and listed in
    RV(routers_down).
  - V(present) only checks that every router lists O(url) (and, with O(healthy), that it counts it healthy), because
    vllm-router 0.1.17 in PD mode cannot add a worker at run time (C(/add_worker) answers 400), so a removed instance
    comes back when each router process restarts with its command line (the role restarts them one at a time).
author:
  - inferops.vllm developers (@inferops)
extends_documentation_fragment:
  - inferops.vllm.attributes
attributes:
  check_mode:
    support: full
    details:
      - In check mode V(absent) reads the routers' worker lists and reports whether the instance would be removed.
  diff_mode:
    support: none
options:
  routers:
    description:
      - Base URLs of the vllm-router processes, for example V(http://127.0.0.1:8300).
    type: list
    elements: str
    required: true
  url:
    description:
      - The instance as the routers know it (the URL on their command line), for example V(http://10.0.0.5:8200).
      - Exactly one of O(url) and O(keep) is required.
    type: str
  keep:
    description:
      - With O(state=absent), the URLs of every instance the deployment keeps; the routers' other workers are taken out.
      - Exactly one of O(url) and O(keep) is required.
    type: list
    elements: str
  allow_empty_pool:
    description:
      - With O(keep), take workers out even when a running router is left without a prefill or a decode worker
        (every request fails until it restarts with new ones).
      - With O(url), take the instance out even when a router counts no other healthy worker of its kind (every
        request fails until the instance or another one of its pool is back).
    type: bool
    default: false
  state:
    description:
      - V(absent) takes the instance out of every router; V(present) checks that every router has it.
    type: str
    choices: [absent, present]
    default: absent
  healthy:
    description:
      - With O(state=present), wait up to O(timeout) seconds until every router also counts the instance healthy
        (C(GET /workers)).
    type: bool
    default: true
  timeout:
    description:
      - Seconds to wait for O(healthy).
    type: int
    default: 60
"""

EXAMPLES = r"""
- name: Take decode-0 out of both router replicas
  inferops.vllm.vllm_router_workers:
    routers: [http://127.0.0.1:8300, http://127.0.0.1:8301]
    url: http://10.0.0.5:8200
    state: absent

- name: Take the instances that left the inventory out of both router replicas
  inferops.vllm.vllm_router_workers:
    routers: [http://127.0.0.1:8300, http://127.0.0.1:8301]
    keep: [http://10.0.0.4:8100, http://10.0.0.5:8200]
    state: absent
"""

RETURN = r"""
routers:
  description: Per router, whether it listed the instance before and after (with O(url)).
  returned: always
  type: list
  elements: dict
  sample: [{"router": "http://127.0.0.1:8300", "listed_before": true, "listed_after": false}]
removed:
  description: With O(keep), the workers taken out (or, in check mode, that would be), with their role.
  returned: always
  type: list
  elements: dict
  sample: [{"url": "http://10.0.0.6:8201", "worker_type": "decode", "routers": ["http://127.0.0.1:8300"]}]
routers_down:
  description: With O(keep), the routers that did not answer (skipped).
  returned: always
  type: list
  elements: str
  sample: []
"""

import http.client  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import urllib.error  # noqa: E402
import urllib.parse  # noqa: E402
import urllib.request  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402


def call(url, method="GET", timeout=10):
    """JSON (or text) answer of one request to a router; raises OSError with a message."""
    req = urllib.request.Request(url, data=b"" if method == "POST" else None, method=method)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout) as resp:
            body = resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        raise OSError(f"{method} {url}: HTTP {exc.code} {exc.read()[:200]!r}") from exc
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        raise OSError(f"{method} {url}: {getattr(exc, 'reason', None) or exc!r}") from exc
    try:
        return json.loads(body)
    except ValueError:
        return body


def listed(router, url):
    answer = call(f"{router}/list_workers")
    if not isinstance(answer, dict) or not isinstance(answer.get("urls"), list):
        raise OSError(f"GET {router}/list_workers: not a worker list: {str(answer)[:200]}")
    return url in [u.rstrip("/") for u in answer["urls"]]


def workers(router):
    answer = call(f"{router}/workers")
    found = answer.get("workers") if isinstance(answer, dict) else None
    if not isinstance(found, list):
        raise OSError(f"GET {router}/workers: not a worker list: {str(answer)[:200]}")
    return [w for w in found if isinstance(w, dict)]


def _url(worker):
    return str(worker.get("url", "")).rstrip("/")


def healthy(router, url):
    return any(_url(w) == url and w.get("is_healthy") is True for w in workers(router))


def pool_problems(routers, url):
    """Per router that lists ``url``: a line when it counts no other healthy worker of the same kind."""
    problems = []
    for router in routers:
        found = workers(router)
        mine = [w for w in found if _url(w) == url]
        if not mine:
            continue  # already out of this router (a failed run taken up again): nothing to take out
        kind = mine[0].get("worker_type")
        others = [w for w in found if _url(w) != url and w.get("worker_type") == kind]
        if not any(w.get("is_healthy") is True for w in others):
            shown = ", ".join(sorted(f"{_url(w)} (unhealthy)" for w in others)) or "none"
            problems.append(f"{router} counts no other healthy {kind} worker (its other {kind} workers: {shown})")
    return problems


def remove(router, url):
    call(f"{router}/remove_worker?url={urllib.parse.quote(url, safe='')}", method="POST")
    if listed(router, url):
        raise OSError(f"{router} still lists {url} after POST /remove_worker")


def retire(module, routers):
    """Take every worker not in `keep` out of every answering router."""
    keep = {u.rstrip("/") for u in module.params["keep"]}
    known, down = {}, []
    for router in routers:
        try:
            known[router] = workers(router)
        except OSError as exc:
            if "HTTP" in str(exc):
                raise
            down.append(router)
    leaving = {}
    for router, found in known.items():
        for w in found:
            url = _url(w)
            if url and url not in keep:
                entry = leaving.setdefault(url, dict(url=url, worker_type=w.get("worker_type"), routers=[]))
                entry["routers"].append(router)
        left = [w for w in found if _url(w) in keep]
        roles_before = {w.get("worker_type") for w in found}
        roles_after = {w.get("worker_type") for w in left}
        empty = [role for role in ("prefill", "decode") if role in roles_before and role not in roles_after]
        if empty and not module.params["allow_empty_pool"]:
            module.fail_json(
                msg=(f"{router} would have no {' and no '.join(empty)} worker left once "
                     f"{', '.join(sorted(leaving))} leave (they are not in the inventory any more): every request "
                     "would fail until the routers restart with the new instances. Nothing was changed. Deploy the "
                     "replacement first (keep the old instances in the inventory for that run), then remove them; "
                     "or accept the interruption with -e vllm_rollout_allow_downtime=true."),
                removed=sorted(leaving.values(), key=lambda e: e["url"]), routers_down=down, routers=[])
    if not module.check_mode:
        for entry in leaving.values():
            for router in entry["routers"]:
                remove(router, entry["url"])
    return sorted(leaving.values(), key=lambda e: e["url"]), down


def main():
    module = AnsibleModule(
        argument_spec=dict(
            routers=dict(type="list", elements="str", required=True),
            url=dict(type="str"),
            keep=dict(type="list", elements="str", no_log=False),
            allow_empty_pool=dict(type="bool", default=False),
            state=dict(type="str", default="absent", choices=["absent", "present"]),
            healthy=dict(type="bool", default=True),
            timeout=dict(type="int", default=60),
        ),
        mutually_exclusive=[("url", "keep")],
        required_one_of=[("url", "keep")],
        required_if=[("state", "present", ("url",))],
        supports_check_mode=True,
    )
    routers = [r.rstrip("/") for r in module.params["routers"]]
    if module.params["keep"] is not None:
        try:
            removed, down = retire(module, routers)
        except OSError as exc:
            module.fail_json(msg=str(exc), removed=[], routers_down=[], routers=[])
        module.exit_json(changed=bool(removed), removed=removed, routers_down=down, routers=[])
    url = module.params["url"].rstrip("/")
    results = []
    changed = False
    try:
        problems = (pool_problems(routers, url)
                    if module.params["state"] == "absent" and not module.params["allow_empty_pool"] else [])
    except OSError as exc:
        module.fail_json(msg=str(exc), routers=results)
    if problems:
        module.fail_json(
            msg=(f"Taking {url} out would leave a router without a healthy worker of its kind: "
                 f"{'; '.join(problems)}. Every request would fail until one is back. Nothing was changed. Bring the "
                 "rest of the pool back into rotation first (each instance's /health answers, the routers count it "
                 "healthy), roll fewer instances of one pool at a time (vllm_rollout_serial), or accept the "
                 "interruption with -e vllm_rollout_allow_downtime=true."),
            routers=results)
    try:
        for router in routers:
            before = listed(router, url)
            entry = dict(router=router, listed_before=before, listed_after=before)
            results.append(entry)
            if module.params["state"] == "absent":
                if before and not module.check_mode:
                    remove(router, url)
                    entry["listed_after"] = False
                changed = changed or before
            elif not before:
                module.fail_json(
                    msg=(f"{router} does not list {url}: it was taken out and not put back; restart that router "
                         "process (the role's restart.yml) so it reads its command line again"), routers=results)
        if module.params["state"] == "present" and module.params["healthy"]:
            deadline = time.monotonic() + module.params["timeout"]
            for entry in results:
                while not healthy(entry["router"], url):
                    if time.monotonic() > deadline:
                        module.fail_json(msg=f"{entry['router']} lists {url} but does not count it healthy after "
                                             f"{module.params['timeout']} s", routers=results)
                    time.sleep(1)
                entry["healthy"] = True
    except OSError as exc:
        module.fail_json(msg=str(exc), routers=results)
    module.exit_json(changed=changed, routers=results, removed=[], routers_down=[])


if __name__ == "__main__":
    main()
