# Copyright (c) inferops.vllm contributors
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Each vLLM instance's config.toml, rendered by one function: the role writes it, the preflight checks it.

PRIVATE to the inferops.vllm collection: no compatibility promise; anything here may change or go in
any release. Other collections must not import it.

render_text() is the only renderer of the file. The vllm_instance role writes its result on each host
(tasks/configure.yml, through the inferops.vllm.instance_toml filter); the controller-side preflight's
launcher check renders the same text from what the host published (render()), reads it back with tomllib
and runs the launcher's own validate() on it, so it judges the bytes the host would get.

It walks the launcher's schema (plugins/module_utils/_vllm_instance_schema.py): sections and keys in SCHEMA's
order; a key with a Key.setting takes that per-instance setting, converted by the key's kind and left out by
Key.omit / Key.unless; the other keys come from the instance's entry and its host (the tables below). So a
new vLLM setting is one Key in the schema (with its setting), and its variable in the role's defaults and
argument spec: nothing here changes.

Its conversions (as_int, as_float, as_bool, and JSON strings) are those of the Jinja template the role used
before (Jinja's ``| int`` and ``| float``, Ansible's ``| bool``, ``| to_json``): the files it writes are the
same, byte for byte. toml_variable() names the inventory variable a TOML key comes from, for the
preflight's messages.
"""

from __future__ import annotations

import json
import re
from collections import ChainMap
from collections.abc import Callable, Mapping
from typing import Any

from ansible_collections.inferops.vllm.plugins.module_utils import _vllm_instance_schema as schema
from ansible_collections.inferops.vllm.plugins.plugin_utils import _kv_fabric
from ansible_collections.inferops.vllm.plugins.plugin_utils._pd_instance import SETTING_DEFAULTS, Instance
from ansible_collections.inferops.vllm.plugins.plugin_utils._pd_values import host_var, text

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - the controller runs Python 3.11+
    tomllib = None

# TOML key -> where its value comes from, for the messages: a variable, "setting:<key>" (a per-instance
# setting: vllm_instance_<key>, or the instance's overrides.<key>) or "instance:<key>" (a key of the
# instance's entry in vllm_instance_instances). The keys the schema gives a Key.setting need no entry.
TOML_SOURCES = {
    "server": "vllm_instance_instances",
    "server.host": "vllm_instance_bind_host",
    "server.port": "instance:port",
    "server.served_model_name": "vllm_instance_served_model_name",
    "server.api_keys_file": "vllm_instance_api_key",
    "server.allowed_media_domains": "vllm_instance_allowed_media_domains",
    "model": "vllm_instance_model",
    "model.name": "vllm_instance_model",
    "model.revision": "vllm_instance_model_revision",
    "model.identity": "vllm_instance_model",
    "kv_cache": "vllm_instance_instances",
    "scheduler": "vllm_instance_instances",
    "pd_disaggregation": "vllm_instance_pd_role",
    "pd_disaggregation.enabled": "vllm_instance_pd_role",
    "pd_disaggregation.role": "vllm_instance_pd_role",
    "pd_disaggregation.kv_transfer_backend": "vllm_instance_kv_transfer_backend",
    "pd_disaggregation.side_channel_host": "vllm_instance_host_address",
    "pd_disaggregation.kv_transfer_port": "instance:kv_transfer_port",
    "cpu.omp_threads_bind": "instance:cpus",
    "devices.cuda_visible_devices": "instance:gpus",
    "kv_fabric": "setting:kv_transport",
    "kv_fabric.transport": "setting:kv_transport",
    "kv_fabric.net_devices": "setting:ucx_net_devices",
    "kv_fabric.tls": "setting:ucx_tls",
    "kv_fabric.ib_gid_index": "setting:ucx_ib_gid_index",
    "environment": "setting:environment",
    "extra": "setting:extra_args",
}
# The role's defaults (roles/vllm_instance/defaults/main.yml) of what the TOML needs beyond the
# published settings; hostvars hold a variable only when the inventory sets it.
INSTANCE_DEFAULTS = {"vllm_instance_bind_host": "0.0.0.0", "vllm_instance_models_dir": "/var/lib/vllm/models",
                     "vllm_instance_environment": {}, "vllm_instance_extra_args": [],
                     "vllm_instance_allowed_media_domains": [], "vllm_instance_config_dir": "/etc/vllm"}
# The role's vars the TOML's comments name (roles/vllm_instance/vars/main.yml), for a render without them.
HOST_DEFAULTS = {"managed": "Ansible managed", "venv": "/opt/vllm/venv",
                 "launcher": "/usr/local/lib/inferops-vllm/inferops_vllm_launch.py",
                 "config_dir": "/etc/vllm", "stop_dropin": "inferops-stop-timeout.conf", "stop_margin": 15}
# Sections written even when empty; the others only when they hold a key ([cpu] on the cpu build).
ALWAYS_SECTIONS = ("server", "model", "kv_cache", "scheduler", "pd_disaggregation")
BARE_KEY_RE = re.compile(r"[A-Za-z0-9_-]+")

Variables = Mapping[str, Any]


class RenderError(ValueError):
    """A value no TOML can be rendered from; ``variable`` names its source (``environment``, ...)."""

    def __init__(self, variable: str, what: str) -> None:
        super().__init__(f"{variable} {what}")
        self.variable = variable
        self.what = what


# --- conversions (those of the Jinja template the role used before) --------------------------------------


def as_int(value: Any) -> int:
    """Jinja's ``| int``: 0 when the value is no number."""
    try:
        return int(value, 10) if isinstance(value, str) else int(value)
    except (TypeError, ValueError, OverflowError):
        try:
            return int(float(value))
        except (TypeError, ValueError, OverflowError):
            return 0


def as_float(value: Any) -> float:
    """Jinja's ``| float``: 0.0 when the value is no number."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def as_bool(value: Any) -> bool:
    """Ansible's ``| bool`` (ansible-core 2.19): yes/on/true/1 in any case, the booleans and 1."""
    if isinstance(value, str):
        return value.lower() in ("yes", "on", "true", "1")
    if isinstance(value, int):
        return str(value).lower() in ("true", "1")
    try:
        return bool(value == 1)
    except Exception:  # noqa: BLE001 - what cannot be compared is not true
        return False


def toml_value(value: Any) -> str:
    """A TOML value: strings as JSON strings (Ansible's ``to_json``, which TOML reads alike), arrays and inline
    tables of such values."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # TOML has no null: what is in an array of a key of another kind (refused)


def toml_key(key: Any) -> str:
    key = str(key)
    return key if BARE_KEY_RE.fullmatch(key) else json.dumps(key)


def _empty(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, (str, list, tuple, Mapping)):
        return len(value) == 0
    return not text(value)


def _of_kind(spec: schema.Key, value: Any) -> Any:
    """A setting's value as its key's kind (Jinja's conversions): int, bool, fraction, a list of strings."""
    if spec.kind == "int":
        return as_int(value)
    if spec.kind == "bool":
        return as_bool(value)
    if spec.kind == "fraction":
        return as_float(value)
    if spec.kind in ("str_list", "url_list"):
        if not isinstance(value, (list, tuple)):
            raise RenderError(spec.setting, f"is {kind(value)}, not a list of {LIST_OF.get(spec.setting, 'strings')}.")
        return [str(item) for item in value]
    return value


def _omitted(spec: schema.Key, value: Any, written: Mapping[str, Any]) -> bool:
    if value is None or (spec.unless and spec.unless in written):
        return True
    if spec.omit == "not_positive":
        return as_int(value) <= 0
    if spec.omit == "empty":
        return _empty(value)
    return False


# --- the keys that come from the instance's entry and its host --------------------------------------------

OMIT = object()  # a key that is not written
# What a list setting lists, for the message when it is no list.
LIST_OF = {"extra_args": "vLLM flags and values"}


def _pd(key: str) -> Callable[[Mapping, Mapping], Any]:
    """A [pd_disaggregation] key, written when the instance transfers KV."""
    values = {"role": lambda i, h: h["pd_role"], "kv_transfer_backend": lambda i, h: h["kv_transfer_backend"],
              "side_channel_host": lambda i, h: h["host_address"],
              "kv_transfer_port": lambda i, h: as_int(i.get("kv_transfer_port"))}
    return lambda i, h: values[key](i, h) if h["pd_role"] != "none" else OMIT


def _media_domains(_instance: Mapping, host: Mapping) -> Any:
    domains = host["allowed_media_domains"]
    if not isinstance(domains, (list, tuple)):
        raise RenderError("vllm_instance_allowed_media_domains", f"is {kind(domains)}, not a list of host names.")
    return [str(d) for d in domains]


def _cpus(instance: Mapping, _host: Mapping) -> Any:
    cpus = str(instance["cpus"]) if "cpus" in instance else ""
    return cpus or OMIT


def _gpus(instance: Mapping, _host: Mapping) -> Any:
    gpus = instance.get("gpus") or []
    gpus = gpus if isinstance(gpus, (list, tuple, str)) else [gpus]
    return ",".join(str(g) for g in gpus) or OMIT


def _fabric(key: str) -> Callable[[Mapping, Mapping], Any]:
    def value(instance: Mapping, _host: Mapping) -> Any:
        table = instance.get("kv_fabric")
        return table[key] if isinstance(table, Mapping) and key in table else OMIT
    return value


VALUES: dict[tuple[str, str], Callable[[Mapping, Mapping], Any]] = {
    ("server", "host"): lambda i, h: h["bind_host"],
    ("server", "port"): lambda i, h: as_int(i.get("port")),
    ("server", "served_model_name"): lambda i, h: h["served_model_name"],
    ("server", "api_keys_file"): lambda i, h: f"{h['config_dir']}/api-keys" if as_bool(h["api_key_set"]) else OMIT,
    ("server", "allowed_media_domains"): _media_domains,
    ("model", "name"): lambda i, h: h["model_path"],
    ("model", "identity"): lambda i, h: text(h.get("model_identity")) or OMIT,
    ("pd_disaggregation", "enabled"): lambda i, h: h["pd_role"] != "none",
    **{("pd_disaggregation", key): _pd(key)
       for key in ("role", "kv_transfer_backend", "side_channel_host", "kv_transfer_port")},
    ("cpu", "omp_threads_bind"): _cpus,
    ("devices", "cuda_visible_devices"): _gpus,
    **{("kv_fabric", key): _fabric(key) for key in ("transport", "net_devices", "tls", "ib_gid_index")},
}
# Settings' keys written for some PD roles only (the others: for every instance that transfers KV).
PD_ROLES_OF = {"kv_load_failure_policy": ("decode",)}

# The comment lines before a key (str.format()ed with the instance's name and the host's values).
COMMENTS = {
    ("server", "api_keys_file"):
        "The keys are in this file (0640), never here; the middleware re-reads it when it changes (rotations).",
    ("server", "shutdown_timeout"):
        "Drain on stop: a stop gives running requests this many seconds (0 aborts them); the unit's\n"
        "drop-in vllm@{name}.service.d/{stop_dropin} waits {stop_margin} s longer.",
    ("server", "allowed_media_domains"):
        "Hosts whose http(s) media URLs a multimodal request may make vLLM fetch (exact names); [] = none.",
    ("model", "identity"):
        "The weights in that directory (the copy's fingerprint, or the hub revision): prefill and decode must\n"
        "load the same ones, so a change on running instances is refused (no rolling restart can carry it).",
    ("kv_cache", "quant_dtype"): "The sources' quant_dtype: the KV cache dtype (fp8 halves KV memory).",
    ("pd_disaggregation", "side_channel_host"): "NIXL side channel: peers connect here to exchange KV metadata.",
    ("pd_disaggregation", "kv_load_failure_policy"):
        'A failed KV load from prefill: "recompute" the prompt here, or "fail" the request.',
    ("kv_fabric", "transport"):
        "How this instance's KV travels to its peers (NIXL over UCX): {transport}{rdma_note}.\n"
        "The launcher exports net_devices, tls and ib_gid_index as UCX_NET_DEVICES, UCX_TLS, UCX_IB_GID_INDEX.",
}
# The comment lines at the end of a section (when it has a key).
TRAILERS = {
    "pd_disaggregation": "No peer lists: the router alone keeps them, so adding or removing a prefill or decode host\n"
                         "changes no instance's config and restarts none.",
}
RDMA_NOTE = " (UCX_NET_DEVICES: the RDMA ports nearest its GPUs, unless set)"


def _comment(lines: list[str], comment: str, fields: Mapping[str, Any]) -> None:
    lines.extend("# " + line for line in comment.format_map(fields).split("\n"))


def _managed(text_: str) -> list[str]:
    """Ansible's ``{{ ansible_managed | comment }}`` (the plain style)."""
    return ["#", *("# " + line if line else "#" for line in text_.split("\n")), "#"]


def _section(section: str, keys: Mapping[str, schema.Key], instance: Mapping, settings: Mapping,
             host: Mapping, fields: Mapping[str, Any]) -> list[str] | None:
    """The lines of one section, or None when it is not written."""
    lines: list[str] = []
    written: dict[str, Any] = {}
    for key, spec in keys.items():
        if spec.setting:
            role = host["pd_role"]
            if section == "pd_disaggregation" and (role == "none" or role not in PD_ROLES_OF.get(key, (role,))):
                continue
            value = settings.get(spec.setting, SETTING_DEFAULTS.get(spec.setting))
            if _omitted(spec, value, written):
                continue
            value = _of_kind(spec, value)
        elif (section, key) in VALUES:
            value = VALUES[section, key](instance, host)
            if value is OMIT:
                continue
        else:
            continue
        if (section, key) in COMMENTS:
            _comment(lines, COMMENTS[section, key], fields)
        lines.append(f"{key} = {toml_value(value)}")
        written[key] = value
    if section == "environment":
        environment = settings.get("environment")
        if environment is not None and not isinstance(environment, Mapping):
            raise RenderError("environment", f"is {kind(environment)}, not a mapping of NAME: value.")
        # Jinja's dictsort: by name, case-insensitively.
        for name, value in sorted((environment or {}).items(), key=lambda item: str(item[0]).lower()):
            lines.append(f"{toml_key(name)} = {toml_value(str(value))}")
    if section in TRAILERS and (section != "pd_disaggregation" or host["pd_role"] != "none"):
        _comment(lines, TRAILERS[section], fields)
    wanted = section in ALWAYS_SECTIONS or (section == "cpu" and as_bool(host["cpu_build"]))
    return lines if lines or wanted else None


def render_text(instance: Mapping[str, Any], settings: Mapping[str, Any], host: Mapping[str, Any]) -> str:
    """The config.toml of one instance.

    ``instance``: its entry in vllm_instance_instances as placed (name, port, kv_transfer_port; cpus, gpus,
    kv_fabric when it has them). ``settings``: the per-instance settings (_vllm_instance_settings updated by
    its overrides; environment and extra_args included). ``host``: pd_role, bind_host, served_model_name,
    api_key_set, config_dir, allowed_media_domains, model_path, model_identity (may be empty: not written),
    kv_transfer_backend, host_address, cpu_build,
    inventory_hostname, and for the comments managed, venv, launcher, stop_dropin, stop_margin (HOST_DEFAULTS).
    Raises RenderError for a value no TOML can be rendered from.
    """
    # Looked up, never copied: a value the file does not use is not resolved (the host's address without PD).
    host = ChainMap(host, HOST_DEFAULTS)
    name, role = str(instance.get("name")), str(host["pd_role"])
    fabric = instance.get("kv_fabric")
    transport = str(fabric.get("transport")) if isinstance(fabric, Mapping) else ""
    fields = host.new_child({"name": name, "transport": transport,
                             "rdma_note": RDMA_NOTE if transport == "rdma" else ""})
    what = {"prefill": " (produces KV)", "decode": " (consumes KV)"}.get(role, "")
    lines = [
        *_managed(str(host["managed"])),
        f'# vLLM instance "{name}" on {host["inventory_hostname"]}: {role}{what}.',
        "# Rendered by the inferops.vllm.vllm_instance role from the inventory; edits here are overwritten.",
        f"# Check by hand: {host['venv']}/bin/python {host['launcher']} --check --config "
        f"{host['config_dir']}/{name}.toml",
    ]
    for section, keys in schema.SCHEMA.items():
        body = _section(section, keys, instance, settings, host, fields)
        if body is not None:
            lines += ["", f"[{section}]", *body]
    return "\n".join(lines) + "\n"


# --- the preflight: the same text from what a host published ----------------------------------------------


def kind(value: Any) -> str:
    """What a value is, in words ("a string", "a mapping", ...), for messages that must not show it."""
    for types, name in ((bool, "a boolean"), (str, "a string"), (int, "an integer"), (float, "a number"),
                        (Mapping, "a mapping"), (list, "a list")):
        if isinstance(value, types):
            return name
    return "null" if value is None else type(value).__name__


def role_var(variables: Variables | None, name: str) -> Any:
    """A vllm_instance variable of a host as the role sees it: the host's, else the role's default."""
    if variables is not None:
        value, state = host_var(variables, name)
        if state == "set":
            return value
    return INSTANCE_DEFAULTS[name]


def unpublished(inst: Instance, variables: Variables | None, key: str) -> tuple[Any, str]:
    """(value, variable) of environment or extra_args for one instance. publish.yml leaves them out (they may
    carry site secrets), so they are read from the host's variables: the instance's overrides, else
    vllm_instance_<key>, else the role's default. Plain data may carry them in the settings."""
    if key in inst.settings:
        return inst.settings[key], inst.variable(key)
    if variables is not None:
        try:
            entries, state = host_var(variables, "vllm_instance_instances")
            if state == "set" and isinstance(entries, (list, tuple)) and inst.index < len(entries):
                entry = entries[inst.index]
                overrides = entry.get("overrides") if isinstance(entry, Mapping) else None
                if isinstance(overrides, Mapping) and key in overrides:
                    return overrides[key], f"vllm_instance_instances[{inst.name}].overrides.{key}"
        except Exception:  # noqa: BLE001 - an entry that cannot be resolved: the other checks say why
            pass
    name = f"vllm_instance_{key}"
    return role_var(variables, name), name


def side_channel_host(inst: Instance, variables: Variables | None) -> str:
    """What the role renders as side_channel_host: vllm_instance_host_address when the inventory sets it
    (resolvable without facts), else the default route's address, which facts give at deploy time and which
    is never empty (the published stand-in, else the host's name, represents it)."""
    if variables is not None:
        address, state = host_var(variables, "vllm_instance_host_address")
        if state == "set":
            return text(address)
    return text(inst.published.get("address")) or inst.host


def _model_path(inst: Instance, variables: Variables | None) -> str:
    """roles/vllm_instance/vars/main.yml _vllm_instance_model_path: the models directory and the model's."""
    model = text(inst.published.get("model"))
    local = as_bool(inst.published.get("model_is_local"))
    dirname = model.rstrip("/").rsplit("/", 1)[-1] if local else model.replace("/", "--")
    return f"{text(role_var(variables, 'vllm_instance_models_dir'))}/{dirname}"


def _entry(inst: Instance) -> dict[str, Any]:
    """The instance's entry as the role places it: its published entry, and the [kv_fabric] table of its
    settings alone (on the host an rdma instance also gets the ports nearest its GPUs and their RoCE GID
    index, which only the host's facts give)."""
    entries = inst.published.get("instances") or []
    entry = entries[inst.index] if inst.index < len(entries) and isinstance(entries[inst.index], Mapping) else {}
    placed = {**entry, "name": inst.name, "port": inst.port, "kv_transfer_port": inst.kv_transfer_port}
    if text(inst.published.get("pd_role")) != "none":
        placed["kv_fabric"] = _kv_fabric.table(inst.settings, inst.variant)[0]
    return placed


def render(inst: Instance, variables: Variables | None
           ) -> tuple[dict[str, Any], dict[str, str], list[tuple[str, str]]]:
    """The TOML the role would write for one instance (render_text() on what its host published, read back),
    where its environment and extra args come from, and what cannot be rendered (variable, what is wrong;
    left out of the TOML). ``variables``: the host's variables."""
    sources: dict[str, str] = {}
    unrenderable: list[tuple[str, str]] = []
    settings = dict(inst.settings)
    for key in ("environment", "extra_args"):
        settings[key], sources[key] = unpublished(inst, variables, key)
    pub = inst.published
    host = {
        "inventory_hostname": inst.host, "pd_role": text(pub.get("pd_role")),
        "bind_host": role_var(variables, "vllm_instance_bind_host"),
        "served_model_name": text(pub.get("served_model_name")),
        "api_key_set": pub.get("api_key_set") is True or text(pub.get("api_key_set")).lower() == "true",
        "config_dir": text(role_var(variables, "vllm_instance_config_dir")),
        "allowed_media_domains": role_var(variables, "vllm_instance_allowed_media_domains"),
        "model_path": _model_path(inst, variables),
        "model_identity": text(pub.get("model_identity")),
        "kv_transfer_backend": pub.get("kv_transfer_backend", "nixl"),
        "host_address": side_channel_host(inst, variables),
        "cpu_build": inst.variant == "cpu",
    }
    while True:
        try:
            return tomllib.loads(render_text(_entry(inst), settings, host)), sources, unrenderable
        except RenderError as exc:  # say so, and render the rest without it
            if exc.variable in settings and settings[exc.variable] is not None:
                unrenderable.append((sources.get(exc.variable) or inst.variable(exc.variable), exc.what))
                settings[exc.variable] = None
            elif exc.variable == "vllm_instance_allowed_media_domains" and host["allowed_media_domains"]:
                unrenderable.append((exc.variable, exc.what))
                host["allowed_media_domains"] = []
            else:
                raise


def _source(key: str) -> str | None:
    """Where a TOML key's value comes from (TOML_SOURCES, or the setting its schema Key names)."""
    section, _sep, name = key.partition(".")
    spec = schema.SCHEMA.get(section, {}).get(name)
    if spec is not None and spec.setting:
        return "setting:" + spec.setting
    return TOML_SOURCES.get(key) or TOML_SOURCES.get(section)


def toml_variable(inst: Instance, key: str, sources: Mapping[str, str]) -> str:
    """The inventory variable a TOML key (``section.key``, ``extra.args[2]``, ``environment.NAME``) comes from."""
    key = re.sub(r"\[\d+\]$", "", key)
    source = _source(key) or "vllm_instance_instances"
    kind_, _sep, name = source.partition(":")
    if not name:
        return source
    if kind_ == "instance":
        return f"vllm_instance_instances[{inst.name}].{name}"
    if name in sources:
        return sources[name]
    return inst.variable(name)


def toml_role_variable(key: str) -> str:
    """The role variable a TOML key comes from, the same on every host (for a fix shared by many hosts)."""
    kind_, _sep, name = (_source(key) or "vllm_instance_instances").partition(":")
    if not name:
        return kind_
    if kind_ == "instance":
        return f"vllm_instance_instances[*].{name}"
    return f"vllm_instance_{name} (or an instance's overrides.{name})"
