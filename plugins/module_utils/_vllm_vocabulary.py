# Copyright (c) inferops.vllm contributors
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What the pinned vLLM (0.32) accepts, once: the vocabulary of the instance settings.

PRIVATE to the inferops.vllm collection: no compatibility promise; anything here may change or go in
any release. Other collections must not import it.

Who reads it
    - the controller-side preflight (plugins/plugin_utils/_preflight.py) imports it;
    - the instance TOML's schema (_vllm_instance_schema.py beside it) imports it, on the controller as on the
      hosts, where the vllm_instance role copies both files beside the launcher
      (roles/vllm_instance/files/inferops_vllm_launch.py), which imports the schema by name from its directory.
So it is standard library only, and runs on the hosts' python3 (3.10+) as on the controller.

What it holds
    the values vLLM accepts (DTYPES, QUANTIZATION_METHODS, KV_CACHE_DTYPES, BLOCK_SIZES, ...), the
    values it does not and why (kv_cache_dtype_refusal, DTYPE_MISSPELLINGS, NCCL_REMOVED,
    REMOVED_SETTINGS), and what vLLM makes of ``auto`` and of an unset block size (resolve_*).
    Messages about where a value is written (a TOML key, an inventory variable) belong to the reader.
"""

from __future__ import annotations

import re

VLLM_SERIES = "0.32"

# --dtype: vllm/config/model.py ModelDType = Literal["auto", "half", "float16", "bfloat16", "float", "float32"].
DTYPES = ("auto", "bfloat16", "float16", "float32", "half", "float")
# Spellings vLLM treats as the same dtype.
DTYPE_SYNONYMS = {"half": "float16", "float": "float32"}
# Spellings people write that vLLM's --dtype refuses, and the one it takes ("bf16" is no --dtype value).
DTYPE_MISSPELLINGS = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "bfloat": "bfloat16"}
# --dtype auto by checkpoint dtype (config.json torch_dtype): vLLM keeps 16-bit checkpoints as they
# are and downcasts float32 ones to the platform's preferred dtype, bfloat16 on GPUs since Ampere
# and on x86/aarch64 CPUs (vllm/config/model.py _resolve_auto_dtype).
AUTO_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "bfloat16"}
# A checkpoint's torch_dtype (config.json, torch's names) -> the canonical name above.
CHECKPOINT_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32",
                     "float": "float32"}

QUANTIZATION_METHODS = (
    "awq",
    "gptq",
    "bitsandbytes",
    "fp8",
    "compressed-tensors",
    "gguf",
    "awq_marlin",
    "gptq_marlin",
    "marlin",
    "experts_int8",
    "modelopt",
    "mxfp4",
)

# --kv-cache-dtype values that work on the builds this collection installs (vllm_install_variant cuda or
# cpu) and that the NIXL path and the KV sizing understand: vLLM's CacheDType (vllm/config/cache.py) less
# the values of KV_CACHE_DTYPE_REFUSED.
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
KV_CACHE_DTYPE_SYNONYMS = {"fp8": "fp8_e4m3"}
# Values vLLM's CacheDType has that this collection refuses, and why.
KV_CACHE_DTYPE_REFUSED = {
    "fp8_inc": "fp8_inc is Intel Gaudi's FP8 KV cache (vLLM's HPU build); vllm_install installs the cuda or cpu "
               "build, where it does not run",
    "fp8_ds_mla": "fp8_ds_mla is the FP8 KV layout of DeepSeek's sparse MLA models only (656 bytes per token, not "
                  "K and V per head), which the KV sizing and the prefill/decode checks cannot follow",
}
# "2bit", "int4", "4-bit", "q4", "nvfp4", "8" ...: integer/low-bit KV cache formats vLLM does not have.
LOW_BIT_KV_RE = re.compile(r"(?:u?int|i|q|nf|(?:nv|mx)?fp)?[-_]?(\d{1,2})(?:[-_ ]?(?:bits?|b))?")

BLOCK_SIZES = (1, 8, 16, 32, 64, 128)
# vLLM's block size when --block-size is not given: CacheConfig's DEFAULT_BLOCK_SIZE (16) on GPUs,
# 128 on the CPU build (vllm/platforms/cpu.py), by vLLM build (vllm_install_variant).
DEFAULT_BLOCK_SIZES = {"cuda": 16, "cpu": 128}

PD_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
KV_TRANSFER_BACKENDS = {"nixl": "NixlConnector"}
NCCL_REMOVED = (
    'the P2pNcclConnector (nccl backend) was removed from vLLM; use kv_transfer_backend = "nixl" '
    "(NixlConnector, UCX over RDMA/TCP), which works within and across hosts"
)
KV_BUFFER_DEVICES = ("cuda", "cpu")
# What a decode (kv_consumer) does when loading a request's KV from prefill fails: vLLM 0.32's
# KVTransferConfig.kv_load_failure_policy (vllm/config/kv_transfer.py; "fail" is vLLM's default).
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")

# How NIXL's UCX carries KV between prefill and decode hosts: "rdma" (InfiniBand or RoCE) or "tcp" (said on
# purpose: UCX also falls back to TCP silently when RDMA is missing, at a hundredth of the speed).
KV_TRANSPORTS = ("rdma", "tcp")
# UCX_TLS transport names and aliases (ucx_info -d lists a host's; "^" before the list excludes them instead).
UCX_RDMA_TRANSPORTS = ("ib", "rc", "rc_v", "rc_x", "rc_verbs", "rc_mlx5", "dc", "dc_x", "dc_mlx5", "ud", "ud_v",
                       "ud_x", "ud_verbs", "ud_mlx5", "srd")
UCX_TRANSPORTS = (*UCX_RDMA_TRANSPORTS, "all", "tcp", "sm", "shm", "self", "mm", "posix", "sysv", "xpmem", "cma",
                  "knem", "cuda", "cuda_copy", "cuda_ipc", "gdr_copy", "rocm", "rocm_copy", "rocm_ipc", "ze_copy")

_KV_SIZING = 'bound KV memory with kv_cache.memory_bytes or gpu_memory_utilization, shrink it with quant_dtype = "fp8"'
_NO_EVICTION = "token eviction is not in vLLM 0.32 (the KV cache is paged; preempted requests are recomputed)"
# Settings of the sources' posts that vLLM 0.32 does not have: name -> (TOML section, why, in the TOML's words).
# The launcher refuses them as TOML keys; the vllm_instance role refuses the vllm_instance_<name> variables
# (vars/main.yml _vllm_instance_unsupported, kept to these names by tests/unit/test_vocabulary.py).
REMOVED_SETTINGS = {
    "quantization_bits": ("model", "the bit width comes from the quantized checkpoint; vLLM has no such flag: "
                                   "use a pre-quantized (AWQ/GPTQ) model and set model.quantization"),
    "enable_token_eviction": ("kv_cache", f"{_NO_EVICTION}; {_KV_SIZING}, or cap model.max_model_len"),
    "eviction_ratio": ("kv_cache", f"{_NO_EVICTION}; {_KV_SIZING}, or cap model.max_model_len"),
    "swap_space": ("kv_cache", "--swap-space was removed from vLLM; preempted requests are recomputed. Use "
                               "kv_cache.memory_bytes / gpu_memory_utilization to size the KV cache (or CPU offloading "
                               "via extra args)"),
    "calculate_kv_scales": ("kv_cache", "removed from vLLM; fp8 KV scales come from the checkpoint or default to 1.0: "
                                        "delete this key"),
}


def low_bit_kv_label(value: object) -> str | None:
    """"2-bit", "4-bit", "8-bit integer" ... for a low-bit KV cache format vLLM does not have; None otherwise."""
    if not isinstance(value, str):
        return None
    match = LOW_BIT_KV_RE.fullmatch(value.strip().lower())
    if not match or int(match.group(1)) >= 16:
        return None
    bits = int(match.group(1))
    return "8-bit integer" if bits == 8 else f"{bits}-bit"


def kv_cache_dtype_refusal(value: object) -> str | None:
    """Why a refused KV cache dtype is refused, when there is more to say than "not one of"; else None."""
    label = low_bit_kv_label(value)
    if label:
        return f"vLLM {VLLM_SERIES} has no {label} KV cache"
    if isinstance(value, str) and value in KV_CACHE_DTYPE_REFUSED:
        return KV_CACHE_DTYPE_REFUSED[value]
    return None


def resolve_dtype(dtype: str | None, checkpoint_dtype: str | None) -> str | None:
    """The weight dtype vLLM runs with for a --dtype (None or "" = auto) and the checkpoint's dtype
    (config.json torch_dtype); None when it is auto and the checkpoint's dtype is unknown."""
    dtype = dtype or "auto"
    if dtype == "auto":
        checkpoint = DTYPE_SYNONYMS.get(checkpoint_dtype or "", checkpoint_dtype)
        return AUTO_DTYPES.get(checkpoint or "")
    return DTYPE_SYNONYMS.get(dtype, dtype)


def resolve_kv_cache_dtype(kv_cache_dtype: str | None, model_dtype: str | None) -> str | None:
    """The dtype vLLM stores the KV cache in: a --kv-cache-dtype (None or "" = auto), auto being the
    resolved weight dtype (resolve_dtype); None when that is unknown."""
    kv_cache_dtype = kv_cache_dtype or "auto"
    if kv_cache_dtype == "auto":
        return model_dtype
    return KV_CACHE_DTYPE_SYNONYMS.get(kv_cache_dtype, kv_cache_dtype)


def resolve_block_size(block_size: int | None, variant: str = "cuda") -> int:
    """Tokens per KV block: the --block-size, or vLLM's default for the build ("cuda" or "cpu") when it
    is not set (None or 0)."""
    if block_size:
        return block_size
    return DEFAULT_BLOCK_SIZES.get(variant, DEFAULT_BLOCK_SIZES["cuda"])
