# Copyright (c) inferops.vllm contributors
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The KV-cache sizing of one vLLM instance, on the controller: bytes per token, blocks, tokens.

PRIVATE to the inferops.vllm collection: no compatibility promise; anything here may change or go in
any release. Other collections must not import it.

size(instance) gives the record the kv_sizing filter returns (plugins/filter/kv_sizing.yml) and the
capacity problems the pd_preflight filter reports: a cache that cannot hold one request of
max_model_len, a num_gpu_blocks_override beyond the budget, a fixed KV budget beyond the GPU.
vLLM's rule: blocks = floor(KV budget / (block_size x bytes per token)), per worker.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ansible_collections.inferops.vllm.plugins.plugin_utils._pd_instance import Instance
from ansible_collections.inferops.vllm.plugins.plugin_utils._pd_values import text, to_float, to_int

# Bytes per element of a resolved 16/32-bit dtype (every fp8 KV dtype takes 1).
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

Problem = tuple[str, str, str]  # (variable, what, fix)


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int, tp: int = 1, pp: int = 1) -> int:
    """KV bytes one token takes on one worker: 2 (K and V) x layers x KV heads x head_dim x bytes,
    with the layers split over pipeline stages (the largest stage counts) and the KV heads over
    tensor-parallel ranks (replicated, one per rank, when there are fewer heads than ranks)."""
    layers_per_worker = math.ceil(layers / max(pp, 1))
    heads_per_worker = max(1, math.ceil(kv_heads / max(tp, 1)))
    return 2 * layers_per_worker * heads_per_worker * head_dim * dtype_bytes


def kv_blocks(memory_bytes: int, block_size: int, bytes_per_token: int) -> int:
    """vLLM's block count for a KV budget: floor(memory / (block_size x bytes per token))."""
    if block_size <= 0 or bytes_per_token <= 0:
        return 0
    return max(0, int(memory_bytes) // (block_size * bytes_per_token))


def exact_word(sizing: Mapping[str, Any]) -> str:
    return "" if sizing.get("exact") else "at most "


def human_bytes(n: float) -> str:
    for unit, size_ in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size_:
            return f"{n / size_:.2f} {unit}"
    return f"{int(n)} B"


def kv_dtype_bytes(inst: Instance) -> tuple[int, str]:
    """Bytes per KV element of an instance, and how that was decided."""
    raw = inst.raw_kv_cache_dtype
    resolved = inst.kv_cache_dtype
    if resolved.startswith("fp8"):
        return 1, raw
    if raw == "auto":
        if resolved in DTYPE_BYTES:
            return DTYPE_BYTES[resolved], f"auto = {resolved}"
        return 2, "auto, assumed 16-bit (model dtype unknown)"
    return DTYPE_BYTES.get(resolved, 2), raw


@dataclass
class _Plan:
    """What the sizing of one instance starts from."""

    inst: Instance
    block: int
    block_default: bool
    max_len: int | None
    override: int
    memory: int
    util: float | None
    gpu_memory: int
    tp: int
    pp: int

    @classmethod
    def of(cls, inst: Instance) -> _Plan:
        s = inst.settings
        block, block_default = inst.block_size
        return cls(inst=inst, block=block, block_default=block_default, max_len=inst.max_model_len,
                   override=to_int(s.get("num_gpu_blocks_override") or 0) or 0,
                   memory=to_int(s.get("kv_cache_memory_bytes") or 0) or 0,
                   util=to_float(s.get("gpu_memory_utilization")),
                   gpu_memory=to_int(inst.published.get("gpu_memory_bytes") or 0) or 0,
                   tp=inst.tp or 1, pp=inst.pp or 1)

    @property
    def per_gpu(self) -> str:
        return "" if self.inst.variant == "cpu" else " per GPU"

    @property
    def weights_per_gpu(self) -> float | None:
        weights = self.inst.facts.weights_bytes
        return weights / (self.tp * self.pp) if weights else None

    def record(self) -> dict[str, Any]:
        inst = self.inst
        return {
            "host": inst.host, "instance": inst.name, "role": inst.group,
            "model": text(inst.published.get("model")), "model_facts_source": inst.facts.source,
            "kv_cache_dtype": text(inst.settings.get("kv_cache_dtype") or "auto"),
            "kv_dtype_bytes": kv_dtype_bytes(inst)[0],
            "tensor_parallel_size": self.tp, "pipeline_parallel_size": self.pp,
            "block_size": self.block, "block_size_is_default": self.block_default,
            "bytes_per_token": None, "budget": "unknown", "budget_bytes": None, "num_blocks": None,
            "num_gpu_blocks_override": self.override or None, "tokens": None, "exact": False,
            "max_model_len": self.max_len, "max_len_requests": None, "summary": "",
        }


def _override_below_one_request(p: _Plan) -> list[Problem]:
    if not (p.override and p.max_len and p.override * p.block < p.max_len):
        return []
    return [(
        p.inst.variable("num_gpu_blocks_override"),
        f"caps the KV cache at {p.override} blocks x {p.block} tokens = {p.override * p.block} tokens, less than one "
        f"request of max_model_len {p.max_len}: vLLM refuses to start.",
        f"raise it to at least {math.ceil(p.max_len / p.block)} (or 0 for no cap), "
        "or lower vllm_instance_max_model_len.",
    )]


def _per_token(p: _Plan) -> tuple[int, str]:
    """(KV bytes per token and worker, how they were computed)."""
    facts = p.inst.facts
    dtype_bytes, dtype_how = kv_dtype_bytes(p.inst)
    bpt = kv_bytes_per_token(facts.num_hidden_layers, facts.num_key_value_heads, facts.head_dim, dtype_bytes,
                             p.tp, p.pp)
    how = (
        f"{bpt} B/token = 2 x {math.ceil(facts.num_hidden_layers / p.pp)} layers x "
        f"{max(1, math.ceil(facts.num_key_value_heads / p.tp))} KV heads x {facts.head_dim} head_dim x "
        f"{dtype_bytes} B ({dtype_how}){p.per_gpu if p.tp * p.pp > 1 else ''}"
    )
    return bpt, how


def _fixed_budget(p: _Plan, bpt: int, out: dict[str, Any]) -> tuple[int, str, list[Problem]]:
    """kv_cache_memory_bytes: an exact budget; beyond the GPU (with the weights) is a problem."""
    out["budget"], out["budget_bytes"], out["exact"] = "kv_cache_memory_bytes", p.memory, True
    budget_how = f"kv_cache_memory_bytes {p.memory} ({human_bytes(p.memory)}){p.per_gpu}"
    weights = p.weights_per_gpu
    problems = []
    if p.gpu_memory and p.inst.variant != "cpu" and p.memory + (weights or 0) > p.gpu_memory:
        problems.append((
            p.inst.variable("kv_cache_memory_bytes"),
            f"{p.memory} B of KV cache{' plus ' + human_bytes(weights) + ' of weights' if weights else ''}"
            f" per GPU do not fit in the GPU's {p.gpu_memory} B (vllm_instance_gpu_memory_bytes).",
            "lower vllm_instance_kv_cache_memory_bytes, or spread the model over more GPUs.",
        ))
    return kv_blocks(p.memory, p.block, bpt), budget_how, problems


def _share_budget(p: _Plan, bpt: int, out: dict[str, Any]) -> tuple[int, str]:
    """gpu_memory_utilization of a known GPU, less the weights: an upper bound (activations are unknown)."""
    weights = p.weights_per_gpu
    upper = p.gpu_memory * p.util - (weights or 0)
    out["budget"], out["budget_bytes"] = "gpu_memory_utilization", max(0, int(upper))
    budget_how = (
        f"at most {human_bytes(max(0, upper))} per GPU = {p.util} (gpu_memory_utilization) x "
        f"{human_bytes(p.gpu_memory)}"
        + (f" - {human_bytes(weights)} weights" if weights else " (weights unknown)")
        + ", before activations: an upper bound"
    )
    return kv_blocks(max(0, int(upper)), p.block, bpt), budget_how


def _budget(p: _Plan, bpt: int, out: dict[str, Any]) -> tuple[int | None, str, list[Problem]]:
    """(blocks the budget holds or None when unknown, how the budget was found, its problems)."""
    if p.memory > 0:
        return _fixed_budget(p, bpt, out)
    if p.gpu_memory and p.util is not None:
        return (*_share_budget(p, bpt, out), [])
    return None, (
        f"gpu_memory_utilization {p.util} needs the GPU's memory; declare vllm_instance_gpu_memory_bytes "
        "(or set a fixed vllm_instance_kv_cache_memory_bytes)"
    ), []


def _override_beyond_budget(p: _Plan, fits: int | None, budget_how: str, how: str) -> list[Problem]:
    if not (p.override and fits is not None and p.override > fits):
        return []
    return [(
        p.inst.variable("num_gpu_blocks_override"),
        f"asks for {p.override} KV blocks, but {budget_how} holds only {fits} blocks of {p.block} tokens "
        f"({how}); vLLM would allocate more memory than the budget.",
        f"lower it to at most {fits}, or 0 to let vLLM size the cache.",
    )]


def _below_one_request(p: _Plan, out: dict[str, Any], fits: int | None, bpt: int,
                       texts: tuple[str, str]) -> list[Problem]:
    """A cache (not capped by a too small override, reported apart) smaller than one max_model_len request."""
    capped = bool(p.override) and (fits is None or p.override < fits)
    if not p.max_len or out["tokens"] >= p.max_len or capped:
        return []
    budget_how, how = texts
    need = math.ceil(p.max_len / p.block) * p.block * bpt
    variable = "kv_cache_memory_bytes" if p.memory > 0 else "gpu_memory_utilization"
    return [(
        p.inst.variable(variable),
        f"the KV cache holds {exact_word(out)}{out['tokens']} tokens ({out['num_blocks']} blocks x {p.block}; "
        f"{budget_how}; {how}), less than one request of max_model_len {p.max_len}: vLLM refuses to start.",
        f"give it at least {need} bytes ({human_bytes(need)}) of KV cache{p.per_gpu}, use kv_cache_dtype fp8, "
        f"or lower vllm_instance_max_model_len to at most {out['tokens']}.",
    )]


def _summary(p: _Plan, out: dict[str, Any], budget_how: str, how: str) -> str:
    inst = p.inst
    head = f"{inst.host}/{inst.name} ({inst.group})"
    block_how = f"block {p.block}{' (vLLM default on ' + inst.variant + ')' if p.block_default else ''}"
    blocks = out["num_blocks"]
    if blocks is None:
        return f"{head}: capacity unknown: {budget_how}. KV: {how}; {block_how}."
    capped_by = " (capped by num_gpu_blocks_override)" if p.override and blocks == p.override else ""
    reqs = f" = {out['max_len_requests']} requests of max_model_len {p.max_len}" if p.max_len else ""
    return (f"{head}: {exact_word(out)}{out['tokens']} tokens in {blocks} blocks of {p.block}{capped_by}{reqs}. "
            f"Budget: {budget_how}. KV: {how}; {block_how}.")


def size(inst: Instance) -> tuple[dict[str, Any], list[Problem]]:
    """The sizing of one instance (a kv_sizing record), and its capacity problems as (variable, what, fix)."""
    p = _Plan.of(inst)
    out = p.record()
    problems = _override_below_one_request(p)
    if not inst.facts.kv_known:
        out["summary"] = (
            f"{inst.host}/{inst.name} ({inst.group}): capacity unknown: the model's num_hidden_layers, "
            f"num_key_value_heads and head_dim are unknown ({inst.facts.error or 'a hub model'}); declare them in "
            "vllm_instance_model_facts."
        )
        return out, problems
    bpt, how = _per_token(p)
    out["bytes_per_token"] = bpt
    fits, budget_how, budget_problems = _budget(p, bpt, out)
    problems += budget_problems + _override_beyond_budget(p, fits, budget_how, how)
    blocks = fits
    if p.override:
        blocks = p.override if fits is None else min(p.override, fits)
    if blocks is not None:
        out["num_blocks"], out["tokens"] = blocks, blocks * p.block
        if p.max_len:
            out["max_len_requests"] = out["tokens"] // p.max_len
        problems += _below_one_request(p, out, fits, bpt, (budget_how, how))
    out["summary"] = _summary(p, out, budget_how, how)
    return out, problems
