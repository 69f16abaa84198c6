# Copyright (c) inferops.vllm contributors
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The TOML the vllm_instance role would render for one instance, built on the controller.

PRIVATE to the inferops.vllm collection: no compatibility promise; anything here may change or go in
any release. Other collections must not import it.

render() is roles/vllm_instance/templates/instance.toml.j2 in Python, with the template's Jinja
conversions (``| int``, ``| bool``), so the preflight can run the launcher's own validate() on what the
host would get (tests/unit/test_instance_templates.py keeps the two equal). toml_variable() names the
inventory variable a TOML key comes from, for the preflight's messages.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ansible_collections.inferops.vllm.plugins.plugin_utils import _kv_fabric
from ansible_collections.inferops.vllm.plugins.plugin_utils._pd_instance import Instance
from ansible_collections.inferops.vllm.plugins.plugin_utils._pd_values import host_var, text

# TOML key of templates/instance.toml.j2 -> where its value comes from: a variable, "setting:<key>" (a
# per-instance setting: vllm_instance_<key>, or the instance's overrides.<key>) or "instance:<key>" (a
# key of the instance's entry in vllm_instance_instances).
TOML_SOURCES = {
    "server": "vllm_instance_instances",
    "server.host": "vllm_instance_bind_host",
    "server.port": "instance:port",
    "server.served_model_name": "vllm_instance_served_model_name",
    "server.api_keys_file": "vllm_instance_api_key",
    "server.shutdown_timeout": "setting:shutdown_timeout",
    "server.allowed_media_domains": "vllm_instance_allowed_media_domains",
    "model": "vllm_instance_model",
    "model.name": "vllm_instance_model",
    "model.revision": "vllm_instance_model_revision",
    "kv_cache.quant_dtype": "setting:kv_cache_dtype",
    "kv_cache.memory_bytes": "setting:kv_cache_memory_bytes",
    "pd_disaggregation": "vllm_instance_pd_role",
    "pd_disaggregation.enabled": "vllm_instance_pd_role",
    "pd_disaggregation.role": "vllm_instance_pd_role",
    "pd_disaggregation.kv_transfer_backend": "vllm_instance_kv_transfer_backend",
    "pd_disaggregation.kv_buffer_device": "setting:kv_buffer_device",
    "pd_disaggregation.side_channel_host": "vllm_instance_host_address",
    "pd_disaggregation.kv_transfer_port": "instance:kv_transfer_port",
    "pd_disaggregation.kv_load_failure_policy": "setting:kv_load_failure_policy",
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
# The other keys of these sections are the per-instance settings of the same name.
SETTING_SECTIONS = ("model", "kv_cache", "scheduler")
# The role's defaults (roles/vllm_instance/defaults/main.yml) of what the TOML needs beyond the
# published settings; hostvars hold a variable only when the inventory sets it.
INSTANCE_DEFAULTS = {"vllm_instance_bind_host": "0.0.0.0", "vllm_instance_models_dir": "/var/lib/vllm/models",
                     "vllm_instance_environment": {}, "vllm_instance_extra_args": [],
                     "vllm_instance_allowed_media_domains": [], "vllm_instance_config_dir": "/etc/vllm"}

Variables = Mapping[str, Any]


def jinja_int(value: Any) -> int:
    """What Jinja's ``| int`` makes of a value (the template renders the TOML with it): 0 when it cannot."""
    try:
        return int(value, 10) if isinstance(value, str) else int(value)
    except (TypeError, ValueError, OverflowError):
        try:
            return int(float(value))
        except (TypeError, ValueError, OverflowError):
            return 0


def jinja_float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def jinja_bool(value: Any) -> bool:
    """What Ansible's ``| bool`` makes of a value."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        value = value.strip().lower()
    return value in ("yes", "on", "1", "true", 1, "y", "t")


def role_var(variables: Variables | None, name: str) -> Any:
    """A vllm_instance variable of a host as the template sees it: the host's, else the role's default."""
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
    """What the template renders as side_channel_host: vllm_instance_host_address when the inventory sets it
    (resolvable without facts), else the default route's address, which facts give at deploy time and which
    is never empty (the published stand-in, else the host's name, represents it)."""
    if variables is not None:
        address, state = host_var(variables, "vllm_instance_host_address")
        if state == "set":
            return text(address)
    return text(inst.published.get("address")) or inst.host


def _server(inst: Instance, variables: Variables | None) -> dict[str, Any]:
    pub = inst.published
    server: dict[str, Any] = {
        "host": role_var(variables, "vllm_instance_bind_host"),
        "port": jinja_int(inst.port),
        "served_model_name": text(pub.get("served_model_name")),
    }
    if pub.get("api_key_set") is True or text(pub.get("api_key_set")).lower() == "true":
        server["api_keys_file"] = f"{text(role_var(variables, 'vllm_instance_config_dir'))}/api-keys"
    server["shutdown_timeout"] = jinja_int(inst.setting("shutdown_timeout"))
    domains = role_var(variables, "vllm_instance_allowed_media_domains")
    # The template's `map('string') | list`; anything but a list goes as it is (the launcher says what is wrong).
    server["allowed_media_domains"] = [text(d) for d in domains] if isinstance(domains, (list, tuple)) else domains
    return server


def _model(inst: Instance, variables: Variables | None) -> dict[str, Any]:
    s, model = inst.settings, text(inst.published.get("model"))
    local = jinja_bool(inst.published.get("model_is_local"))
    dirname = (model.rstrip("/").rsplit("/", 1)[-1]) if local else model.replace("/", "--")
    table: dict[str, Any] = {
        "name": f"{text(role_var(variables, 'vllm_instance_models_dir'))}/{dirname}",
        "dtype": s.get("dtype", "auto"),
    }
    if jinja_int(s.get("max_model_len")) > 0:
        table["max_model_len"] = jinja_int(s.get("max_model_len"))
    if text(s.get("quantization")):
        table["quantization"] = s.get("quantization")
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        table[key] = jinja_int(s.get(key, 1))
    for key in ("enforce_eager", "trust_remote_code"):
        table[key] = jinja_bool(s.get(key, False))
    return table


def _kv_cache(inst: Instance) -> dict[str, Any]:
    s = inst.settings
    kv: dict[str, Any] = {"quant_dtype": s.get("kv_cache_dtype", "auto")}
    if jinja_int(s.get("kv_cache_memory_bytes")) > 0:
        kv["memory_bytes"] = jinja_int(s.get("kv_cache_memory_bytes"))
    else:
        kv["gpu_memory_utilization"] = jinja_float(s.get("gpu_memory_utilization", 0.9))
    for key in ("num_gpu_blocks_override", "block_size"):
        if jinja_int(s.get(key)) > 0:
            kv[key] = jinja_int(s.get(key))
    kv["enable_prefix_caching"] = jinja_bool(s.get("enable_prefix_caching", True))
    return kv


def _scheduler(inst: Instance) -> dict[str, Any]:
    s = inst.settings
    scheduler: dict[str, Any] = {}
    for key in ("max_num_seqs", "max_num_batched_tokens"):
        if jinja_int(s.get(key)) > 0:
            scheduler[key] = jinja_int(s.get(key))
    if s.get("enable_chunked_prefill") is not None:
        scheduler["enable_chunked_prefill"] = jinja_bool(s.get("enable_chunked_prefill"))
    return scheduler


def _pd(inst: Instance, variables: Variables | None) -> dict[str, Any]:
    role = text(inst.published.get("pd_role"))
    pd: dict[str, Any] = {"enabled": role != "none"}
    if role == "none":
        return pd
    # No peer lists (prefill_instances, decode_instances): the router alone keeps them, so the TOML of an
    # instance does not change when a peer is added or removed.
    pd.update(role=role, kv_transfer_backend=inst.published.get("kv_transfer_backend", "nixl"),
              kv_buffer_device=inst.settings.get("kv_buffer_device", "cuda"),
              side_channel_host=side_channel_host(inst, variables),
              kv_transfer_port=jinja_int(inst.kv_transfer_port))
    if role == "decode":
        pd["kv_load_failure_policy"] = inst.setting("kv_load_failure_policy")
    return pd


def _devices(inst: Instance, config: dict[str, Any]) -> None:
    entries = inst.published.get("instances") or []
    entry = entries[inst.index] if inst.index < len(entries) and isinstance(entries[inst.index], Mapping) else {}
    if inst.variant == "cpu":
        config["cpu"] = {}
        if "cpus" in entry and text(entry["cpus"]):
            config["cpu"]["omp_threads_bind"] = str(entry["cpus"])
    gpus = entry.get("gpus") or []
    if gpus:
        config["devices"] = {"cuda_visible_devices": ",".join(
            str(g) for g in (gpus if isinstance(gpus, (list, tuple, str)) else [gpus]))}


def _kv_fabric_table(inst: Instance, config: dict[str, Any]) -> None:
    """[kv_fabric] from the settings alone (the kv_fabric filter's table without the host's facts: on the host, an
    rdma instance also gets the ports nearest its GPUs and their RoCE GID index, which only the host knows)."""
    if text(inst.published.get("pd_role")) != "none":
        config["kv_fabric"] = _kv_fabric.table(inst.settings, inst.variant)[0]


def _free_form(inst: Instance, variables: Variables | None, config: dict[str, Any]
               ) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """[environment] and extra.args, where they come from, and what cannot be rendered at all."""
    sources: dict[str, str] = {}
    unrenderable: list[tuple[str, str]] = []
    environment, sources["environment"] = unpublished(inst, variables, "environment")
    if isinstance(environment, Mapping):
        if environment:
            config["environment"] = {str(k): text(v) for k, v in sorted(environment.items(), key=lambda i: str(i[0]))}
    elif environment is not None:
        unrenderable.append((sources["environment"], f"is {kind(environment)}, not a mapping of NAME: value."))
    args, sources["extra_args"] = unpublished(inst, variables, "extra_args")
    if isinstance(args, (list, tuple)):
        if args:
            config["extra"] = {"args": [text(a) for a in args]}
    elif args is not None:
        unrenderable.append((sources["extra_args"], f"is {kind(args)}, not a list of vLLM flags and values."))
    return sources, unrenderable


def render(inst: Instance, variables: Variables | None
           ) -> tuple[dict[str, Any], dict[str, str], list[tuple[str, str]]]:
    """The TOML the role would render for one instance (with its Jinja conversions), where its environment
    and extra args come from, and what cannot be rendered at all. ``variables``: the host's variables."""
    config: dict[str, Any] = {"server": _server(inst, variables), "model": _model(inst, variables),
                              "kv_cache": _kv_cache(inst), "scheduler": _scheduler(inst),
                              "pd_disaggregation": _pd(inst, variables)}
    _devices(inst, config)
    _kv_fabric_table(inst, config)
    sources, unrenderable = _free_form(inst, variables, config)
    return config, sources, unrenderable


def kind(value: Any) -> str:
    """What a value is, in words ("a string", "a mapping", ...), for messages that must not show it."""
    for types, name in ((bool, "a boolean"), (str, "a string"), (int, "an integer"), (float, "a number"),
                        (Mapping, "a mapping"), (list, "a list")):
        if isinstance(value, types):
            return name
    return "null" if value is None else type(value).__name__


def toml_variable(inst: Instance, key: str, sources: Mapping[str, str]) -> str:
    """The inventory variable a TOML key (``section.key``, ``extra.args[2]``, ``environment.NAME``) comes from."""
    key = re.sub(r"\[\d+\]$", "", key)
    section = key.split(".", 1)[0]
    source = TOML_SOURCES.get(key)
    if source is None and section in SETTING_SECTIONS and "." in key:
        source = "setting:" + key.split(".", 1)[1]
    source = source or TOML_SOURCES.get(section) or "vllm_instance_instances"
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
    section = key.split(".", 1)[0]
    source = TOML_SOURCES.get(key)
    if source is None and section in SETTING_SECTIONS:
        source = "setting:" + key.split(".", 1)[1]
    kind_, _sep, name = (source or TOML_SOURCES.get(section) or "vllm_instance_instances").partition(":")
    if not name:
        return kind_
    if kind_ == "instance":
        return f"vllm_instance_instances[*].{name}"
    return f"vllm_instance_{name} (or an instance's overrides.{name})"
