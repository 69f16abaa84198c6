# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Faults put into the sandbox's and molecule's containers, shared by benchmarks/chaos.py and the molecule tests."""

from __future__ import annotations


def kill_vllm_command(units: list[str]) -> str:
    """A shell command that SIGKILLs the vLLM process of each unit (the launcher's one child, vLLM's API server) and
    fails unless each unit has exactly one. vLLM dies as in a crash; the launcher reaps what vLLM left (its engine and
    worker), then exits of the same signal, and systemd sees the unit fail (Restart=on-failure).

    Not `systemctl kill -s KILL` of the whole unit: why is in docs/testing.md (a cgroup v1 host makes the containers'
    systemd wait the unit's TimeoutStopSec after every process of the unit died at once)."""
    kills = [
        f'p=$(pgrep -P "$(systemctl show -p MainPID --value {unit})"); '
        f'[ "$(echo "$p" | wc -w)" = 1 ] || {{ echo "{unit}: no single vLLM process: $p" >&2; exit 1; }}; '
        f'kill -9 "$p"'
        for unit in units
    ]
    return " && ".join(f"( {kill} )" for kill in kills)


def peer_block_rules(table: str, peer: str, action: str = "drop") -> str:
    """An nftables ruleset (for `nft -f -` on the prefill host) in its own table ``table``, so that deleting that
    table undoes it and nothing else: every packet from and to ``peer`` (an address) gets ``action``.

    ``drop`` is a path that went silent (a cable, a switch: the sender retries until its timeout); ``reject`` answers
    each TCP packet from the peer with a reset (a host or firewall that refuses: the sender fails at once)."""
    verdicts = {"drop": ("drop", "drop"), "reject": ("meta l4proto tcp reject with tcp reset", None)}
    if action not in verdicts:
        raise ValueError(f"action must be one of {sorted(verdicts)}, not {action!r}")
    incoming, outgoing = verdicts[action]
    chains = [f"  chain input {{ type filter hook input priority -300; ip saddr {peer} {incoming}; }}"]
    if outgoing:
        chains.append(f"  chain output {{ type filter hook output priority -300; ip daddr {peer} {outgoing}; }}")
    return f"table inet {table} {{\n" + "\n".join(chains) + "\n}\n"
