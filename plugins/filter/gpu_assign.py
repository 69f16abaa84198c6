# Copyright (c) inferops.vllm contributors
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Filter that gives each vLLM instance of a host its GPUs.

Documented in gpu_assign.yml beside this file.
"""

from __future__ import annotations

from ansible.errors import AnsibleFilterError

IDENTIFY_BY = ("uuid", "index")


def _size(value, what, name, problems):
    """A parallel size as a positive int, or None (with a problem recorded)."""
    size = None
    if not isinstance(value, bool):
        try:
            size = int(value)
        except (TypeError, ValueError):
            size = None
    if size is None or size < 1 or str(size) != str(value).strip():
        problems.append(f"instance {name}: {what} must be a whole number of 1 or more, got {value!r}")
        return None
    return size


MIB = 1024 * 1024
GIB = 1024 * MIB


def _reference(entry):
    """('index', int) or ('uuid', str) for an entry of an instance's gpus, or None if it is neither."""
    if isinstance(entry, bool):
        return None
    if isinstance(entry, int):
        return ("index", entry) if entry >= 0 else None
    if isinstance(entry, str) and entry.strip():
        text = entry.strip()
        if text.isdigit():
            return "index", int(text)
        return "uuid", text
    return None


def _show(refs):
    """[0, 1, 'GPU-...'] as the user wrote them, for messages."""
    return "[" + ", ".join(str(value) for _kind, value in refs) + "]"


def _describe(gpu):
    return f"GPU {gpu['index']} ({gpu['uuid']})" if gpu.get("uuid") else f"GPU {gpu['index']}"


def gpu_assign(
    instances, gpus=None, tensor_parallel_size=1, pipeline_parallel_size=1, identify_by="uuid", kv_cache_memory_bytes=0
):
    if not isinstance(instances, list):
        raise AnsibleFilterError(f"gpu_assign expects the host's list of instances, got {type(instances).__name__}")
    if identify_by not in IDENTIFY_BY:
        choices = ", ".join(IDENTIFY_BY)
        raise AnsibleFilterError(f"gpu_assign: identify_by must be one of {choices}, got {identify_by!r}")
    facts = sorted((dict(gpu) for gpu in gpus or []), key=lambda gpu: int(gpu["index"]))
    for gpu in facts:
        gpu["index"] = int(gpu["index"])
    by_index = {gpu["index"]: gpu for gpu in facts}
    by_uuid = {str(gpu["uuid"]).lower(): gpu for gpu in facts if gpu.get("uuid")}
    host_gpus = ", ".join(str(index) for index in by_index)

    def output(gpu):
        return gpu["uuid"] if identify_by == "uuid" and gpu.get("uuid") else gpu["index"]

    problems = []
    placed = {}  # instance name -> the GPU facts it got, for the memory check
    plans = []  # (instance copy, needed GPUs, explicit refs or None)
    taken = {}  # duplicate key -> (instance name, ref as written)
    for number, inst in enumerate(instances, start=1):
        if not isinstance(inst, dict) or not inst.get("name"):
            problems.append(f"instance #{number} has no name: every instance needs a name")
            continue
        name = inst["name"]
        overrides = inst.get("overrides") or {}
        tp = _size(overrides.get("tensor_parallel_size", tensor_parallel_size), "tensor_parallel_size", name, problems)
        pp = _size(
            overrides.get("pipeline_parallel_size", pipeline_parallel_size), "pipeline_parallel_size", name, problems
        )
        out = dict(inst)
        given = inst.get("gpus")
        if given is None or given == []:
            out["gpus"] = []
            plans.append((out, tp * pp if tp and pp else None, tp, pp))
            continue
        if not isinstance(given, list):
            problems.append(f"instance {name}: gpus must be a list of GPU indices or UUIDs, got {given!r}")
            continue

        refs = []
        resolved = []
        for entry in given:
            ref = _reference(entry)
            if ref is None:
                problems.append(
                    f"instance {name} lists GPU {entry!r}, which is neither a GPU index (0, 1, ...) nor a UUID "
                    f"(GPU-...): write the index or the UUID that nvidia-smi shows"
                )
                continue
            refs.append(ref)
            gpu = None
            if facts:
                kind, value = ref
                gpu = by_index.get(value) if kind == "index" else by_uuid.get(value.lower())
                if gpu is None:
                    problems.append(
                        f"instance {name} lists GPU {value}, which this host does not have (its GPUs are "
                        f"{host_gpus}): list one of these indices or their UUIDs"
                    )
                    continue
                if gpu.get("mig_mode") == "enabled":
                    problems.append(
                        f"instance {name} lists {_describe(gpu)}, which has MIG enabled: vLLM cannot use a GPU in "
                        f"MIG mode as a whole; disable MIG (nvidia-smi -i {gpu['index']} -mig 0) or list another GPU"
                    )
                resolved.append(gpu)
                key = ("gpu", gpu["index"])
                what = _describe(gpu)
            else:
                key = ref
                what = f"GPU {ref[1]}"
            if key in taken:
                other, other_ref = taken[key]
                written = f"as {other_ref[1]} and as {ref[1]}" if other_ref != ref else f"as {ref[1]}"
                if other == name:
                    problems.append(f"instance {name} lists {what} twice ({written}): list every GPU once")
                else:
                    problems.append(
                        f"{what} is given to both instance {other} and instance {name} ({written}): "
                        f"give every GPU to one instance only"
                    )
                continue
            taken[key] = (name, ref)

        if tp and pp and len(given) != tp * pp:
            problems.append(
                f"instance {name} lists {len(given)} GPUs {_show(refs)} but tensor_parallel_size {tp} × "
                f"pipeline_parallel_size {pp} = {tp * pp}: list {tp * pp} GPUs or change the parallel sizes"
            )
        if facts and len(resolved) == len(given):
            out["gpus"] = [output(gpu) for gpu in resolved]
            placed[name] = resolved
        else:
            out["gpus"] = [value for _kind, value in refs]
        plans.append((out, None, tp, pp))

    if problems:
        raise AnsibleFilterError("gpu_assign: " + "; ".join(problems))

    if facts:
        explicit = {key[1] for key in taken}
        mig = [gpu["index"] for gpu in facts if gpu.get("mig_mode") == "enabled" and gpu["index"] not in explicit]
        free = [gpu for gpu in facts if gpu["index"] not in explicit and gpu["index"] not in mig]
        assigned_before = 0
        for out, needed, tp, pp in plans:
            if needed is None:
                continue
            if len(free) < needed:
                left = ", ".join(str(gpu["index"]) for gpu in free) or "none"
                details = [
                    f"{len(explicit)} listed explicitly by instances",
                    f"{assigned_before} given to the instances before it",
                ]
                if mig:
                    details.append(f"{len(mig)} with MIG enabled ({', '.join(map(str, mig))})")
                raise AnsibleFilterError(
                    f"gpu_assign: instance {out['name']} needs {needed} GPUs (tensor_parallel_size {tp} × "
                    f"pipeline_parallel_size {pp}) but only {len(free)} of the host's {len(facts)} GPUs are left "
                    f"[{left}] ({', '.join(details)}): lower the parallel sizes, run fewer instances on this host "
                    f"or add GPUs"
                )
            out["gpus"] = [output(gpu) for gpu in free[:needed]]
            placed[out["name"]] = free[:needed]
            free = free[needed:]
            assigned_before += needed
        _check_memory(instances, placed, kv_cache_memory_bytes)
    return [out for out, _needed, _tp, _pp in plans]


def _check_memory(instances, placed, default_kv_bytes):
    """vLLM's kv_cache_memory_bytes is per GPU: it must fit in each of the instance's GPUs."""
    problems = []
    for inst in instances:
        kv = (inst.get("overrides") or {}).get("kv_cache_memory_bytes", default_kv_bytes)
        try:
            kv = int(kv or 0)
        except (TypeError, ValueError):
            continue  # the preflight reports a malformed size
        for gpu in placed.get(inst["name"], []) if kv > 0 else []:
            total = gpu.get("memory_total_mib")
            if total and kv > int(total) * MIB:
                problems.append(
                    f"instance {inst['name']} asks for a KV cache of {kv / GIB:.1f} GiB per GPU "
                    f"(kv_cache_memory_bytes {kv}) but {_describe(gpu)}"
                    f"{' ' + gpu['name'] if gpu.get('name') else ''} has {int(total) / 1024:.1f} GiB in all: "
                    f"lower vllm_instance_kv_cache_memory_bytes (or the instance's override) below the GPU's memory "
                    f"minus the model's weights"
                )
    if problems:
        raise AnsibleFilterError("gpu_assign: " + "; ".join(problems))


class FilterModule:
    def filters(self):
        return {"gpu_assign": gpu_assign}
