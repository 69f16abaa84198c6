# Copyright (c) inferops.vllm contributors
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The instance TOML's schema, once: what each key holds, what it becomes, where it comes from, validate().

PRIVATE to the inferops.vllm collection: no compatibility promise; anything here may change or go in
any release. Other collections must not import it.

Who reads it
    - the launcher (roles/vllm_instance/files/inferops_vllm_launch.py), on the hosts: the vllm_instance
      role copies this file beside it (with _vllm_vocabulary.py), and the launcher imports it by its name
      from its own directory; build() turns a TOML this module accepts into ``vllm serve``'s argv;
    - the controller (plugins/plugin_utils/_instance_toml.py, the one renderer of the TOML, and the
      preflight's launcher check, plugins/plugin_utils/_preflight.py), which imports it as
      ``ansible_collections.inferops.vllm.plugins.module_utils._vllm_instance_schema``.
So it is standard library only, and runs on the hosts' python3 (3.10+) as on the controller.

What it holds
    SCHEMA: every section and key of the TOML, in the order the renderer writes them and the flags go on
    argv: its type and range (Key.kind, choices, minimum, maximum), the vLLM flag or environment variable
    it becomes (Key.flag, Key.env), and, for a key an instance setting renders, that setting (Key.setting:
    vllm_instance_<setting>, or an instance's overrides.<setting>) and when the renderer leaves it out
    (Key.omit, Key.unless). SETTINGS: every per-instance setting. validate(): every problem of a TOML, in
    the launcher's words. What vLLM accepts (dtypes, KV cache dtypes, ...) is the vocabulary's
    (_vllm_vocabulary.py); the rules of the free-form [environment] and extra.args are here.

What each key becomes (the launcher's build()): argv is ``<vllm-bin> serve <model.name>``, then the flags of
the keys of [server], [model], [kv_cache] and [scheduler] in SCHEMA's order, then ``extra.args`` verbatim,
then the security flags. A key with a flag (Key.flag) passes its value to it; a boolean passes the flag when
true and, when negatable, ``--no-<flag>`` when false. A key with a variable (Key.env) exports it. The keys
that do more::

    server.api_key_env                names the variable holding the API key; it must be
                                      set and non-empty; its value is exported as
                                      VLLM_API_KEY.  Never on argv (no --api-key).
    server.api_keys_file              an absolute path: the file of the keys the instance accepts, one a
                                      line (0640 root:vllm, never world-readable; at least one key at
                                      start).  Exported as INFEROPS_VLLM_API_KEYS_FILE for the middleware,
                                      which re-reads it when it changes: a key rotation needs no restart.
                                      VLLM_API_KEY is then not passed on (vLLM's own check would accept
                                      that one key only).  Not with server.api_key_env.
    server.allowed_media_domains      --allowed-media-domains, last on argv: the hosts whose http(s) media
                                      URLs a multimodal request may make vLLM fetch (exact names).  Absent
                                      or [] = none (NO_MEDIA_DOMAIN, a name that never resolves: vLLM
                                      itself reads an empty list as "every host")
    (api key set)                     --middleware inferops_vllm_auth.InstanceKeyMiddleware, last on argv,
                                      and PYTHONPATH=<the launcher's directory>[:the one [environment] sets]:
                                      the key on every route but /health (vLLM's --api-key guards /v1,
                                      /v2, /inference and /cohere only)
    server.shutdown_timeout           --shutdown-timeout         (>= 0 seconds; 0 = a stop aborts the
                                      running requests, N = a stop first refuses new requests and
                                      gives the running ones N s to finish.  Set the unit's
                                      TimeoutStopSec above N + the launcher's ORPHAN_GRACE_SECONDS)
    model.name                        positional model argument (required)
    kv_cache.memory_bytes             --kv-cache-memory-bytes    (> 0; not with gpu_memory_utilization)
    pd_disaggregation.*               only when enabled = true: --kv-transfer-config with compact JSON
                                      {"kv_buffer_device":..,"kv_connector":"NixlConnector","kv_role":..}
                                      (role prefill -> kv_producer, decode -> kv_consumer;
                                      kv_transfer_backend must be "nixl"; kv_buffer_device cuda|cpu)
    pd_disaggregation.kv_load_failure_policy  "kv_load_failure_policy" in that JSON, for role decode only
                                      (see VOCAB.KV_LOAD_FAILURE_POLICIES: "recompute" = a decode whose KV load
                                      fails computes the prompt itself, "fail" = the request fails, vLLM's
                                      default when the key is absent).  Accepted and ignored for role
                                      prefill: a producer loads no KV.
    pd_disaggregation.side_channel_host   env VLLM_NIXL_SIDE_CHANNEL_HOST (required when enabled)
    pd_disaggregation.kv_transfer_port    env VLLM_NIXL_SIDE_CHANNEL_PORT (required when enabled, != server.port)
    pd_disaggregation.prefill_instances / decode_instances   lists of http(s) URLs, checked and otherwise
                                      ignored (informational: vLLM does not read them; the router alone
                                      keeps the peer list, and the vllm_instance role no longer writes
                                      them, so adding or removing a peer restarts no instance).  Accepted
                                      for hand-written configs (the sources' skeletons have them).
    cpu.omp_threads_bind              env VLLM_CPU_OMP_THREADS_BIND; a CPU list ("0-3", "0,2", "0-3|4-7") also
                                      pins the launcher and so every process of the instance to those CPUs
                                      ("auto" / "nobind": vLLM's own, nothing pinned)
    kv_fabric.transport               how KV travels, "rdma" or "tcp" (VOCAB.KV_TRANSPORTS); sets nothing itself,
                                      but a kv_fabric.tls that contradicts it is refused (tcp in an rdma list
                                      would let UCX fall back to TCP silently)
    kv_fabric.net_devices             env UCX_NET_DEVICES (DEVICE:PORT RDMA ports, network devices by name)
    kv_fabric.tls                     env UCX_TLS (VOCAB.UCX_TRANSPORTS, comma-separated, "^" excludes)
    kv_fabric.ib_gid_index            env UCX_IB_GID_INDEX (0..255, RoCE v2 GID index; not with "tcp")
    [environment]                     extra NAME = "value" variables (names [A-Z_][A-Z0-9_]*; may not set
                                      a variable the launcher owns, nor the API key)
    extra.args                        appended to argv; may not pass a flag the launcher generates
                                      (nor --config, --model), nor a secret-bearing flag (--api-key,
                                      --hf-token, any --*-key/--*-token/--*-secret/--*-password: the argv
                                      is logged and visible in ps), in any spelling vLLM accepts

Rejected keys (removed or never-existing vLLM features) are reported with the
replacement to use; see REJECTED_KEYS (VOCAB.REMOVED_SETTINGS and a literal server.api_key).

Adding a vLLM setting: a Key with its flag and its setting here, vllm_instance_<setting> in the role's
defaults/main.yml and meta/argument_specs.yml, and a test. The role's vars, the renderer, the preflight and
the launcher follow.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

try:  # the controller: the collection's module beside this one
    from . import _vllm_vocabulary as VOCAB
except ImportError:  # a host: the copy beside this file and the launcher (their directory is on sys.path)
    import _vllm_vocabulary as VOCAB  # type: ignore[no-redef]

VLLM_DEFAULT_PORT = 8000  # what vLLM listens on when server.port is not set
# vLLM fetches http(s) media URLs of multimodal requests from any host when --allowed-media-domains is
# absent or empty. "No domain" is this one name in the list: .invalid never resolves (RFC 6761).
NO_MEDIA_DOMAIN = "media-urls-disabled.invalid"
# A host name as vLLM compares it with a URL's host (exact, lower case, no port, no scheme).
_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
MEDIA_DOMAIN_RE = re.compile(rf"(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*")

API_KEY_VAR = "VLLM_API_KEY"  # the variable vLLM itself reads
KEYS_FILE_VAR = "INFEROPS_VLLM_API_KEYS_FILE"  # the keys file the middleware reads (server.api_keys_file)

ENV_NAME_RE = re.compile(r"[A-Z_][A-Z0-9_]*")
CPU_LIST_RE = re.compile(r"[0-9]+(?:-[0-9]+)?(?:[,|][0-9]+(?:-[0-9]+)?)*")


def bound_cpus(bind: str) -> set[int] | None:
    """The CPUs of a VLLM_CPU_OMP_THREADS_BIND list ("0-3", "0,2", "0-3|4-7": every rank's, together), or None for
    vLLM's words ("auto", "nobind", ""), which leave the instance where systemd put it."""
    bind = bind.strip()
    if not CPU_LIST_RE.fullmatch(bind):
        return None
    cpus: set[int] = set()
    for part in re.split(r"[,|]", bind):
        first, _dash, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


# vLLM flags that carry a secret on the command line (which the launcher logs and ps shows): the
# named ones, and any other --*-key / --*-token / --*-secret / --*-password.
SECRET_FLAG_RE = re.compile(r"--(?:[a-z0-9]+-)*(?:key|token|secret|password|passwd)")


@dataclass(frozen=True)
class Key:
    """How one TOML key is checked and what it turns into."""

    kind: str  # str | env_name | int | bool | fraction | url_list | str_list
    flag: str = ""  # vLLM flag it maps to ("" if none)
    env: str = ""  # environment variable it maps to ("" if none)
    choices: tuple[Any, ...] = ()
    minimum: int | None = None
    maximum: int | None = None
    negatable: bool = False  # bool flag: emit --no-<flag> when false
    # The per-instance setting that renders it (vllm_instance_<setting>, or an instance's overrides.<setting>),
    # "" for a key the renderer fills from elsewhere (the host, the instance's entry) or never writes.
    setting: str = ""
    # When the renderer leaves a setting's key out: "" never, "not_positive" (0 or less: vLLM's default),
    # "empty" (an empty value: vLLM's default), "null" (null: vLLM's default).
    omit: str = ""
    # ... and when this other key of its section is written (the two are alternatives).
    unless: str = ""


# Section order is the order the renderer writes them and the flags go on argv.
SCHEMA: dict[str, dict[str, Key]] = {
    "server": {
        "host": Key("str", flag="--host"),
        "port": Key("int", flag="--port", minimum=1, maximum=65535),
        "served_model_name": Key("str", flag="--served-model-name"),
        "api_key_env": Key("env_name"),
        "api_keys_file": Key("str"),
        "shutdown_timeout": Key("int", flag="--shutdown-timeout", minimum=0, setting="shutdown_timeout"),
        "allowed_media_domains": Key("str_list", flag="--allowed-media-domains"),
    },
    "model": {
        "name": Key("str"),
        # Which weights: "copy <fingerprint>" (a controller directory) or "revision <commit>" (a hub model). No flag:
        # the preflight compares it with a running instance's (prefill and decode must load the same weights).
        "identity": Key("str"),
        "revision": Key("str", flag="--revision"),
        "dtype": Key("str", flag="--dtype", choices=VOCAB.DTYPES, setting="dtype"),
        "max_model_len": Key("int", flag="--max-model-len", minimum=1, setting="max_model_len", omit="not_positive"),
        "quantization": Key("str", flag="--quantization", choices=VOCAB.QUANTIZATION_METHODS, setting="quantization",
                            omit="empty"),
        "tensor_parallel_size": Key("int", flag="--tensor-parallel-size", minimum=1, setting="tensor_parallel_size"),
        "pipeline_parallel_size": Key("int", flag="--pipeline-parallel-size", minimum=1,
                                      setting="pipeline_parallel_size"),
        "enforce_eager": Key("bool", flag="--enforce-eager", setting="enforce_eager"),
        "trust_remote_code": Key("bool", flag="--trust-remote-code", setting="trust_remote_code"),
        # Sampling defaults: "auto" = the model's generation_config.json, "vllm" = vLLM's own, or a directory.
        "generation_config": Key("str", flag="--generation-config", setting="generation_config", omit="empty"),
    },
    "kv_cache": {
        "quant_dtype": Key("str", flag="--kv-cache-dtype", choices=VOCAB.KV_CACHE_DTYPES, setting="kv_cache_dtype"),
        "memory_bytes": Key("int", flag="--kv-cache-memory-bytes", minimum=1, setting="kv_cache_memory_bytes",
                            omit="not_positive"),
        "gpu_memory_utilization": Key("fraction", flag="--gpu-memory-utilization", setting="gpu_memory_utilization",
                                      unless="memory_bytes"),
        "num_gpu_blocks_override": Key("int", flag="--num-gpu-blocks-override", minimum=1,
                                       setting="num_gpu_blocks_override", omit="not_positive"),
        "block_size": Key("int", flag="--block-size", choices=VOCAB.BLOCK_SIZES, setting="block_size",
                          omit="not_positive"),
        "enable_prefix_caching": Key("bool", flag="--enable-prefix-caching", negatable=True,
                                     setting="enable_prefix_caching"),
    },
    "scheduler": {
        "max_num_seqs": Key("int", flag="--max-num-seqs", minimum=1, setting="max_num_seqs", omit="not_positive"),
        "max_num_batched_tokens": Key("int", flag="--max-num-batched-tokens", minimum=1,
                                      setting="max_num_batched_tokens", omit="not_positive"),
        "enable_chunked_prefill": Key("bool", flag="--enable-chunked-prefill", negatable=True,
                                      setting="enable_chunked_prefill", omit="null"),
    },
    "pd_disaggregation": {
        "enabled": Key("bool"),
        "role": Key("str", choices=tuple(VOCAB.PD_ROLES)),
        "kv_transfer_backend": Key("str", choices=tuple(VOCAB.KV_TRANSFER_BACKENDS)),
        "kv_buffer_device": Key("str", choices=VOCAB.KV_BUFFER_DEVICES, setting="kv_buffer_device"),
        "side_channel_host": Key("str", env="VLLM_NIXL_SIDE_CHANNEL_HOST"),
        "kv_transfer_port": Key("int", env="VLLM_NIXL_SIDE_CHANNEL_PORT", minimum=1, maximum=65535),
        # Written for decode instances only (a producer loads no KV).
        "kv_load_failure_policy": Key("str", choices=VOCAB.KV_LOAD_FAILURE_POLICIES, setting="kv_load_failure_policy"),
        "prefill_instances": Key("url_list"),
        "decode_instances": Key("url_list"),
    },
    "cpu": {
        "omp_threads_bind": Key("str", env="VLLM_CPU_OMP_THREADS_BIND"),
        "kvcache_space_gib": Key("int", env="VLLM_CPU_KVCACHE_SPACE", minimum=1),
    },
    "devices": {
        "cuda_visible_devices": Key("str", env="CUDA_VISIBLE_DEVICES"),
    },
    "kv_fabric": {
        "transport": Key("str", choices=VOCAB.KV_TRANSPORTS),
        "net_devices": Key("str", env="UCX_NET_DEVICES"),
        "tls": Key("str", env="UCX_TLS"),
        "ib_gid_index": Key("int", env="UCX_IB_GID_INDEX", minimum=0, maximum=255),
    },
    "environment": {},  # free-form NAME = "value"; checked by _check_environment
    "extra": {
        "args": Key("str_list", setting="extra_args", omit="empty"),
    },
}
REQUIRED_SECTIONS = ("server", "model")
FLAG_SECTIONS = ("server", "model", "kv_cache", "scheduler")
# The per-instance settings (vllm_instance_<name>, or an instance's overrides.<name>): those of SCHEMA's keys,
# then those the renderer writes through a table of their own: [kv_fabric] (the kv_fabric filter resolves the
# transport and the UCX settings with the host's facts) and [environment].
SETTINGS = (
    *(spec.setting for keys in SCHEMA.values() for spec in keys.values() if spec.setting),
    "kv_transport", "ucx_net_devices", "ucx_tls", "ucx_ib_gid_index", "environment",
)

REJECTED_KEYS: dict[tuple[str, str], str] = {
    ("server", "api_key"): (
        "a literal API key is not allowed in the TOML (it would leak into logs and process listings); "
        "put the keys in a file named by api_keys_file (the vllm_instance role writes it), or the key in the "
        "EnvironmentFile named by api_key_env"
    ),
    **{(section, key): why for key, (section, why) in VOCAB.REMOVED_SETTINGS.items()},
}

# vLLM short aliases for flags the launcher owns.
SHORT_ALIASES = {"-tp": "--tensor-parallel-size", "-pp": "--pipeline-parallel-size", "-q": "--quantization"}
_SECRET_FIX = (
    "put it in the instance's keys file instead (the vllm_instance role writes vllm_instance_api_key there; "
    "server.api_keys_file names it), or in its EnvironmentFile named by server.api_key_env"
)
# Flags in extra.args that are always refused, with the reason / what to do instead.
RESERVED_FLAGS = {
    "--api-key": (
        "--api-key would put the API key on vLLM's command line (visible in ps and logs); name a keys file with "
        "server.api_keys_file, or put the key in the EnvironmentFile and name it with server.api_key_env (the "
        "vllm_instance role: set vllm_instance_api_key)"
    ),
    "--hf-token": (
        "--hf-token would put the Hugging Face token on vLLM's command line (visible in ps and logs); "
        "put HF_TOKEN in the instance's EnvironmentFile, or let the vllm_instance role fetch the model "
        "before vLLM starts (vllm_instance_hf_token)"
    ),
    "--config": (
        "--config (a vLLM YAML config) would bypass this TOML, which the launcher owns; "
        "set the matching key in the TOML instead"
    ),
    "--kv-transfer-config": (
        "--kv-transfer-config is generated from [pd_disaggregation] (enabled, role, kv_transfer_backend, "
        "kv_buffer_device, kv_load_failure_policy); set those keys instead"
    ),
    "--model": "--model is generated from model.name (the positional model argument); set model.name instead",
}


def _flag_owners() -> dict[str, str]:
    """Map every flag the launcher generates (both spellings of booleans) to its TOML key."""
    owners: dict[str, str] = {}
    for section, keys in SCHEMA.items():
        for key, spec in keys.items():
            if spec.flag:
                owners[spec.flag] = f"{section}.{key}"
                if spec.kind == "bool":
                    owners["--no-" + spec.flag[2:]] = f"{section}.{key}"
    return owners


def _env_owners() -> dict[str, str]:
    """Map every environment variable the launcher sets to the TOML key that sets it."""
    owners = {API_KEY_VAR: "server.api_key_env", KEYS_FILE_VAR: "server.api_keys_file"}
    for section, keys in SCHEMA.items():
        for key, spec in keys.items():
            if spec.env:
                owners[spec.env] = f"{section}.{key}"
    return owners


FLAG_OWNERS = _flag_owners()
ENV_OWNERS = _env_owners()


class ConfigError(Exception):
    """The configuration cannot be used; ``problems`` holds one message per problem."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = list(problems)


# --------------------------------------------------------------------------- validation


def _toml(value: Any) -> str:
    """Render a scalar roughly as it is written in TOML (for messages)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return str(value)


def _describe(value: Any) -> str:
    if isinstance(value, bool):
        return f"boolean {_toml(value)}"
    if isinstance(value, int):
        return f"integer {value}"
    if isinstance(value, float):
        return f"float {value}"
    if isinstance(value, str):
        return f"string {_toml(value)}"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return type(value).__name__


_EXPECTED = {
    "str": ("a string", "write a quoted string"),
    "env_name": ("a string", 'write a quoted variable name such as "VLLM_API_KEY"'),
    "int": ("an integer", "write a whole number without quotes"),
    "bool": ("a boolean", "write true or false without quotes"),
    "fraction": ("a number", "write a number such as 0.9 without quotes"),
    "url_list": ("an array of strings", 'write an array such as ["http://10.0.0.11:8100"]'),
    "str_list": ("an array of strings", 'write an array such as ["--flag", "value"]'),
}


def _type_problem(where: str, kind: str, value: Any) -> str:
    expected, fallback = _EXPECTED[kind]
    hint = fallback
    if kind == "bool" and isinstance(value, str) and value.strip().lower() in ("true", "false"):
        hint = f"write {value.strip().lower()} without quotes"
    elif kind in ("int", "fraction") and isinstance(value, bool):
        hint = "a boolean is not a number: " + fallback
    elif kind == "int" and isinstance(value, str) and value.strip().isdigit():
        hint = f"write {value.strip()} without quotes"
    elif kind == "int" and isinstance(value, float) and value.is_integer():
        hint = f"write {int(value)} without a decimal point"
    elif kind == "fraction" and isinstance(value, str) and re.fullmatch(r"\s*\d*\.?\d+\s*", value):
        hint = f"write {value.strip()} without quotes"
    elif kind in ("str", "env_name") and isinstance(value, bool | int | float):
        hint = f"quote it: {json.dumps(_toml(value))}"
    return f"{where}: must be {expected}, got {_describe(value)}; {hint}"


def _suggest(name: str, candidates: Sequence[str]) -> str:
    # Schema names are lower case, so compare case-insensitively ("Port" -> 'port').
    match = difflib.get_close_matches(name.lower(), list(candidates), n=1, cutoff=0.6)
    if match:
        return f"did you mean {match[0]!r}?"
    return "valid: " + ", ".join(candidates)


def _choice_problem(where: str, value: Any, choices: Sequence[Any]) -> str:
    listed = ", ".join(_toml(c) if isinstance(c, str) else str(c) for c in choices)
    if isinstance(value, str) and value.strip().lower() in choices:
        fixed = _toml(value.strip().lower())
        return f"{where}: {_toml(value)} is not supported (values are case-sensitive); write {fixed}"
    if where == "model.dtype" and isinstance(value, str) and value.strip().lower() in VOCAB.DTYPE_MISSPELLINGS:
        fixed = _toml(VOCAB.DTYPE_MISSPELLINGS[value.strip().lower()])
        return f"{where}: {_toml(value)} is not a spelling vLLM's --dtype accepts; write {fixed}"
    refusal = VOCAB.kv_cache_dtype_refusal(value) if where == "kv_cache.quant_dtype" else None
    if refusal:
        return f"{where}: {refusal}; use fp8 (halves KV memory vs 16-bit) or auto"
    if where == "pd_disaggregation.kv_transfer_backend" and isinstance(value, str) and "nccl" in value.lower():
        return f"{where}: {VOCAB.NCCL_REMOVED}"
    if where == "model.quantization":
        return f"{where}: {_toml(value)} is not a supported weight quantization method; use one of: {listed}"
    return f"{where}: {_toml(value)} is not supported; use one of: {listed}"


def _check_string(where: str, value: str) -> list[str]:
    if not value.strip():
        return [f"{where}: must not be empty; set a value or remove the key"]
    if "\0" in value:
        return [f"{where}: must not contain NUL characters; remove them"]
    return []


def _check_int(where: str, spec: Key, value: Any) -> list[str]:
    if isinstance(value, bool) or not isinstance(value, int):
        return [_type_problem(where, "int", value)]
    if spec.choices and value not in spec.choices:
        return [_choice_problem(where, value, spec.choices)]
    low, high = spec.minimum, spec.maximum
    if (low is not None and value < low) or (high is not None and value > high):
        wanted = f"an integer >= {low}" if high is None else f"an integer between {low} and {high}"
        return [f"{where}: {value} is out of range; use {wanted}"]
    return []


def _check_value(where: str, spec: Key, value: Any) -> list[str]:
    """Problems with one key's value (type, range, choices); empty if fine."""
    kind = spec.kind
    if kind in ("str", "env_name"):
        if not isinstance(value, str):
            return [_type_problem(where, kind, value)]
        problems = _check_string(where, value)
        if problems:
            return problems
        if kind == "env_name" and not ENV_NAME_RE.fullmatch(value):
            return [
                f"{where}: {_toml(value)} is not a valid environment variable name; "
                'use upper-case letters, digits and underscores, e.g. "VLLM_API_KEY"'
            ]
        if spec.choices and value not in spec.choices:
            return [_choice_problem(where, value, spec.choices)]
        return []
    if kind == "bool":
        return [] if isinstance(value, bool) else [_type_problem(where, kind, value)]
    if kind == "int":
        return _check_int(where, spec, value)
    if kind == "fraction":
        if isinstance(value, bool) or not isinstance(value, int | float):
            return [_type_problem(where, kind, value)]
        if not 0 < value <= 1:  # also rejects nan and inf
            return [f"{where}: {value} is out of range; use a fraction greater than 0 and at most 1, e.g. 0.9"]
        return []
    if kind in ("url_list", "str_list"):
        if not isinstance(value, list):
            return [_type_problem(where, kind, value)]
        problems = []
        for index, item in enumerate(value):
            item_where = f"{where}[{index}]"
            if not isinstance(item, str):
                problems.append(_type_problem(item_where, "str", item))
            elif kind == "url_list" and not item.startswith(("http://", "https://")):
                problems.append(f'{item_where}: {_toml(item)} is not an http(s) URL; write it as "http://HOST:PORT"')
            elif "\0" in item:
                problems.append(f"{item_where}: must not contain NUL characters; remove them")
        return problems
    raise AssertionError(f"unknown kind {kind!r} for {where}")  # pragma: no cover - schema bug


def _extra_flag_name(item: str) -> str | None:
    """The long flag name vLLM would see for an extra.args item, or None if it is not a flag.

    vLLM's parser turns underscores into dashes in flag names, treats ``--flag.sub`` as part of
    the JSON flag ``--flag``, and accepts ``--flag=value``; short aliases are mapped to long names.
    """
    if item.startswith("--") and len(item) > 2:
        name = item[2:].split("=", 1)[0].split(".", 1)[0]
        return "--" + name.replace("_", "-")
    if len(item) > 1 and item[0] == "-" and item[1].isalpha():
        name = item.split("=", 1)[0]
        if name in SHORT_ALIASES:
            return SHORT_ALIASES[name]
        if name.startswith("-q"):  # single-letter short option with an attached value: -qawq
            return SHORT_ALIASES["-q"]
        for alias, long_name in SHORT_ALIASES.items():
            if alias.startswith(name):  # argparse abbreviation, e.g. -t for -tp
                return long_name
    return None


def _check_extra_args(args: list[str]) -> list[str]:
    problems = []
    if args and not args[0].startswith("-"):
        problems.append(
            f"extra.args[0]: {_toml(args[0])} is not a flag, so vLLM would read it as a value of the previous "
            'flag; extra.args must start with a flag such as "--max-log-len"'
        )
    for index, item in enumerate(args):
        name = _extra_flag_name(item)
        if name is None:
            continue
        where = f"extra.args[{index}]"
        shown = _toml(item.split("=", 1)[0])
        if name in RESERVED_FLAGS:
            problems.append(f"{where}: {shown} is not allowed: {RESERVED_FLAGS[name]}")
        elif SECRET_FLAG_RE.fullmatch(name):
            problems.append(
                f"{where}: {shown} is not allowed: it would put a secret on vLLM's command line (visible in ps "
                f"and logs); {_SECRET_FIX}"
            )
        elif name in FLAG_OWNERS:
            owner = FLAG_OWNERS[name]
            problems.append(
                f"{where}: {shown} is not allowed: {name} is generated from {owner}; set {owner} in the TOML instead"
            )
        else:
            # argparse accepts unambiguous abbreviations of long flags.
            owned = [flag for flag in (*FLAG_OWNERS, *RESERVED_FLAGS) if flag.startswith(name)]
            if len(owned) == 1 and owned[0] in RESERVED_FLAGS:
                problems.append(
                    f"{where}: {shown} is not allowed: vLLM would read it as an abbreviation of {owned[0]}; "
                    f"{RESERVED_FLAGS[owned[0]]}"
                )
            elif owned:
                keys = ", ".join(FLAG_OWNERS.get(flag, flag) for flag in owned)
                problems.append(
                    f"{where}: {shown} is not allowed: vLLM would read it as an abbreviation of "
                    f"{', '.join(owned)}, which the launcher controls; set {keys} in the TOML instead"
                )
    return problems


def _check_environment(table: dict[str, Any]) -> list[str]:
    problems = []
    for name, value in table.items():
        where = f"environment.{name}"
        if not ENV_NAME_RE.fullmatch(name):
            problems.append(
                f"{where}: {_toml(name)} is not a valid environment variable name; "
                "use upper-case letters, digits and underscores ([A-Z_][A-Z0-9_]*)"
            )
            continue
        if name == API_KEY_VAR:
            problems.append(
                f"{where}: the API key must not be in the TOML; put it in the EnvironmentFile "
                "and name it with server.api_key_env"
            )
            continue
        if name in ENV_OWNERS:
            owner = ENV_OWNERS[name]
            problems.append(f"{where}: {name} is set by the launcher from {owner}; set {owner} instead")
            continue
        if not isinstance(value, str):
            problems.append(_type_problem(where, "str", value))
        elif "\0" in value:
            problems.append(f"{where}: must not contain NUL characters; remove them")
    return problems


UCX_DEVICE_RE = re.compile(r"[A-Za-z0-9_.-]+(?::[0-9]+)?")


def _ucx_list(value: str) -> tuple[bool, list[str]]:
    """(excluded, names) of a UCX list setting: "^a,b" excludes a and b."""
    excluded = value.startswith("^")
    return excluded, [name.strip() for name in value.lstrip("^").split(",")]


def _check_kv_fabric(fabric: Mapping[str, Any]) -> list[str]:
    """[kv_fabric]: UCX names well formed, and no transport list that contradicts the transport."""
    problems = []
    transport = fabric.get("transport")
    if "tls" in fabric:
        excluded, names = _ucx_list(fabric["tls"])
        unknown = [n for n in names if n not in VOCAB.UCX_TRANSPORTS]
        if unknown:
            problems.append(
                f"kv_fabric.tls: {', '.join(map(_toml, unknown))} {'is' if len(unknown) == 1 else 'are'} not a UCX "
                f"transport; write a comma-separated list of {', '.join(VOCAB.UCX_TRANSPORTS)} "
                "(ucx_info -d shows the host's)"
            )
        rdma = [n for n in names if n in VOCAB.UCX_RDMA_TRANSPORTS]
        if transport == "rdma" and not excluded and ("tcp" in names or "all" in names):
            problems.append(
                f"kv_fabric.tls: {_toml(fabric['tls'])} lets UCX carry KV over TCP when RDMA fails, silently and "
                "about a hundred times slower; remove tcp/all, or set kv_fabric.transport = \"tcp\" if TCP is meant"
            )
        elif transport == "rdma" and not excluded and not rdma:
            problems.append(
                f"kv_fabric.tls: {_toml(fabric['tls'])} has no RDMA transport although kv_fabric.transport is "
                "\"rdma\"; add rc (InfiniBand and RoCE) or dc, or set kv_fabric.transport = \"tcp\""
            )
        elif transport == "tcp" and not excluded and rdma:
            problems.append(
                f"kv_fabric.tls: {', '.join(rdma)} (RDMA) in the list but kv_fabric.transport is \"tcp\"; "
                "remove them, or set kv_fabric.transport = \"rdma\""
            )
    if "net_devices" in fabric:
        bad = [n for n in _ucx_list(fabric["net_devices"])[1] if not UCX_DEVICE_RE.fullmatch(n)]
        if bad:
            problems.append(
                f"kv_fabric.net_devices: {', '.join(map(_toml, bad))} is not a UCX device; write RDMA ports as "
                "DEVICE:PORT (mlx5_0:1) and network devices by name (eth0), comma-separated"
            )
    if transport == "tcp" and "ib_gid_index" in fabric:
        problems.append(
            "kv_fabric.ib_gid_index: only RoCE uses a GID index, and kv_fabric.transport is \"tcp\"; remove it"
        )
    return problems


def _check_cross(
    raw: dict[str, dict[str, Any]], good: dict[str, dict[str, Any]], environ: Mapping[str, str] | None
) -> list[str]:
    """Checks that involve several keys (or the environment); only uses values that passed _check_value."""
    problems = []
    if "model" in raw and "name" not in raw["model"]:
        problems.append("model.name: required; set it to the model directory or Hugging Face model id")

    bind = good.get("cpu", {}).get("omp_threads_bind")
    if bind is not None and bind not in ("auto", "nobind") and bound_cpus(bind) is None:
        problems.append(
            f"cpu.omp_threads_bind: {json.dumps(bind)} is not a CPU list; give cores such as \"0-3\", \"0,2\" or "
            "\"0-3|4-7\" (one list per rank), or \"auto\" / \"nobind\" (the instance's cpus in the inventory)"
        )

    kv = good.get("kv_cache", {})
    if "memory_bytes" in kv and "gpu_memory_utilization" in kv:
        problems.append(
            "kv_cache.gpu_memory_utilization: set together with kv_cache.memory_bytes; vLLM uses memory_bytes "
            "and ignores gpu_memory_utilization: pick one and remove the other"
        )

    pd_raw = raw.get("pd_disaggregation", {})
    pd = good.get("pd_disaggregation", {})
    if pd.get("enabled") is True:
        required = {
            "role": 'set "prefill" or "decode"',
            "side_channel_host": "set the address peers use to reach this instance's NIXL side channel",
            "kv_transfer_port": "set the NIXL side-channel port (1..65535, not server.port)",
        }
        for key, todo in required.items():
            if key not in pd_raw:
                problems.append(f"pd_disaggregation.{key}: required when pd_disaggregation.enabled = true; {todo}")
        server = good.get("server", {})
        port_ok = "port" in server or "port" not in raw.get("server", {})
        server_port = server.get("port", VLLM_DEFAULT_PORT)
        if port_ok and pd.get("kv_transfer_port") == server_port:
            problems.append(
                f"pd_disaggregation.kv_transfer_port: {server_port} is also the HTTP port (server.port); "
                "use a different port for the NIXL side channel"
            )

    problems.extend(_check_kv_fabric(good.get("kv_fabric", {})))

    generation_config = good.get("model", {}).get("generation_config")
    if generation_config is not None and generation_config not in ("auto", "vllm") and generation_config[0] != "/":
        problems.append(
            f"model.generation_config: {json.dumps(generation_config)} is neither \"auto\" (the model's "
            'generation_config.json), "vllm" (vLLM\'s own sampling defaults) nor an absolute directory holding a '
            "generation_config.json; write one of those"
        )

    for domain in good.get("server", {}).get("allowed_media_domains", []):
        if not MEDIA_DOMAIN_RE.fullmatch(domain):
            problems.append(
                f"server.allowed_media_domains: {json.dumps(domain)} is not a host name; vLLM compares each entry "
                'with the URL\'s host exactly: write lower-case names such as "images.example.com" (no scheme, '
                "port, path or wildcard)"
            )

    keys_file = good.get("server", {}).get("api_keys_file")
    if keys_file is not None:
        problems.extend(_check_keys_file(keys_file, good.get("server", {}), environ))

    api_key_env = good.get("server", {}).get("api_key_env")
    if api_key_env is not None:
        env_table = raw.get("environment", {})
        if api_key_env in env_table and api_key_env != API_KEY_VAR:
            problems.append(
                f"environment.{api_key_env}: this is the API key variable named by server.api_key_env; "
                "the key must not be in the TOML: put it in the EnvironmentFile"
            )
        if environ is not None and not environ.get(api_key_env):
            problems.append(
                f"server.api_key_env: environment variable {api_key_env} is not set or is empty; put "
                f"{api_key_env}=<key> in the instance's EnvironmentFile (systemd EnvironmentFile=), "
                "or remove server.api_key_env to run without an API key"
            )
    return problems


def _check_keys_file(keys_file: str, server: Mapping[str, Any], environ: Mapping[str, str] | None) -> list[str]:
    """server.api_keys_file: an absolute path, alone (not with api_key_env); at start (environ given) a file that
    is not world-readable and holds at least one key."""
    if "api_key_env" in server:
        return ["server.api_keys_file and server.api_key_env: name the keys one way only; api_keys_file (a file the "
                "instance re-reads, for rotations without a restart) replaces api_key_env"]
    if not keys_file.startswith("/"):
        return [f"server.api_keys_file: {json.dumps(keys_file)} is not an absolute path"]
    if environ is None:  # --check: the file may not be written yet; its content is checked at start
        return []
    try:
        mode = os.stat(keys_file).st_mode
        with open(keys_file, "rb") as f:
            data = f.read()
    except OSError as exc:
        return [f"server.api_keys_file: cannot read {keys_file}: {exc.strerror or exc}; the vllm_instance role "
                "writes it from vllm_instance_api_key (0640 root:vllm)"]
    if mode & 0o007:
        return [f"server.api_keys_file: {keys_file} is readable by every user (mode {mode & 0o777:04o}): "
                "chmod 0640 it (owner root, group of the vLLM user)"]
    if not any(line.strip() and not line.strip().startswith(b"#") for line in data.splitlines()):
        return [f"server.api_keys_file: {keys_file} holds no key: write the instance key in it (one a line), or "
                "remove server.api_keys_file to run without a key"]
    return []


def validate(config: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> list[str]:
    """Return every problem in ``config`` (empty list if it is usable).

    ``environ`` enables the checks that depend on the launcher's environment (the API key
    variable); pass None to validate the file alone.
    """
    problems: list[str] = []
    for name in config:
        if name not in SCHEMA:
            problems.append(f"{name}: unknown section; {_suggest(name, list(SCHEMA))}")
    for name in REQUIRED_SECTIONS:
        if name not in config:
            problems.append(f"{name}: required section [{name}] is missing; add it")

    raw: dict[str, dict[str, Any]] = {}
    good: dict[str, dict[str, Any]] = {}
    for section, keys in SCHEMA.items():
        if section not in config:
            continue
        table = config[section]
        if not isinstance(table, dict):
            problems.append(f"{section}: must be a table, got {_describe(table)}; write it as a [{section}] section")
            continue
        raw[section] = table
        if section == "environment":
            problems.extend(_check_environment(table))
            continue
        good[section] = {}
        for key, value in table.items():
            where = f"{section}.{key}"
            if (section, key) in REJECTED_KEYS:
                problems.append(f"{where}: {REJECTED_KEYS[section, key]}")
                continue
            spec = keys.get(key)
            if spec is None:
                problems.append(f"{where}: unknown key; {_suggest(key, list(keys))}")
                continue
            key_problems = _check_value(where, spec, value)
            if section == "extra" and key == "args" and not key_problems:
                key_problems = _check_extra_args(value)
            if key_problems:
                problems.extend(key_problems)
            else:
                good[section][key] = value
    problems.extend(_check_cross(raw, good, environ))
    return problems


# --------------------------------------------------------------------------- building
