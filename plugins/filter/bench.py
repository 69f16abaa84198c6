# Copyright (c) inferops.vllm contributors
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Benchmark scenarios for ``vllm bench serve``: checked before any request, and turned into its command line.

Documented in bench_scenarios.yml beside this file; playbooks/benchmark.yml (the vllm_benchmark role) calls it
once on the controller before any host is contacted, and again on the benchmark host with the real URL,
tokenizer and result directory. Plain Python on plain data, unit-tested without Ansible.

What ``vllm bench serve`` of vLLM 0.32 does with each dataset comes from its source
(vllm/benchmarks/serve.py and vllm/benchmarks/datasets/datasets.py of the pinned wheel):

* ``random``: prompts of ``--random-prefix-len`` shared tokens plus ``--random-input-len`` tokens, each length
  drawn from [len x (1 - ratio), len x (1 + ratio)] (``--random-range-ratio``, in [0, 1)), outputs likewise
  around ``--random-output-len``. Synthetic: needs nothing but the tokenizer.
* ``prefix_repetition``: ``--prefix-repetition-num-prefixes`` random prefixes of ``-prefix-len`` tokens, each
  followed by ``num_prompts // num_prefixes`` random suffixes of ``-suffix-len`` tokens; outputs of
  ``-output-len``. Synthetic. vLLM refuses fewer prompts than prefixes.
* ``sharegpt``: the first turns of a ShareGPT-format JSON file (``--dataset-path``, a local file; offline), with
  ``--sharegpt-output-len`` output tokens. vLLM keeps only prompts of at most 1024 tokens whose prompt and
  output fit 2048 tokens (``is_valid_sequence``), so a request is at most min(1024 + output_len, 2048) tokens.

The other datasets of vLLM 0.32 (``hf``, ``burstgpt``, ``custom``, ``spec_bench``, ``speed_bench``, ...) need a
download from the Hugging Face hub or files of their own and are refused here.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from typing import Any

DATASETS = ("random", "prefix_repetition", "sharegpt")
OTHER_DATASETS = ("random-mm", "random-rerank", "hf", "burstgpt", "custom", "custom_audio", "custom_image",
                  "spec_bench", "speed_bench", "timed_trace")
# vLLM 0.32's ShareGPT filter (vllm/benchmarks/datasets/datasets.py, is_valid_sequence).
SHAREGPT_MAX_PROMPT = 1024
SHAREGPT_MAX_TOTAL = 2048
COMMON_KEYS = ("name", "dataset", "output_len", "num_prompts", "rate", "concurrency", "burstiness", "seed", "goodput")
DATASET_KEYS = {
    "random": ("input_len", "range_ratio", "prefix_len"),
    "prefix_repetition": ("prefix_len", "suffix_len", "num_prefixes"),
    "sharegpt": ("dataset_path",),
}
REQUIRED = {"random": ("input_len",), "prefix_repetition": ("prefix_len", "suffix_len"), "sharegpt": ("dataset_path",)}
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
PERCENTILE_METRICS = "ttft,tpot,itl,e2el"
METRIC_PERCENTILES = "50,90,99"
VARIABLE = "vllm_benchmark_scenarios"
GOODPUT_VARIABLE = "vllm_benchmark_goodput_slos"
# Our SLO keys -> vllm bench serve's --goodput names (vLLM 0.32 check_goodput_args: ttft, tpot, e2el, in ms). A
# request counts towards request_goodput when it met every SLO given (its value <= the SLO).
GOODPUT_KEYS = {"ttft_ms": "ttft", "tpot_ms": "tpot", "e2el_ms": "e2el"}


class _Problems:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, where: str, field: str, what: str, fix: str, check: str = "scenario") -> None:
        self.lines.append(f"[{check}] {where}: {field}: {what} Fix: {fix}")


def _show(value: Any) -> str:
    return "null" if value is None else repr(value) if isinstance(value, str) else str(value)


def _whole(value: Any) -> int | None:
    """A whole number (an int, or a string or float that is one), else None; booleans are not numbers."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
        return int(value)
    return None


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _positive_int(p: _Problems, where: str, sc: Mapping[str, Any], key: str, minimum: int = 1) -> int | None:
    value = _whole(sc.get(key))
    if value is None or value < minimum:
        what = "a whole number >= 0" if minimum == 0 else "a positive whole number"
        p.add(where, key, f"is {_show(sc.get(key))}, not {what}.", f"give {key} as {what}.")
        return None
    return value


def _rate(p: _Problems, where: str, value: Any) -> float | str | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("inf", "infinity")):
        return "inf"
    number = _number(value)
    if number is None or number <= 0:
        p.add(where, "rate", f"is {_show(value)}, not a positive number of requests per second.",
              "give the request rate in requests/s (e.g. 2 or 0.5), or 'inf' to send every prompt at once.")
        return None
    return number


def _goodput(p: _Problems, where: str, prefix: str, value: Any, check: str = "scenario") -> dict[str, float] | None:
    """The SLOs of ``--goodput`` ({ttft_ms: 500, tpot_ms: 100}) checked: {} for none, None when wrong.

    ``prefix`` starts each field's name: ``goodput.`` in a scenario, empty for the role's default.
    """
    if value is None:
        return {}
    example = "{ttft_ms: 500, tpot_ms: 100}"
    if not isinstance(value, Mapping):
        p.add(where, prefix.rstrip(".") or "(mapping)", f"is {_show(value)}, not a mapping of SLOs in milliseconds.",
              f"give it as {example} (keys {', '.join(GOODPUT_KEYS)}), or leave it out for no goodput.", check)
        return None
    slos: dict[str, float] = {}
    ok = True
    unknown = sorted(str(k) for k in value if k not in GOODPUT_KEYS)
    if unknown:
        p.add(where, ", ".join(prefix + k for k in unknown),
              f"{'is not an SLO' if len(unknown) == 1 else 'are not SLOs'} that vllm bench serve measures goodput by "
              f"(known: {', '.join(GOODPUT_KEYS)}).",
              f"use ttft_ms (time to first token), tpot_ms (time per output token) or e2el_ms (whole request), "
              f"e.g. {example}.", check)
        ok = False
    for key in GOODPUT_KEYS:
        if key not in value:
            continue
        number = _number(value[key])
        if number is None or number <= 0:
            p.add(where, prefix + key, f"is {_show(value[key])}, not a positive number of milliseconds.",
                  f"give the SLO in milliseconds, e.g. {key}: 500 (a request meets it when its "
                  f"{GOODPUT_KEYS[key].upper()} is at most that).", check)
            ok = False
        else:
            slos[key] = number
    return slos if ok else None


def goodput_argv(slos: Mapping[str, float]) -> list[str]:
    """``--goodput ttft:500 tpot:100`` for vllm bench serve (empty without SLOs)."""
    pairs = [f"{GOODPUT_KEYS[key]}:{slos[key]:g}" for key in GOODPUT_KEYS if key in slos]
    return ["--goodput", *pairs] if pairs else []


def _limits(limits: Any) -> tuple[int | None, str | None, list[str]]:
    """(smallest known max_model_len, the instance that has it, instances whose max_model_len is unknown)."""
    known: list[tuple[int, str]] = []
    unknown: list[str] = []
    for item in limits or []:
        if not isinstance(item, Mapping):
            continue
        label = str(item.get("label") or item.get("host") or "?")
        value = _whole(item.get("max_model_len"))
        if value:
            known.append((value, label))
        else:
            unknown.append(label)
    if not known:
        return None, None, unknown
    value, label = min(known)
    return value, label, unknown


def _lengths(sc: dict[str, Any]) -> tuple[int, int, str]:
    """(longest prompt, longest output, how the prompt is made up) that vLLM's dataset can produce."""
    dataset = sc["dataset"]
    if dataset == "random":
        ratio = sc["range_ratio"]
        prompt = sc["prefix_len"] + math.ceil(sc["input_len"] * (1 + ratio))
        output = math.ceil(sc["output_len"] * (1 + ratio))
        how = (f"prefix_len {sc['prefix_len']} + input_len {sc['input_len']}" if sc["prefix_len"]
               else f"input_len {sc['input_len']}") + (f" x (1 + range_ratio {ratio:g})" if ratio else "")
        return prompt, output, how
    if dataset == "prefix_repetition":
        return (sc["prefix_len"] + sc["suffix_len"], sc["output_len"],
                f"prefix_len {sc['prefix_len']} + suffix_len {sc['suffix_len']}")
    prompt = min(SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL - sc["output_len"])
    return prompt, sc["output_len"], (f"ShareGPT prompts, which vLLM keeps up to {SHAREGPT_MAX_PROMPT} tokens "
                                      f"and {SHAREGPT_MAX_TOTAL} with the output")


def _check_one(p: _Problems, index: int, raw: Any, names: set[str]) -> dict[str, Any] | None:
    if not isinstance(raw, Mapping):
        p.add(f"{VARIABLE}[{index}]", "(entry)", f"is {_show(raw)}, not a mapping.",
              "write each scenario as {name, dataset, input_len, output_len, num_prompts, rate, concurrency}.")
        return None
    name = raw.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        p.add(f"{VARIABLE}[{index}]", "name", f"is {_show(name)}, not a name of 1 to 64 characters of "
              "A-Z a-z 0-9 . _ - (it names the result file).",
              "give every scenario a short name such as 'short-prompts'.")
        where = f"{VARIABLE}[{index}]"
    else:
        where = f"scenario '{name}'"
        if name in names:
            p.add(where, "name", "is used by two scenarios; each one's result file is named after it.",
                  "give every scenario its own name.")
        names.add(name)
    before = len(p.lines)
    dataset = raw.get("dataset", "random")
    if dataset not in DATASETS:
        other = (" vLLM 0.32 has it, but it needs a download from the Hugging Face hub or files that this playbook "
                 "does not provide." if dataset in OTHER_DATASETS else "")
        p.add(where, "dataset", f"is {_show(dataset)}, not a dataset that vllm bench serve runs offline here "
              f"({', '.join(DATASETS)}).{other}",
              "use 'random' (synthetic prompts of input_len tokens), 'prefix_repetition' (shared prefixes) or "
              "'sharegpt' with dataset_path (a ShareGPT JSON file on the controller).")
        return None
    known = set(COMMON_KEYS) | set(DATASET_KEYS[dataset])
    unknown = sorted(str(k) for k in raw if k not in known)
    if unknown:
        p.add(where, ", ".join(unknown), f"{'is not a setting' if len(unknown) == 1 else 'are not settings'} of a "
              f"{dataset} scenario (known: {', '.join(sorted(known))}).", "remove or rename it.")
    for key in REQUIRED[dataset] + ("output_len", "num_prompts"):
        if raw.get(key) is None:
            p.add(where, key, f"is missing; a {dataset} scenario needs it.", f"set {key}.")
    sc: dict[str, Any] = {"name": name, "dataset": dataset}
    for key in ("output_len", "num_prompts"):
        if raw.get(key) is not None:
            sc[key] = _positive_int(p, where, raw, key)
    sc["rate"] = _rate(p, where, raw.get("rate"))
    sc["concurrency"] = None
    if raw.get("concurrency") is not None:
        sc["concurrency"] = _positive_int(p, where, raw, "concurrency")
    sc["burstiness"] = 1.0
    if raw.get("burstiness") is not None:
        sc["burstiness"] = _number(raw.get("burstiness"))
        if sc["burstiness"] is None or sc["burstiness"] <= 0:
            p.add(where, "burstiness", f"is {_show(raw.get('burstiness'))}, not a positive number.",
                  "leave it out (1: Poisson arrivals), or give a positive number (below 1 burstier, above 1 steadier).")
    # Unset: the run's seed (options.seed), so that a second run sends new prompts, not cached ones.
    sc["seed"] = None if raw.get("seed") is None else _positive_int(p, where, raw, "seed", minimum=0)
    # A scenario's own goodput SLOs replace the role's (vllm_benchmark_goodput_slos); goodput: {} turns them off.
    if "goodput" in raw:
        sc["goodput"] = _goodput(p, where, "goodput.", raw.get("goodput"))
    if dataset == "random":
        if raw.get("input_len") is not None:
            sc["input_len"] = _positive_int(p, where, raw, "input_len")
        sc["prefix_len"] = 0 if raw.get("prefix_len") is None else _positive_int(p, where, raw, "prefix_len", 0)
        ratio = 0.0 if raw.get("range_ratio") is None else _number(raw.get("range_ratio"))
        if ratio is None or not 0 <= ratio < 1:
            p.add(where, "range_ratio", f"is {_show(raw.get('range_ratio'))}, not a number in [0, 1).",
                  "leave it out (every prompt input_len tokens), or give a ratio from 0 to below 1.")
        sc["range_ratio"] = ratio
    elif dataset == "prefix_repetition":
        for key in ("prefix_len", "suffix_len"):
            if raw.get(key) is not None:
                sc[key] = _positive_int(p, where, raw, key)
        sc["num_prefixes"] = 10 if raw.get("num_prefixes") is None else _positive_int(p, where, raw, "num_prefixes")
        if sc.get("num_prompts") and sc["num_prefixes"] and sc["num_prompts"] < sc["num_prefixes"]:
            p.add(where, "num_prompts", f"is {sc['num_prompts']}, fewer than num_prefixes {sc['num_prefixes']}: "
                  "vllm bench serve refuses that.", "send at least one prompt per prefix, or lower num_prefixes.")
    else:
        path = raw.get("dataset_path")
        if path is not None:
            if not isinstance(path, str) or not os.path.isabs(path) or not os.path.isfile(path):
                p.add(where, "dataset_path", f"is {_show(path)}, not the absolute path of a file on the controller.",
                      "give the ShareGPT-format JSON file's absolute path on the controller (it is copied to the "
                      "benchmark host).")
            sc["dataset_path"] = path
    if len(p.lines) > before:
        return None
    return sc


def _argv(sc: dict[str, Any], opts: Mapping[str, Any]) -> list[str]:
    argv = [f"{opts.get('venv') or '/opt/vllm/venv'}/bin/vllm", "bench", "serve", "--backend", "openai",
            "--endpoint", "/v1/completions", "--base-url", str(opts.get("base_url") or "http://FRONT:8000"),
            "--model", str(opts.get("model") or "MODEL"), "--tokenizer", str(opts.get("tokenizer") or "TOKENIZER"),
            "--dataset-name", sc["dataset"]]
    if sc["dataset"] == "random":
        argv += ["--random-input-len", str(sc["input_len"]), "--random-output-len", str(sc["output_len"]),
                 "--random-range-ratio", f"{sc['range_ratio']:g}", "--random-prefix-len", str(sc["prefix_len"])]
    elif sc["dataset"] == "prefix_repetition":
        argv += ["--prefix-repetition-prefix-len", str(sc["prefix_len"]),
                 "--prefix-repetition-suffix-len", str(sc["suffix_len"]),
                 "--prefix-repetition-num-prefixes", str(sc["num_prefixes"]),
                 "--prefix-repetition-output-len", str(sc["output_len"])]
    else:
        argv += ["--dataset-path", sc["remote_dataset_path"], "--sharegpt-output-len", str(sc["output_len"])]
    argv += ["--num-prompts", str(sc["num_prompts"]), "--request-rate", str(sc["rate"]),
             "--burstiness", f"{sc['burstiness']:g}"]
    if sc["concurrency"]:
        argv += ["--max-concurrency", str(sc["concurrency"])]
    argv += ["--ignore-eos", "--temperature", "0", "--seed", str(sc["seed"]), "--disable-tqdm",
             "--percentile-metrics", PERCENTILE_METRICS, "--metric-percentiles", METRIC_PERCENTILES,
             *goodput_argv(sc["goodput"]),
             "--save-result", "--result-dir", str(opts.get("result_dir") or "RESULT_DIR"),
             "--result-filename", sc["result_file"], "--label", sc["name"], "--metadata"]
    metadata = {"scenario": sc["name"], "dataset": sc["dataset"], "max_prompt_tokens": sc["max_prompt_tokens"],
                "max_output_tokens": sc["max_output_tokens"], "rate": sc["rate"], "concurrency": sc["concurrency"],
                "seed": sc["seed"],
                # The SLOs the result's request_goodput was measured against, for the report.
                "goodput_slos": " ".join(goodput_argv(sc["goodput"])[1:]) or None,
                **{k: v for k, v in (opts.get("metadata") or {}).items() if v is not None}}
    argv += [f"{key}={value}" for key, value in metadata.items() if value is not None]
    return argv


def bench_scenarios(scenarios: Any, limits: Any = None, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Check the scenarios and build each one's ``vllm bench serve`` command line (see bench_scenarios.yml)."""
    opts = dict(options or {})
    p = _Problems()
    max_len, max_len_from, unknown = _limits(limits)
    out: dict[str, Any] = {"scenarios": [], "problems": p.lines, "max_model_len": max_len,
                           "max_model_len_instance": max_len_from}
    if not isinstance(scenarios, list) or not scenarios:
        p.add(VARIABLE, "(list)", f"is {_show(scenarios) if not isinstance(scenarios, list) else 'empty'}, not a "
              "list of scenarios.", "give at least one scenario, e.g. [{name: short, dataset: random, input_len: "
              "128, output_len: 32, num_prompts: 20, rate: 1}].")
        return out
    if max_len is None:
        p.add(", ".join(unknown) or "every instance", "vllm_instance_max_model_len", "is 0 (the model's own) and the "
              "model's max_position_embeddings is not known, so no prompt length can be checked before the requests.",
              "set vllm_instance_max_model_len, or max_position_embeddings in vllm_instance_model_facts.",
              check="instances")
    default_goodput = _goodput(p, GOODPUT_VARIABLE, "", opts.get("goodput"), check="goodput")
    names: set[str] = set()
    remote_dir = str(opts.get("result_dir") or "RESULT_DIR")
    for index, raw in enumerate(scenarios):
        sc = _check_one(p, index, raw, names)
        if sc is None:
            continue
        prompt, output, how = _lengths(sc)
        where = f"scenario '{sc['name']}'"
        if max_len is not None and prompt + output > max_len:
            field = {"random": "input_len", "prefix_repetition": "prefix_len", "sharegpt": "output_len"}[sc["dataset"]]
            p.add(where, field, f"prompts of up to {prompt} tokens ({how}) + up to {output} output tokens = "
                  f"{prompt + output} tokens, more than max_model_len {max_len} ({max_len_from}, the smallest of the "
                  "instances): vLLM would refuse those requests.",
                  f"keep prompt + output within {max_len} tokens (lower input/prefix/suffix_len or output_len), or "
                  "raise vllm_instance_max_model_len." + (" ShareGPT prompts reach 1024 tokens: use the random "
                                                          "dataset on a shorter context." if sc["dataset"] == "sharegpt"
                                                          else ""))
            continue
        if "goodput" not in sc:
            sc["goodput"] = dict(default_goodput or {})
        if sc["seed"] is None:
            sc["seed"] = int(opts.get("seed") or 0)
        sc["seed"] += int(opts.get("seed_offset") or 0)
        sc.update(max_prompt_tokens=prompt, max_output_tokens=output, result_file=f"{sc['name']}.json",
                  expected_seconds=(round(sc["num_prompts"] / sc["rate"], 1) if sc["rate"] != "inf" else None))
        if sc["dataset"] == "sharegpt":
            sc["remote_dataset_path"] = f"{remote_dir}/dataset-{sc['name']}.json"
        sc["argv"] = _argv(sc, opts)
        out["scenarios"].append(sc)
    if p.lines:
        out["scenarios"] = []
    return out


# --------------------------------------------------------------------------- the KV path of a scenario

# vLLM 0.32's NIXL metrics (vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py): two histograms observed
# once per transfer by the instance that ran it (the decode side, which pulls the KV), and a counter.
XFER_TIME = "vllm:nixl_xfer_time_seconds"
BYTES = "vllm:nixl_bytes_transferred"
FAILED = "vllm:nixl_num_failed_transfers_total"
QUANTILE_METHOD = ("histogram_quantile: the bucket deltas summed over the instances, linear interpolation within "
                   "the bucket (as Prometheus does)")


def _histogram(samples: list[tuple[str, dict[str, str], float]], name: str) -> dict[str, Any] | None:
    """A histogram's buckets (upper bound -> cumulative count), count and sum, summed over engines; None if absent."""
    buckets: dict[float, float] = {}
    found = False
    count = total = 0.0
    for sname, labels, value in samples:
        if not math.isfinite(value):
            continue
        if sname == f"{name}_bucket":
            bound = _number(labels.get("le")) if labels.get("le") != "+Inf" else math.inf
            if bound is None:
                continue
            buckets[bound] = buckets.get(bound, 0.0) + value
            found = True
        elif sname == f"{name}_count":
            count += value
            found = True
        elif sname == f"{name}_sum":
            total += value
            found = True
    return {"buckets": buckets, "count": count, "sum": total} if found else None


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The q-quantile of a histogram's cumulative buckets (upper bound -> count), as Prometheus'
    histogram_quantile computes it: the bucket the rank falls in, linear interpolation between its bounds (the
    first bucket starts at 0); in the +Inf bucket, the highest finite bound. None without observations."""
    bounds = sorted(buckets)
    if not bounds or bounds[-1] != math.inf:
        return None
    total = buckets[math.inf]
    if total <= 0:
        return None
    rank = q * total
    previous_bound, previous_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if bound == math.inf:
                finite = [b for b in bounds if b != math.inf]
                return finite[-1] if finite else None
            if count == previous_count:
                return bound
            return previous_bound + (bound - previous_bound) * (rank - previous_count) / (count - previous_count)
        previous_bound, previous_count = bound, count
    return None


def _metrics():
    """plugins/module_utils/vllm_metrics.py, imported on first use, not with this file (see
    plugins/filter/preflight.py on why)."""
    from ansible_collections.inferops.vllm.plugins.module_utils import vllm_metrics

    return vllm_metrics


def _read(entry: Any) -> tuple[str, str, str, list | None, str | None]:
    """(label, role, url, samples or None, why not) of one /metrics read (a uri result of the role)."""
    vllm_metrics = _metrics()
    entry = entry if isinstance(entry, Mapping) else {}
    item = entry.get("item") if isinstance(entry.get("item"), Mapping) else {}
    label = " ".join(str(item[k]) for k in ("host", "name") if item.get(k)) or "?"
    role, url = str(item.get("role") or "?"), str(item.get("url") or "?")
    status = entry.get("status")
    if status != 200:
        why = f"HTTP {status}" if isinstance(status, int) and status > 0 else "no answer"
        msg = vllm_metrics.snippet(entry.get("msg") or "")
        return label, role, url, None, f"{why}{': ' + msg if msg else ''}"
    try:
        return label, role, url, vllm_metrics.parse_metrics(entry.get("content") or ""), None
    except vllm_metrics.MetricsError as exc:
        return label, role, url, None, str(exc)


def _went_down(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """Which series of a histogram went down between two reads (the instance restarted), or None."""
    if new["count"] < old["count"]:
        return f"_count went down from {old['count']:g} to {new['count']:g}"
    if new["sum"] < old["sum"]:
        return f"_sum went down from {old['sum']:g} to {new['sum']:g}"
    for bound, count in old["buckets"].items():
        if new["buckets"].get(bound, 0.0) < count:
            return f"_bucket{{le={bound:g}}} went down from {count:g} to {new['buckets'].get(bound, 0.0):g}"
    return None


def bench_kv(before: Any, after: Any, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The KV path of one scenario from every instance's /metrics read before and after it (see bench_kv.yml)."""
    opts = dict(options or {})
    scenario = str(opts.get("scenario") or "the scenario")
    input_tokens = _whole(opts.get("input_tokens"))
    out: dict[str, Any] = {
        "scenario": scenario, "transfers": None, "failed_transfers": None, "xfer_p50_ms": None, "xfer_p99_ms": None,
        "bytes": None, "xfer_seconds": None, "mb_per_s": None, "bytes_per_prompt_token": None,
        "input_tokens": input_tokens, "kv_moved": None, "complete": False, "quantile_method": QUANTILE_METHOD,
        "instances": [], "problems": [],
    }
    problems: list[str] = out["problems"]
    vllm_metrics = _metrics()
    if not vllm_metrics.HAS_PROMETHEUS_CLIENT:
        problems.append("the KV path was not measured: the controller's Python lacks prometheus_client, which reads "
                        "the instances' /metrics. Fix: pip install prometheus-client where ansible-playbook runs.")
        return out
    reads_after = {}
    for entry in after if isinstance(after, list) else []:
        label, role, url, samples, why = _read(entry)
        reads_after[(label, url)] = (role, samples, why)
    buckets: dict[float, float] = {}
    counted = {"transfers": 0.0, "bytes": 0.0, "seconds": 0.0, "failed": 0.0}
    complete = bool(reads_after)
    with_metric = 0
    for entry in before if isinstance(before, list) else []:
        label, role, url, old_samples, old_why = _read(entry)
        _role, new_samples, new_why = reads_after.pop((label, url), (role, None, "not read after the scenario"))
        inst: dict[str, Any] = {"instance": label, "role": role, "url": url, "status": "ok", "transfers": None,
                                "bytes": None, "xfer_seconds": None, "failed_transfers": None}
        out["instances"].append(inst)
        if old_samples is None or new_samples is None:
            when, why = ("before", old_why) if old_samples is None else ("after", new_why)
            inst["status"] = "unreadable"
            problems.append(f"{scenario}: could not read /metrics of {label} ({url}) {when} the scenario ({why}): "
                            "its transfers are not counted.")
            complete = False
            continue
        old_time, new_time = _histogram(old_samples, XFER_TIME), _histogram(new_samples, XFER_TIME)
        old_bytes, new_bytes = _histogram(old_samples, BYTES), _histogram(new_samples, BYTES)
        if new_time is None or new_bytes is None:
            if old_time is not None:
                inst["status"] = "restarted"
                problems.append(f"{scenario}: {label} ({url}): {XFER_TIME} was there before the scenario and is gone "
                                "after it: the instance restarted; its transfers are not counted. Run the scenario "
                                "again.")
                complete = False
            else:
                inst["status"] = "missing"
            continue
        with_metric += 1
        # A histogram vLLM had not created yet before the scenario counted nothing then.
        empty = {"buckets": {}, "count": 0.0, "sum": 0.0}
        old_time, old_bytes = old_time or empty, old_bytes or empty
        old_failed = vllm_metrics.sample_sum(old_samples, FAILED)
        new_failed = vllm_metrics.sample_sum(new_samples, FAILED)
        down = _went_down(old_time, new_time)
        down = down and f"{XFER_TIME}{down}"
        if not down:
            down = _went_down(old_bytes, new_bytes)
            down = down and f"{BYTES}{down}"
        if not down and new_failed < old_failed:
            down = f"{FAILED} went down from {old_failed:g} to {new_failed:g}"
        if down:
            inst["status"] = "restarted"
            problems.append(f"{scenario}: {label} ({url}): {down} during the scenario: the instance restarted (its "
                            "counters began again); its transfers are not counted. Run the scenario again.")
            complete = False
            continue
        for bound in set(old_time["buckets"]) | set(new_time["buckets"]):
            delta = new_time["buckets"].get(bound, 0.0) - old_time["buckets"].get(bound, 0.0)
            buckets[bound] = buckets.get(bound, 0.0) + delta
        inst.update(transfers=int(round(new_time["count"] - old_time["count"])),
                    bytes=int(round(new_bytes["sum"] - old_bytes["sum"])),
                    xfer_seconds=round(new_time["sum"] - old_time["sum"], 6),
                    failed_transfers=int(round(new_failed - old_failed)))
        counted["transfers"] += new_time["count"] - old_time["count"]
        counted["seconds"] += new_time["sum"] - old_time["sum"]
        counted["bytes"] += new_bytes["sum"] - old_bytes["sum"]
        counted["failed"] += new_failed - old_failed
    for (label, url), (_role, _samples, _why) in reads_after.items():
        problems.append(f"{scenario}: {label} ({url}) was read after the scenario but not before it: its transfers "
                        "are not counted.")
        complete = False
    if not out["instances"]:
        problems.append(f"{scenario}: no instance's /metrics was read, so the KV path was not measured.")
        return out
    if with_metric == 0:
        missing = ", ".join(i["instance"] for i in out["instances"] if i["status"] == "missing")
        if missing:
            problems.append(f"{scenario}: {XFER_TIME} and {BYTES} are missing from the /metrics of every instance "
                            f"read ({missing}): vLLM exports them only with the NixlConnector, so the KV path was not "
                            "measured. Is kv_transfer_config (NixlConnector) set on the instances?")
        out["complete"] = False
        return out
    seconds = counted["seconds"]
    moved = counted["bytes"]
    p50, p99 = histogram_quantile(0.5, buckets), histogram_quantile(0.99, buckets)
    out.update(
        transfers=int(round(counted["transfers"])), failed_transfers=int(round(counted["failed"])),
        xfer_p50_ms=None if p50 is None else round(p50 * 1000, 3),
        xfer_p99_ms=None if p99 is None else round(p99 * 1000, 3),
        bytes=int(round(moved)), xfer_seconds=round(seconds, 6),
        mb_per_s=round(moved / 1e6 / seconds, 3) if moved > 0 and seconds > 0 else None,
        bytes_per_prompt_token=round(moved / input_tokens, 1) if moved > 0 and input_tokens else None,
        kv_moved=counted["transfers"] > 0, complete=complete,
    )
    if out["transfers"] == 0:
        problems.append(f"{scenario}: NO KV MOVED: {XFER_TIME}_count did not grow on any instance during the "
                        "scenario, so decode computed every prompt itself and this row measures no disaggregation. "
                        "Check that the router runs in PD mode (--vllm-pd-disaggregation) and that the prompts are "
                        "longer than one token.")
    if out["failed_transfers"]:
        problems.append(f"{scenario}: {out['failed_transfers']} NIXL transfer(s) failed ({FAILED} grew).")
    return out


class FilterModule:
    def filters(self):
        return {"bench_scenarios": bench_scenarios, "bench_kv": bench_kv}
