# Copyright (c) inferops.vllm contributors
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The elements of an nftables address set, from a list of addresses and CIDRs.

Documented in nft_elements.yml beside this file; roles/vllm_firewall uses it. nft refuses a set with
``flags interval`` whose elements overlap ("conflicting intervals specified"), e.g. 10.0.0.0/8 and a
router's 10.1.2.3; merged here, the list never overlaps, is sorted, and is the same on every run.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping

from ansible.errors import AnsibleFilterError

FAMILIES = ("ipv4", "ipv6")


def _element(net) -> str:
    """10.1.2.3 for a single address, 10.0.0.0/8 for a network (IPv6 in its short form)."""
    if net.prefixlen == net.max_prefixlen:
        return str(net.network_address)
    return net.with_prefixlen


def nft_elements(values, family=None, what="the addresses"):
    if values is None:
        values = []
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise AnsibleFilterError(
            f"{what}: is {values!r}, not a list; list IPv4/IPv6 addresses or CIDRs, e.g. [10.20.0.15, 10.30.0.0/24]."
        )
    if family is not None and family not in FAMILIES:
        raise AnsibleFilterError(f"nft_elements: family is {family!r}; use ipv4, ipv6 or leave it out for both.")
    nets = {4: [], 6: []}
    bad = []
    for value in values:
        text = str(value).strip()
        try:
            # A zone (fe80::1%eth0) is no address nft takes; host bits (10.1.2.3/8) are dropped, as the
            # PD preflight (inferops.vllm.pd_preflight) reads such a CIDR.
            if "%" in text:
                raise ValueError(text)
            net = ipaddress.ip_network(text, strict=False)
        except ValueError:
            bad.append(text)
            continue
        nets[net.version].append(net)
    if bad:
        raise AnsibleFilterError(
            f"{what}: {', '.join(repr(b) for b in bad)} {'is' if len(bad) == 1 else 'are'} no IP address or CIDR "
            "(nftables takes addresses, not host names); list IPv4/IPv6 addresses or CIDRs such as 10.20.0.15, "
            "10.30.0.0/24 or fd00:10::/64."
        )
    out = {
        name: [_element(net) for net in ipaddress.collapse_addresses(nets[version])]
        for name, version in (("ipv4", 4), ("ipv6", 6))
    }
    return out if family is None else out[family]


class FilterModule:
    def filters(self):
        return {"nft_elements": nft_elements}
