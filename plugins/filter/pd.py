# Copyright (c) inferops.vllm contributors
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Filters that turn the inventory's prefill/decode hosts into the list of their instances, and the router
hosts into the address clients reach the front at.

Documented in pd_instances.yml, url_host.yml, front_endpoint.yml and rollout_batch_problems.yml beside this file.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping

from ansible.errors import AnsibleFilterError

# The record roles/vllm_instance/tasks/publish.yml sets on each prefill and decode host.
PUBLISHED = "vllm_instance_published"


def url_host(host):
    """The host part of a URL: an IPv6 literal in brackets (fd00::1 -> [fd00::1]), anything else as it is."""
    text = str(host).strip()
    if text.startswith("["):
        return text
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return text
    return f"[{text}]" if address.version == 6 else text


def pd_instances(hostvars, prefill_hosts, decode_hosts):
    missing = []
    out = []
    for group, hosts in (("prefill", prefill_hosts or []), ("decode", decode_hosts or [])):
        for host in hosts:
            published = hostvars[host].get(PUBLISHED) if host in hostvars else None
            if not published:
                missing.append(host)
                continue
            for inst in published["instances"]:
                # Merged once by the publish tasks; a record built by hand may give the host's and overrides.
                settings = inst.get("settings") or {**(published.get("settings") or {}),
                                                    **(inst.get("overrides") or {})}
                block_size = int(settings.get("block_size") or 0)
                out.append(
                    {
                        "name": inst["name"],
                        "host": host,
                        "role": group,
                        "url": f"http://{url_host(published['address'])}:{int(inst['port'])}",
                        "port": int(inst["port"]),
                        "kv_transfer_port": int(inst["kv_transfer_port"]),
                        "shutdown_timeout": int(settings.get("shutdown_timeout") or 0),
                        "expected": {
                            "kv_cache_dtype": settings.get("kv_cache_dtype", "auto"),
                            "block_size": block_size or None,
                        },
                    }
                )
    if missing:
        raise AnsibleFilterError(
            "these prefill/decode hosts published no instances in this run: "
            + ", ".join(missing)
            + ". Run the play on them too (no --limit that leaves them out), so the vllm_instance role publishes them."
        )
    return out


# The record roles/vllm_router/tasks/publish.yml sets on each router host: the front's port, bind address,
# server name and TLS as the role resolved them (its defaults included), so none is repeated here.
ROUTER_PUBLISHED = "vllm_router_published"
WILDCARDS = ("0.0.0.0", "::", "[::]", "*", "")
LOOPBACKS = ("localhost", "ip6-localhost", "ip6-loopback")


def _is_loopback(host):
    text = str(host).strip().strip("[]").lower()
    if text in LOOPBACKS:
        return True
    try:
        return ipaddress.ip_address(text).is_loopback
    except ValueError:
        return False


def front_endpoint(hostvars, groups, options=None):
    """Where clients reach the authenticating front of the first router host (see front_endpoint.yml)."""
    opts = dict(options or {})
    routers = [str(h) for h in (groups or {}).get("router") or []]
    out = {"router": None, "routers": routers, "host": None, "host_source": None, "port": None, "tls": None,
           "scheme": None, "url": None, "api_url": None, "problems": []}
    if not routers:
        out["problems"].append(
            "[front] router: the inventory has no router host, and clients reach the service only through the "
            "router host's front. Fix: put the host that runs vllm-router and its front (deploy_pd.yml's router "
            "play) in the router group.")
        return out
    router = routers[0]
    variables = hostvars[router] if router in hostvars else {}
    # Imported on use, not with this file: see plugins/filter/preflight.py on why.
    from ansible_collections.inferops.vllm.plugins.plugin_utils._pd_values import host_var

    published, state = host_var(variables, ROUTER_PUBLISHED)
    if state != "set" or not isinstance(published, Mapping):
        out["router"] = router
        out["problems"].append(
            f"[front] {router}: {ROUTER_PUBLISHED}: the router host published no settings in this run, so where "
            "its front listens is unknown. Fix: run the play on the router host too (no --limit that leaves it "
            "out); the first play of playbooks/client_config.yml and playbooks/benchmark.yml publishes it "
            "(the vllm_router role's tasks_from: publish), contacting no host.")
        return out
    port = published.get("front_port")
    bind = str(published.get("front_bind") or "")
    tls = str(published.get("tls")).strip().lower() in ("true", "yes", "1")
    server_name = str(published.get("front_server_name") or "").strip()
    override = str(opts.get("host") or "").strip()
    if override:
        host, source = override, opts.get("host_variable") or "the host option"
    elif server_name and server_name != "_":
        host, source = server_name, "vllm_router_front_server_name"
    elif bind.strip() not in WILDCARDS and not _is_loopback(bind):
        host, source = bind.strip(), "vllm_router_front_bind"
    else:
        host = str(published.get("ansible_host") or "").strip() or router
        source = "ansible_host" if host != router else "inventory_hostname"
    out.update(router=router, host=host, host_source=source, tls=tls, scheme="https" if tls else "http")
    try:
        out["port"] = int(port)
    except (TypeError, ValueError):
        out["problems"].append(f"[front] {router}: vllm_router_front_port: is {port!r}, not a port number. "
                               "Fix: set the front's port (default 8000).")
        return out
    if not override and _is_loopback(bind):
        out["problems"].append(
            f"[front] {router}: vllm_router_front_bind: is {bind!r}, so the front listens on the router host's "
            "loopback only and no client elsewhere reaches it. Fix: bind it to an address clients reach (default "
            f"0.0.0.0), or name the address of a proxy that forwards to it in {opts.get('host_variable') or 'host'}.")
    if not override and _is_loopback(host):
        out["problems"].append(
            f"[front] {router}: {source}: is {host!r}, a loopback address that only the router host itself "
            f"reaches. Fix: set the address or name clients use in {opts.get('host_variable') or 'host'}.")
    out["url"] = f"{out['scheme']}://{url_host(host)}:{out['port']}"
    out["api_url"] = f"{out['url']}/v1"
    return out


def _batch_sizes(serial, count):
    """Ansible's batches for a play's ``serial`` over ``count`` hosts: a whole number or "N%" (of the play's hosts,
    at least 1), or a list of them whose last one repeats; a percentage rounds down as Ansible's pct_to_int does."""
    values = serial if isinstance(serial, (list, tuple)) else [serial]
    sizes = []
    for value in values or [count]:
        text = str(value).strip()
        try:
            size = int(float(text[:-1]) / 100.0 * count) if text.endswith("%") else int(text)
        except ValueError as exc:
            raise AnsibleFilterError(
                f"vllm_rollout_serial is {value!r}: give a whole number of hosts or a percentage such as '25%'."
            ) from exc
        sizes.append(max(size, 1) if size > 0 or text.endswith("%") else count)
    return sizes


def rollout_batch_problems(plan, pools, hosts, serial):
    """Where ``serial`` (vllm_rollout_serial) would take a whole pool out of the routers at once: each host of a
    batch rolls one of its instances at a time, side by side with the batch's other hosts, so a batch whose hosts
    hold every instance of a pool (one each, all in ``plan``) empties that pool and every request fails. ``pools``
    maps prefill/decode to their sizes, ``hosts`` maps them to the roll play's hosts in order. One line per pool
    and batch; a pool of one instance is the rollout's other rule (vllm_rollout_allow_downtime)."""
    problems = []
    for role in ("decode", "prefill"):
        size = int((pools or {}).get(role) or 0)
        order = list((hosts or {}).get(role) or [])
        if size < 2 or not order:
            continue
        rolling = {item["host"] for item in plan or [] if item.get("role") == role}
        sizes, start, index = _batch_sizes(serial, len(order)), 0, 0
        while start < len(order):
            batch = order[start:start + sizes[min(index, len(sizes) - 1)]]
            start, index = start + len(batch), index + 1
            out = [h for h in batch if h in rolling]
            if len(out) >= size:
                names = [item["name"] for item in plan if item.get("role") == role and item["host"] in out]
                problems.append(
                    f"vllm_rollout_serial {serial!r} rolls the hosts {', '.join(out)} side by side, and they hold "
                    f"every instance of the {role} pool ({', '.join(names)}): each takes one out of the routers at "
                    f"the same time, the pool would be empty and every request would fail. Nothing was changed. Use a "
                    f"smaller vllm_rollout_serial (at most {size - 1} of the pool's {size} hosts at a time), or accept "
                    "the interruption with -e vllm_rollout_allow_downtime=true."
                )
    return problems


class FilterModule:
    def filters(self):
        return {"pd_instances": pd_instances, "url_host": url_host, "front_endpoint": front_endpoint,
                "rollout_batch_problems": rollout_batch_problems}
