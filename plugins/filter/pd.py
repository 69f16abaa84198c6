# Copyright (c) inferops.vllm contributors
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Filters that turn the inventory's prefill/decode hosts into the list of their instances.

Documented in pd_instances.yml and url_host.yml beside this file.
"""

from __future__ import annotations

import ipaddress

from ansible.errors import AnsibleFilterError

PUBLISHED = "__vllm_instance_published"


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
            defaults = published.get("settings") or {}
            for inst in published["instances"]:
                settings = dict(defaults)
                settings.update(inst.get("overrides") or {})
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


class FilterModule:
    def filters(self):
        return {"pd_instances": pd_instances, "url_host": url_host}
