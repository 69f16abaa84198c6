# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Launch one vLLM instance from its TOML description (inferops.vllm).

Ansible renders ``/etc/vllm/<instance>.toml``; the instance's systemd unit runs
this launcher with the venv's python::

    inferops_vllm_launch.py --config /etc/vllm/NAME.toml [--check] [--vllm-bin PATH]

The launcher reads the TOML, validates it (reporting *every* problem at once,
each naming the ``section.key``, what is wrong and what to write instead),
builds the ``vllm serve`` argv and the environment variables, logs the final
command, and runs vLLM as its child, staying the unit's main process as a
subreaper (``PR_SET_CHILD_SUBREAPER``): SIGTERM/SIGINT/SIGHUP go to vLLM, and
once vLLM has exited every process it left behind (its multiprocessing
resource tracker ignores SIGTERM) is stopped and reaped before the launcher
exits with vLLM's status.  So a stop ends with an empty cgroup even where
systemd gets no cgroup-empty events (systemd in a container on cgroup v1,
where a leftover process made every stop time out and fail).  Standard
library only (``tomli`` is used on Python 3.10, which has no ``tomllib``).

Modes
    default     validate, build, log ``inferops-vllm-launch: exec: <cmd>`` and one
                ``inferops-vllm-launch: env: NAME=value`` line per variable the
                launcher sets to stderr, run vLLM.  Only the values of known-safe
                variables are shown (see SAFE_ENV_NAMES / SAFE_ENV_PREFIXES); every
                other value, and any value holding URL credentials, is ``<redacted>``.
    --check     validate and build, print the same lines to stdout followed by
                ``inferops-vllm-launch: <path>: config OK``; never starts vLLM.
``--vllm-bin`` defaults to ``vllm`` next to the running interpreter
(``Path(sys.executable).parent / "vllm"``).

Exit codes
    0    --check: configuration OK; otherwise vLLM's own exit status (a vLLM
         killed by a signal makes the launcher die of the same signal)
    1    no TOML parser available (Python 3.10 without tomli)
    2    configuration problem: file missing/unreadable/not UTF-8, TOML syntax
         error, or validation problems.  Every line on stderr reads
         ``inferops-vllm-launch: <path>: <problem>``.  (Suggested systemd
         setting: ``RestartPreventExitStatus=2`` so a bad file does not loop.)
    126  the vLLM executable exists but cannot be executed
    127  the vLLM executable does not exist

Mapping (argv order: ``<vllm-bin> serve <model.name>``, then the flags below in
table order, then ``extra.args`` verbatim)::

    server.host                       --host
    server.port                       --port                     (1..65535)
    server.served_model_name          --served-model-name
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
                                      and PYTHONPATH=<this file's directory>[:the one [environment] sets]:
                                      the key on every route but /health (vLLM's --api-key guards /v1,
                                      /v2, /inference and /cohere only)
    server.shutdown_timeout           --shutdown-timeout         (>= 0 seconds; 0 = a stop aborts the
                                      running requests, N = a stop first refuses new requests and
                                      gives the running ones N s to finish.  Set the unit's
                                      TimeoutStopSec above N + ORPHAN_GRACE_SECONDS)
    model.name                        positional model argument (required)
    model.revision                    --revision
    model.dtype                       --dtype                    (see VOCAB.DTYPES)
    model.max_model_len               --max-model-len            (> 0)
    model.quantization                --quantization             (see VOCAB.QUANTIZATION_METHODS)
    model.tensor_parallel_size        --tensor-parallel-size     (>= 1)
    model.pipeline_parallel_size      --pipeline-parallel-size   (>= 1)
    model.enforce_eager               --enforce-eager            (only when true)
    model.trust_remote_code           --trust-remote-code        (only when true)
    kv_cache.quant_dtype              --kv-cache-dtype           (see VOCAB.KV_CACHE_DTYPES)
    kv_cache.memory_bytes             --kv-cache-memory-bytes    (> 0; not with gpu_memory_utilization)
    kv_cache.gpu_memory_utilization   --gpu-memory-utilization   (0 < x <= 1)
    kv_cache.num_gpu_blocks_override  --num-gpu-blocks-override  (> 0)
    kv_cache.block_size               --block-size               (see VOCAB.BLOCK_SIZES)
    kv_cache.enable_prefix_caching    --enable-prefix-caching / --no-enable-prefix-caching
    scheduler.max_num_seqs            --max-num-seqs             (> 0)
    scheduler.max_num_batched_tokens  --max-num-batched-tokens   (> 0)
    scheduler.enable_chunked_prefill  --enable-chunked-prefill / --no-enable-chunked-prefill
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
    cpu.kvcache_space_gib             env VLLM_CPU_KVCACHE_SPACE (> 0)
    devices.cuda_visible_devices      env CUDA_VISIBLE_DEVICES
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

Vocabulary: what vLLM accepts (DTYPES, QUANTIZATION_METHODS, KV_CACHE_DTYPES, BLOCK_SIZES,
KV_BUFFER_DEVICES, KV_TRANSFER_BACKENDS, KV_LOAD_FAILURE_POLICIES, REMOVED_SETTINGS, ...) is not in
this file: it is the collection's plugins/module_utils/_vllm_vocabulary.py (VOCAB here), which the
vllm_instance role installs beside this file and the controller-side preflight
(plugins/filter/preflight.py) imports. This file keeps the rules of its own TOML: types and ranges,
and what the free-form extra.args and [environment] may not set (RESERVED_FLAGS, the flags and
variables the launcher generates, secret-bearing flags).

Python API (used by the unit tests):
    validate(config, environ=None) -> list[str]   all problems; environment-dependent
                                                  checks run only when environ is given
    build(config, environ) -> (args, env)         args: the argv *without* the executable,
                                                  starting with "serve"; env: only the variables
                                                  the launcher sets (the exec environment is
                                                  os.environ updated with them).  Raises
                                                  ConfigError if validate() finds problems.
    load_config(path) -> dict                     raises ConfigError / NoTomlParserError
    main(argv=None) -> int
"""

import argparse
import ctypes
import difflib
import importlib.util
import json
import os
import re
import shlex
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    try:
        import tomli as tomllib
    except ModuleNotFoundError:
        tomllib = None

PROG = "inferops-vllm-launch"

# What vLLM accepts is not listed here: it is the collection's vocabulary module, the one the
# controller-side preflight reads. The vllm_instance role copies it beside this file; in a checkout or
# an installed collection it is plugins/module_utils/ of the collection (three directories up).
VOCABULARY_FILE = "_vllm_vocabulary.py"
VOCABULARY_MODULE = "_inferops_vllm_vocabulary"


def _load_vocabulary() -> Any:
    """The vocabulary module: one already loaded under VOCABULARY_MODULE (the preflight registers its
    own, so a process has one vocabulary), else the file beside this one or in the collection."""
    loaded = sys.modules.get(VOCABULARY_MODULE)
    if loaded is not None:
        return loaded
    here = Path(os.path.abspath(__file__)).parent
    candidates = (here / VOCABULARY_FILE, here.parents[2] / "plugins" / "module_utils" / VOCABULARY_FILE)
    for path in filter(Path.is_file, candidates):
        spec = importlib.util.spec_from_file_location(VOCABULARY_MODULE, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return sys.modules.setdefault(VOCABULARY_MODULE, module)
    raise ImportError(f"{PROG}: the vocabulary {VOCABULARY_FILE} is not at {' or '.join(map(str, candidates))}; "
                      "reinstall the launcher with the vllm_instance role, which copies both")


VOCAB = _load_vocabulary()

EXIT_OK = 0
EXIT_NO_TOML_PARSER = 1
EXIT_CONFIG = 2
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127

PR_SET_CHILD_SUBREAPER = 36
# Seconds the processes vLLM leaves behind get after SIGTERM before SIGKILL.
ORPHAN_GRACE_SECONDS = 5.0

VLLM_DEFAULT_PORT = 8000  # what vLLM listens on when server.port is not set
# vLLM fetches http(s) media URLs of multimodal requests from any host when --allowed-media-domains is
# absent or empty. "No domain" is this one name in the list: .invalid never resolves (RFC 6761).
NO_MEDIA_DOMAIN = "media-urls-disabled.invalid"
# A host name as vLLM compares it with a URL's host (exact, lower case, no port, no scheme).
_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
MEDIA_DOMAIN_RE = re.compile(rf"(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*")
# The instance key on every route but /health (inferops_vllm_auth.py, beside this file, on vLLM's
# PYTHONPATH): vLLM's own --api-key guards /v1, /v2, /inference and /cohere only.
AUTH_MIDDLEWARE = "inferops_vllm_auth.InstanceKeyMiddleware"
AUTH_MODULE_DIR = Path(__file__).resolve().parent
API_KEY_VAR = "VLLM_API_KEY"  # the variable vLLM itself reads
KEYS_FILE_VAR = "INFEROPS_VLLM_API_KEYS_FILE"  # the keys file the middleware reads (server.api_keys_file)
REDACTED = "<redacted>"

ENV_NAME_RE = re.compile(r"[A-Z_][A-Z0-9_]*")
# The log shows the values of these variables only; every other value is <redacted> (an
# [environment] entry may carry a token or a proxy URL with a password under any name).
SAFE_ENV_NAMES = frozenset({
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
    "TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY",
    "HF_HOME", "HF_HUB_CACHE", "PYTORCH_CUDA_ALLOC_CONF", "PYTHONUNBUFFERED", "PYTHONPATH", "TZ", "LANG", "LC_ALL",
})
# ... and of these families (vLLM's own settings, the KV transfer and collective libraries), unless
# the name looks secret (SECRET_NAME_RE).
SAFE_ENV_PREFIXES = ("VLLM_", "UCX_", "NIXL_", "NCCL_", "GLOO_")
SECRET_NAME_RE = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH")
# user:password@ in a URL (http://user:pw@proxy:3128): never logged, whatever the variable.
URL_CREDENTIALS_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/@\s]*@")
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


# Section order is also the order flags appear on argv.
SCHEMA: dict[str, dict[str, Key]] = {
    "server": {
        "host": Key("str", flag="--host"),
        "port": Key("int", flag="--port", minimum=1, maximum=65535),
        "served_model_name": Key("str", flag="--served-model-name"),
        "api_key_env": Key("env_name"),
        "api_keys_file": Key("str"),
        "shutdown_timeout": Key("int", flag="--shutdown-timeout", minimum=0),
        "allowed_media_domains": Key("str_list", flag="--allowed-media-domains"),
    },
    "model": {
        "name": Key("str"),
        "revision": Key("str", flag="--revision"),
        "dtype": Key("str", flag="--dtype", choices=VOCAB.DTYPES),
        "max_model_len": Key("int", flag="--max-model-len", minimum=1),
        "quantization": Key("str", flag="--quantization", choices=VOCAB.QUANTIZATION_METHODS),
        "tensor_parallel_size": Key("int", flag="--tensor-parallel-size", minimum=1),
        "pipeline_parallel_size": Key("int", flag="--pipeline-parallel-size", minimum=1),
        "enforce_eager": Key("bool", flag="--enforce-eager"),
        "trust_remote_code": Key("bool", flag="--trust-remote-code"),
    },
    "kv_cache": {
        "quant_dtype": Key("str", flag="--kv-cache-dtype", choices=VOCAB.KV_CACHE_DTYPES),
        "memory_bytes": Key("int", flag="--kv-cache-memory-bytes", minimum=1),
        "gpu_memory_utilization": Key("fraction", flag="--gpu-memory-utilization"),
        "num_gpu_blocks_override": Key("int", flag="--num-gpu-blocks-override", minimum=1),
        "block_size": Key("int", flag="--block-size", choices=VOCAB.BLOCK_SIZES),
        "enable_prefix_caching": Key("bool", flag="--enable-prefix-caching", negatable=True),
    },
    "scheduler": {
        "max_num_seqs": Key("int", flag="--max-num-seqs", minimum=1),
        "max_num_batched_tokens": Key("int", flag="--max-num-batched-tokens", minimum=1),
        "enable_chunked_prefill": Key("bool", flag="--enable-chunked-prefill", negatable=True),
    },
    "pd_disaggregation": {
        "enabled": Key("bool"),
        "role": Key("str", choices=tuple(VOCAB.PD_ROLES)),
        "kv_transfer_backend": Key("str", choices=tuple(VOCAB.KV_TRANSFER_BACKENDS)),
        "kv_buffer_device": Key("str", choices=VOCAB.KV_BUFFER_DEVICES),
        "kv_load_failure_policy": Key("str", choices=VOCAB.KV_LOAD_FAILURE_POLICIES),
        "side_channel_host": Key("str", env="VLLM_NIXL_SIDE_CHANNEL_HOST"),
        "kv_transfer_port": Key("int", env="VLLM_NIXL_SIDE_CHANNEL_PORT", minimum=1, maximum=65535),
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
        "args": Key("str_list"),
    },
}
REQUIRED_SECTIONS = ("server", "model")
FLAG_SECTIONS = ("server", "model", "kv_cache", "scheduler")

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


class NoTomlParserError(Exception):
    """Neither tomllib (Python 3.11+) nor tomli is importable."""


# --------------------------------------------------------------------------- loading


def load_config(path: Path) -> dict[str, Any]:
    """Read and parse the TOML file; every failure is a ConfigError with one clear message."""
    if tomllib is None:
        raise NoTomlParserError(
            f"no TOML parser: Python {sys.version_info.major}.{sys.version_info.minor} has no tomllib and the "
            f"tomli package is not installed for {sys.executable}; install tomli into this venv "
            "(pip install tomli) or use Python 3.11+"
        )
    try:
        data = path.read_bytes()
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigError([f"cannot read config file: {reason}; check the path and its permissions"]) from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError([f"config file is not valid UTF-8 ({exc}); save it as UTF-8"]) from exc
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"TOML syntax error: {exc}; fix the syntax"]) from exc


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


def _format(value: Any) -> str:
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _flags(config: Mapping[str, Any]) -> list[str]:
    """The flags of the TOML's keys, in SCHEMA order."""
    args: list[str] = []
    for section in FLAG_SECTIONS:
        table = config.get(section, {})
        for key, spec in SCHEMA[section].items():
            if not spec.flag or key not in table or spec.kind == "str_list":
                continue
            value = table[key]
            if spec.kind == "bool":
                if value:
                    args.append(spec.flag)
                elif spec.negatable:
                    args.append("--no-" + spec.flag[2:])
            else:
                args += [spec.flag, _format(value)]
    return args


def _kv_transfer_config(pd: Mapping[str, Any]) -> str:
    """--kv-transfer-config's compact JSON for an enabled [pd_disaggregation]."""
    backend = pd.get("kv_transfer_backend", "nixl")
    transfer = {
        "kv_connector": VOCAB.KV_TRANSFER_BACKENDS[backend],
        "kv_role": VOCAB.PD_ROLES[pd["role"]],
        "kv_buffer_device": pd.get("kv_buffer_device", "cuda"),
    }
    # Only a consumer loads KV; on a producer the policy would have nothing to act on.
    if pd["role"] == "decode" and "kv_load_failure_policy" in pd:
        transfer["kv_load_failure_policy"] = pd["kv_load_failure_policy"]
    return json.dumps(transfer, sort_keys=True, separators=(",", ":"))


CPU_LIST_RE = re.compile(r"[0-9]+(?:-[0-9]+)?(?:[,|][0-9]+(?:-[0-9]+)?)*")


def bound_cpus(bind: str) -> set[int] | None:
    """The CPUs of a VLLM_CPU_OMP_THREADS_BIND list ("0-3", "0,2", "0-3|4-7": every rank's, together), or None for
    vLLM's words ("auto", "nobind", ""), which leave the instance where systemd put it."""
    bind = bind.strip()
    if not CPU_LIST_RE.fullmatch(bind):
        return None
    cpus: set[int] = set()
    for part in re.split(r"[,|]", bind):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def _pin(config: Mapping[str, Any]) -> str | None:
    """Run the launcher, and so every process of the instance (API server, engine core, workers), on the cores of
    cpu.omp_threads_bind. vLLM binds only its OMP threads there; its other processes would float onto the cores of
    the host's other instances. Returns a problem, or None."""
    bind = str(config.get("cpu", {}).get("omp_threads_bind", ""))
    cpus = bound_cpus(bind)
    if not cpus:
        return None
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        return (f"cpu.omp_threads_bind = {json.dumps(bind)}: cannot run on those CPUs ({exc.strerror or exc}); this "
                f"host lets it use CPUs {_ranges(os.sched_getaffinity(0))}. Fix the instance's cpus in the inventory.")
    print(f"{PROG}: the instance runs on CPUs {bind} (cpu.omp_threads_bind)", file=sys.stderr)
    return None


def _ranges(cpus: set[int]) -> str:
    out, ordered = [], sorted(cpus)
    for cpu in ordered:
        if out and cpu == out[-1][1] + 1:
            out[-1][1] = cpu
        else:
            out.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def _build_env(config: Mapping[str, Any], environ: Mapping[str, str] | None) -> dict[str, str]:
    """The variables the launcher sets: the API key's, those of the TOML's keys, then [environment]."""
    env: dict[str, str] = {}
    api_key_env = config["server"].get("api_key_env")
    if api_key_env:
        env[API_KEY_VAR] = (environ or {}).get(api_key_env, "")
    if config["server"].get("api_keys_file"):
        env[KEYS_FILE_VAR] = config["server"]["api_keys_file"]
    pd = config.get("pd_disaggregation", {})
    for section in ("pd_disaggregation", "cpu", "devices", "kv_fabric"):
        if section == "pd_disaggregation" and not pd.get("enabled"):
            continue
        table = config.get(section, {})
        for key, spec in SCHEMA[section].items():
            if spec.env and key in table:
                env[spec.env] = _format(table[key])
    env.update(config.get("environment", {}))
    return env


def build(config: Mapping[str, Any], environ: Mapping[str, str] | None) -> tuple[list[str], dict[str, str]]:
    """Build the vLLM command line and environment from a configuration.

    Returns ``(args, env)``: ``args`` is the argv *without* the executable, i.e.
    ``["serve", <model.name>, <flags>..., <extra.args>...]``; ``env`` holds only the
    variables the launcher sets (exec with ``{**os.environ, **env}``).  When
    server.api_key_env is set, env contains VLLM_API_KEY (a secret: never log it).
    ``environ=None`` (--check) skips the API key's presence: systemd loads it from the
    EnvironmentFile only when the service starts.
    Raises ConfigError listing every problem if the configuration is invalid.
    """
    problems = validate(config, environ)
    if problems:
        raise ConfigError(problems)

    args = ["serve", config["model"]["name"], *_flags(config)]
    env = _build_env(config, environ)
    pd = config.get("pd_disaggregation", {})
    if pd.get("enabled"):
        args += ["--kv-transfer-config", _kv_transfer_config(pd)]
    args += config.get("extra", {}).get("args", [])
    args += _security_flags(config)
    if config["server"].get("allowed_media_domains"):
        # vLLM follows redirects of a media URL by default: an allowed host could send it to an internal one.
        env.setdefault("VLLM_MEDIA_URL_ALLOW_REDIRECTS", "0")
    if _has_key(config):
        env["PYTHONPATH"] = os.pathsep.join(
            [str(AUTH_MODULE_DIR), *filter(None, [env.get("PYTHONPATH", (environ or {}).get("PYTHONPATH", ""))])]
        )
    return args, env


def _security_flags(config: Mapping[str, Any]) -> list[str]:
    """Last on argv, after extra.args (which may not set them): the media domains vLLM may fetch from
    (none unless server.allowed_media_domains lists some) and, with an API key, the middleware that
    requires it on every route but /health."""
    domains = config["server"].get("allowed_media_domains") or [NO_MEDIA_DOMAIN]
    args = ["--allowed-media-domains", *domains]
    if _has_key(config):
        args += ["--middleware", AUTH_MIDDLEWARE]
    return args


def _has_key(config: Mapping[str, Any]) -> bool:
    """Whether the instance requires a key (the middleware and its module's directory on PYTHONPATH)."""
    return bool(config["server"].get("api_key_env") or config["server"].get("api_keys_file"))


# --------------------------------------------------------------------------- command line


def loggable(name: str, value: str, api_key_env: str | None = None) -> bool:
    """Whether the log may show this variable's value: a known-safe name, and no URL credentials."""
    if name in (API_KEY_VAR, api_key_env) or URL_CREDENTIALS_RE.search(value):
        return False
    if name in SAFE_ENV_NAMES or name == KEYS_FILE_VAR:  # the keys file's path, not a key
        return True
    return name.startswith(SAFE_ENV_PREFIXES) and not SECRET_NAME_RE.search(name)


def report_lines(argv: Sequence[str], env: Mapping[str, str], api_key_env: str | None = None) -> list[str]:
    """The log lines for a launch: the shell-quoted command, then one line per variable (only known-safe
    values shown, the others redacted)."""
    lines = [f"{PROG}: exec: {shlex.join(argv)}"]
    for name, value in env.items():
        shown = shlex.quote(value) if loggable(name, value, api_key_env) else REDACTED
        lines.append(f"{PROG}: env: {name}={shown}")
    return lines


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="inferops_vllm_launch.py",
        description="Validate a vLLM instance TOML, build the `vllm serve` command and exec it.",
    )
    parser.add_argument("--config", required=True, type=Path, help="instance TOML, e.g. /etc/vllm/NAME.toml")
    parser.add_argument("--check", action="store_true", help="validate and print the command; do not exec")
    parser.add_argument(
        "--vllm-bin",
        type=Path,
        default=None,
        help="vLLM executable (default: the vllm script next to this Python interpreter)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    options = _parse_args(argv)
    path: Path = options.config

    def fail(problems: Sequence[str]) -> int:
        for problem in problems:
            print(f"{PROG}: {path}: {problem}", file=sys.stderr)
        return EXIT_CONFIG

    try:
        config = load_config(path)
    except NoTomlParserError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_NO_TOML_PARSER
    except ConfigError as exc:
        return fail(exc.problems)

    environ = dict(os.environ)
    try:
        # --check runs where the service's EnvironmentFile is not loaded (Ansible's validate
        # step): the key's presence is checked at start, not here.
        args, env = build(config, None if options.check else environ)
    except ConfigError as exc:
        return fail(exc.problems)

    vllm_bin = options.vllm_bin or Path(sys.executable).parent / "vllm"
    exec_argv = [str(vllm_bin), *args]
    lines = report_lines(exec_argv, env, config["server"].get("api_key_env"))

    if options.check:
        for line in lines:
            print(line)
        print(f"{PROG}: {path}: config OK")
        return EXIT_OK

    for line in lines:
        print(line, file=sys.stderr)
    problem = _pin(config)
    if problem:
        return fail([problem])
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        child_env = {**environ, **env}
        if config["server"].get("api_keys_file"):
            # vLLM's own check would accept this one key only (and refuse the others of a rotation): the middleware
            # alone checks keys, from the file.
            child_env.pop(API_KEY_VAR, None)
        return supervise(str(vllm_bin), exec_argv, child_env)
    except OSError as exc:
        print(
            f"{PROG}: cannot exec {vllm_bin}: {exc.strerror or exc}; install vLLM into this venv or pass --vllm-bin",
            file=sys.stderr,
        )
        return EXIT_NOT_FOUND if isinstance(exc, FileNotFoundError) else EXIT_NOT_EXECUTABLE


# --------------------------------------------------------------------------- supervision


def _become_subreaper() -> None:
    """Orphans of vLLM's process tree become the launcher's children (Linux), so it can reap them."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
    except (OSError, AttributeError) as exc:
        print(f"{PROG}: warning: cannot become a subreaper ({exc}); processes vLLM leaves behind are "
              "left to systemd", file=sys.stderr)


def _children() -> list[int]:
    """PIDs whose parent is this process (zombies included), from /proc."""
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == me:
            found.append(int(entry))
    return found


def _reap_nohang() -> bool:
    """Reap every child that has exited; False once no child is left at all."""
    while True:
        try:
            pid = os.waitpid(-1, os.WNOHANG)[0]
        except ChildProcessError:
            return False
        if pid == 0:
            return True


def _stop_leftovers(grace: float) -> None:
    """SIGTERM, then after ``grace`` seconds SIGKILL, to every process left in vLLM's tree, until none is."""
    deadline = time.monotonic() + grace
    while _reap_nohang():
        left = _children()
        if not left:
            return
        sig = signal.SIGTERM if time.monotonic() < deadline else signal.SIGKILL
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def supervise(path: str, argv: list[str], env: Mapping[str, str], grace: float = ORPHAN_GRACE_SECONDS) -> int:
    """Run vLLM as a child, forward stop signals to it, and return its exit status once it and every
    process it left behind are gone. A vLLM killed by a signal is reported as the launcher dying of it."""
    _become_subreaper()
    state: dict[str, Any] = {"pid": None}

    def forward(signum, _frame):
        if state["pid"] is not None:
            try:
                os.kill(state["pid"], signum)
            except ProcessLookupError:
                pass

    stop_signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    for signum in stop_signals:
        signal.signal(signum, forward)
    state["pid"] = os.posix_spawn(path, argv, dict(env))
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == state["pid"]:
            break
    code = os.waitstatus_to_exitcode(status)
    state["pid"] = None
    _stop_leftovers(grace)
    if code < 0:
        # Die of the same signal, as systemd would have seen vLLM do (SIGTERM on stop counts as clean).
        if -code in stop_signals:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1)
        return 128 - code
    return code


if __name__ == "__main__":
    sys.exit(main())
