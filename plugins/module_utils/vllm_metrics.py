# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Pure helpers for the inferops.vllm.vllm_health module.

Everything here works on text and plain data (no HTTP), so that it can be unit tested:

* :func:`parse_metrics` turns Prometheus text into ``(name, labels, value)`` samples;
* :func:`summarize_instance` reduces a vLLM ``/metrics`` page to the numbers the module reports;
* :func:`compare_expected` checks the live KV-cache configuration against what was asked for;
* :func:`evaluate_proof_request` decides from the summaries read right before and after one proof
  request whether prefill handed the KV of its whole prompt to decode over NIXL, and
  :func:`evaluate_pd_proof` combines the requests into the proof;
* :func:`prefix_cache_state` gives the prefix-cache counters and cache settings the
  inferops.vllm.vllm_prefix_cache_check module compares around its two requests;
* :func:`redact` / :func:`snippet` keep secrets and long bodies out of messages.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re

# prometheus_client is imported where it parses (parse_metrics), not here: the controller's filters
# (plugins/filter/bench.py) import this file in every forked worker that templates any of the
# collection's filters, and the import cost ~0.1 s each time (py-spy of a no-op deploy_pd.yml).
# find_spec of a top-level name finds the package without importing it.
HAS_PROMETHEUS_CLIENT = importlib.util.find_spec("prometheus_client") is not None
PROMETHEUS_CLIENT_IMPORT_ERROR = None if HAS_PROMETHEUS_CLIENT else "No module named 'prometheus_client'"

# vLLM sample names (as they appear in the text; counters keep their _total suffix).
PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits_total"
NIXL_XFER_COUNT = "vllm:nixl_xfer_time_seconds_count"
NIXL_XFER_SUM = "vllm:nixl_xfer_time_seconds_sum"
NIXL_BYTES_SUM = "vllm:nixl_bytes_transferred_sum"
NIXL_FAILED = "vllm:nixl_num_failed_transfers_total"
CACHE_CONFIG_INFO = "vllm:cache_config_info"

ROUTER_METRICS = {
    "pd_prefill_requests": "vllm_router_pd_prefill_requests_total",
    "pd_decode_requests": "vllm_router_pd_decode_requests_total",
    "worker_health": "vllm_router_worker_health",
}

# Counters that the proof compares before and after each proof request.
PROOF_COUNTERS = (
    "prompt_tokens_local_compute",
    "prompt_tokens_local_cache_hit",
    "prompt_tokens_external_kv_transfer",
    "nixl_transfers",
    "nixl_failed_transfers",
    "nixl_bytes_transferred",
    "nixl_xfer_time_seconds",
)

SNIPPET_LIMIT = 200
REDACTED = "********"
_BEARER_RE = re.compile(r"(?i)(bearer\s+)[^\s\"',;}]+")


class MetricsError(ValueError):
    """A /metrics page that cannot be read as vLLM Prometheus metrics."""


# --------------------------------------------------------------------------- text helpers


def redact(text, secrets=()):
    """``text`` with every secret and every ``Bearer <token>`` replaced by ``********``."""
    if text is None:
        return None
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    text = str(text)
    for secret in secrets:
        if secret:
            text = text.replace(secret, REDACTED)
    return _BEARER_RE.sub(lambda m: m.group(1) + REDACTED, text)


def snippet(body, secrets=(), limit=SNIPPET_LIMIT):
    """A short, single-line, redacted excerpt of a response body for messages."""
    text = redact(body, secrets) or ""
    text = " ".join(text.split())
    # Redact before shortening, so that a secret cut in half cannot survive.
    if len(text) > limit:
        text = text[:limit] + "..."
    return text


def redact_data(data, secrets=()):
    """Deep copy of JSON-like ``data`` with secrets removed from every string."""
    if isinstance(data, dict):
        return {redact_data(k, secrets): redact_data(v, secrets) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [redact_data(v, secrets) for v in data]
    if isinstance(data, (str, bytes)):
        return redact(data, secrets)
    return data


def version_matches(expected, live):
    """Whether the live ``/version`` satisfies the expected one.

    Exact match, or ``expected`` is a prefix at a dot boundary (``0.32`` accepts ``0.32.0``).
    A local version label (``0.32.0+cpu``) is ignored.
    """
    if expected is None:
        return True
    if live is None:
        return False
    expected = str(expected).strip()
    live_public = str(live).strip().split("+", 1)[0]
    expected_public = expected.split("+", 1)[0]
    if str(live).strip() == expected or live_public == expected_public:
        return True
    return "+" not in expected and live_public.startswith(expected + ".")


# --------------------------------------------------------------------------- parsing


def parse_metrics(text):
    """Parse Prometheus text exposition format into a list of ``(name, labels, value)``.

    Raises :class:`MetricsError` with a short reason when the text is not Prometheus text.
    """
    if not HAS_PROMETHEUS_CLIENT:  # pragma: no cover - the module checks this first
        raise MetricsError("the prometheus_client Python library is not installed")
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    if not isinstance(text, str):
        raise MetricsError(f"expected Prometheus text, got {type(text).__name__}")
    from prometheus_client.parser import text_string_to_metric_families  # pylint: disable=import-outside-toplevel

    try:
        samples = [
            (sample.name, dict(sample.labels), float(sample.value))
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        ]
    except Exception as exc:  # the parser raises ValueError, and sometimes IndexError/KeyError/TypeError
        raise MetricsError(f"not Prometheus text exposition format: {snippet(str(exc))}") from exc
    return samples


def _finite(value):
    return value is not None and not math.isnan(value) and not math.isinf(value)


def _matching(samples, name, labels):
    for sname, slabels, value in samples:
        if sname == name and all(slabels.get(k) == v for k, v in labels.items()) and _finite(value):
            yield slabels, value


def sample_sum(samples, name, **labels):
    """Sum of all samples called ``name`` whose labels include ``labels`` (over engines); 0.0 if absent."""
    return float(sum(value for _labels, value in _matching(samples, name, labels)))


def sample_max(samples, name, **labels):
    """Largest value of the matching samples, or None when there is none."""
    values = [value for _labels, value in _matching(samples, name, labels)]
    return max(values) if values else None


def _int(value):
    return int(round(value)) if _finite(value) else None


def _label_int(value):
    if value is None:
        return None
    try:
        return int(str(value).strip())
    except ValueError:
        try:
            number = float(str(value).strip())
        except ValueError:
            return None
        return int(number) if _finite(number) and number.is_integer() else None


def _label_str(value):
    if value is None or value == "None":
        return None
    return str(value)


def cache_config(samples):
    """The KV-cache settings vLLM reports in ``vllm:cache_config_info`` labels (engine 0 first)."""
    infos = [labels for labels, _value in _matching(samples, CACHE_CONFIG_INFO, {})]
    infos.sort(key=lambda labels: (labels.get("engine", "") != "0", labels.get("engine", "")))
    labels = infos[0] if infos else {}
    return {
        "block_size": _label_int(labels.get("block_size")),
        "cache_dtype": _label_str(labels.get("cache_dtype")),
        "kv_cache_size_tokens": _label_int(labels.get("kv_cache_size_tokens")),
        "num_gpu_blocks": _label_int(labels.get("num_gpu_blocks")),
    }


def _label_bool(value):
    text = _label_str(value)
    if text is None:
        return None
    return {"true": True, "false": False}.get(text.strip().lower())


def prefix_cache_state(samples):
    """What the prefix-cache check reads from one instance's samples: the ``vllm:prefix_cache_queries_total``
    and ``vllm:prefix_cache_hits_total`` counters (tokens, summed over engines) and the cache settings vLLM
    runs with (``vllm:cache_config_info``: ``cache_dtype``, ``enable_prefix_caching``, ``block_size``)."""
    infos = [labels for labels, _value in _matching(samples, CACHE_CONFIG_INFO, {})]
    infos.sort(key=lambda labels: (labels.get("engine", "") != "0", labels.get("engine", "")))
    labels = infos[0] if infos else {}
    return {
        "queries": _int(sample_sum(samples, PREFIX_CACHE_QUERIES)),
        "hits": _int(sample_sum(samples, PREFIX_CACHE_HITS)),
        "cache_dtype": _label_str(labels.get("cache_dtype")),
        "enable_prefix_caching": _label_bool(labels.get("enable_prefix_caching")),
        "block_size": _label_int(labels.get("block_size")),
    }


def summarize_samples(samples):
    """Summarise parsed vLLM samples: ``{"metrics": {...}, "cache_config": {...}}``.

    Counters and gauges are summed over engines (data-parallel ranks); the KV-cache usage is the
    largest of the engines. A counter that vLLM has not created yet (the NIXL ones appear at the
    first transfer) counts as 0.
    """
    if not any(name.startswith("vllm:") for name, _labels, _value in samples):
        raise MetricsError("no vllm: metrics found; is this the /metrics endpoint of a vLLM instance?")
    queries = sample_sum(samples, PREFIX_CACHE_QUERIES)
    hits = sample_sum(samples, PREFIX_CACHE_HITS)
    metrics = {
        "num_requests_running": _int(sample_sum(samples, NUM_REQUESTS_RUNNING)),
        "num_requests_waiting": _int(sample_sum(samples, NUM_REQUESTS_WAITING)),
        "kv_cache_usage_perc": sample_max(samples, KV_CACHE_USAGE),
        "prefix_cache_hit_rate": (hits / queries) if queries > 0 else None,
        "prompt_tokens_local_compute": _int(sample_sum(samples, PROMPT_TOKENS_BY_SOURCE, source="local_compute")),
        "prompt_tokens_local_cache_hit": _int(sample_sum(samples, PROMPT_TOKENS_BY_SOURCE, source="local_cache_hit")),
        "prompt_tokens_external_kv_transfer": _int(
            sample_sum(samples, PROMPT_TOKENS_BY_SOURCE, source="external_kv_transfer")
        ),
        "nixl_transfers": _int(sample_sum(samples, NIXL_XFER_COUNT)),
        "nixl_failed_transfers": _int(sample_sum(samples, NIXL_FAILED)),
        "nixl_bytes_transferred": _int(sample_sum(samples, NIXL_BYTES_SUM)),
        "nixl_xfer_time_seconds": round(sample_sum(samples, NIXL_XFER_SUM), 6),
    }
    return {"metrics": metrics, "cache_config": cache_config(samples)}


def summarize_instance(text):
    """Parse a vLLM ``/metrics`` page and summarise it (see :func:`summarize_samples`)."""
    return summarize_samples(parse_metrics(text))


def summarize_router(text):
    """vllm-router's own metrics per worker: ``{"pd_prefill_requests": {worker: n}, ...}``."""
    samples = parse_metrics(text)
    summary = {}
    for key, name in ROUTER_METRICS.items():
        per_worker = {}
        for labels, value in _matching(samples, name, {}):
            worker = labels.get("worker", "")
            per_worker[worker] = per_worker.get(worker, 0.0) + value
        summary[key] = {worker: _int(value) for worker, value in sorted(per_worker.items())}
    return summary


# --------------------------------------------------------------------------- expected vs live

# Option of `expected` -> key of cache_config.
EXPECTED_KEYS = (
    ("kv_cache_dtype", "cache_dtype"),
    ("block_size", "block_size"),
    ("kv_cache_size_tokens", "kv_cache_size_tokens"),
    ("num_gpu_blocks", "num_gpu_blocks"),
)


def compare_expected(name, url, live, expected):
    """Problems (list of str) where the live cache config differs from ``expected``.

    ``expected`` keys that are missing or None are not checked. Strings compare exactly.
    """
    problems = []
    live = live or {}
    for option, key in EXPECTED_KEYS:
        want = (expected or {}).get(option)
        if want is None:
            continue
        have = live.get(key)
        if have is None:
            problems.append(
                f"instance {name} ({url}): expected {option}={want} but its /metrics does not report {key} "
                f"(no {CACHE_CONFIG_INFO} sample)"
            )
            continue
        same = str(want) == str(have) if option == "kv_cache_dtype" else _label_int(want) == have
        if not same:
            hint = ""
            if option == "kv_cache_dtype" and str(want).startswith("fp8"):
                hint = " (the KV cache is not compressed as requested)"
            problems.append(f"instance {name} ({url}): expected {option}={want} but live {key}={have}{hint}")
    return problems


# --------------------------------------------------------------------------- PD proof

# Prompt tokens that decode computes itself for every request even when prefill handed over the KV of
# the whole prompt: vLLM recomputes the last prompt token, so that it has logits to sample the first
# output token from.
RECOMPUTED_PROMPT_TOKENS = 1


def _sum(values):
    return sum(v for v in values if v is not None)


def _roles(roles):
    prefill = sorted(n for n, r in roles.items() if r == "prefill")
    decode = sorted(n for n, r in roles.items() if r == "decode")
    return prefill, decode


def evaluate_proof_request(before, after, roles, prompt_tokens=None, number=1, count=1):
    """Decide whether one proof request's prompt went from prefill to decode by NIXL, in whole.

    ``before``/``after``: instance name -> ``metrics`` dict of :func:`summarize_samples`, read right
    before the request and after its answer; ``roles``: instance name -> ``prefill``/``decode``/``none``;
    ``prompt_tokens``: the request's prompt tokens from its response (None if unknown: then the larger
    of the prompt tokens that decode counted from all sources and that prefill counted stands in);
    ``number``/``count``: which request of how many, for the messages.

    The deltas are summed over the decode instances and over the prefill instances, since the router
    may send the request to any of them. The request is handed over when decode received at least its
    prompt tokens minus :data:`RECOMPUTED_PROMPT_TOKENS` by ``external_kv_transfer``, computed at most
    :data:`RECOMPUTED_PROMPT_TOKENS` itself, prefill computed (or had cached) at least as many as decode
    had to receive, NIXL recorded at least one transfer and no failed one.

    Returns a dict with the request's figures, ``handoff_proven`` and ``problems`` (list of str).
    """
    prefill, decode = _roles(roles)
    label = f"request {number} of {count}"
    problems = []

    def delta(name, key):
        old = (before.get(name) or {}).get(key) or 0
        new = (after.get(name) or {}).get(key) or 0
        if new < old:
            problems.append(
                f"{label}: instance {name}: {key} went down from {old} to {new} during the request; was it restarted?"
            )
            return 0
        return new - old

    deltas = {n: {key: delta(n, key) for key in PROOF_COUNTERS} for n in prefill + decode}
    pd = prefill + decode
    external = _sum(deltas[n]["prompt_tokens_external_kv_transfer"] for n in decode)
    local = _sum(deltas[n]["prompt_tokens_local_compute"] for n in decode)
    cache_hit = _sum(deltas[n]["prompt_tokens_local_cache_hit"] for n in decode)
    prefill_handled = _sum(
        deltas[n]["prompt_tokens_local_compute"] + deltas[n]["prompt_tokens_local_cache_hit"] for n in prefill
    )
    transfers = _sum(deltas[n]["nixl_transfers"] for n in pd)
    failed = _sum(deltas[n]["nixl_failed_transfers"] for n in pd)
    # Without the response's usage, the prompt is as long as the instances counted it.
    prompt = prompt_tokens if prompt_tokens is not None else max(external + local + cache_hit, prefill_handled)
    expected = max(prompt - RECOMPUTED_PROMPT_TOKENS, 1)

    # Name the decode instances that counted the request, or all of them when none did.
    counted = [
        n
        for n in decode
        if deltas[n]["prompt_tokens_external_kv_transfer"]
        or deltas[n]["prompt_tokens_local_compute"]
        or deltas[n]["prompt_tokens_local_cache_hit"]
    ]
    decode_names = ", ".join(counted or decode)
    prefill_names = ", ".join(prefill)
    of_prompt = (
        f"{prompt_tokens} prompt tokens"
        if prompt_tokens is not None
        else f"{prompt} prompt tokens as the instances counted them; the response reported no usage"
    )

    if external < expected or local > RECOMPUTED_PROMPT_TOKENS:
        reasons = []
        if external <= 0:
            reasons.append(f"no KV arrived by external_kv_transfer on decode ({decode_names})")
        elif external < expected:
            reasons.append("only part of the prompt's KV was handed over")
        if local > RECOMPUTED_PROMPT_TOKENS:
            reasons.append(
                f"the prompt was recomputed on decode instead of received from prefill "
                f"(at most {RECOMPUTED_PROMPT_TOKENS} local token per request is expected)"
            )
        cached = f", found {cache_hit} in its own prefix cache" if cache_hit else ""
        problems.append(
            f"{label} ({of_prompt}): decode ({decode_names}) received {external} of {expected} expected prompt "
            f"tokens by NIXL (external_kv_transfer), computed {local} itself{cached}: " + "; ".join(reasons)
        )
    if prefill_handled < expected:
        problems.append(
            f"{label} ({of_prompt}): prefill ({prefill_names}) computed {prefill_handled} prompt tokens "
            f"(at least {expected} expected): the prompt did not go through prefill"
        )
    if transfers <= 0:
        problems.append(
            f"{label}: NIXL recorded no transfer ({NIXL_XFER_COUNT} did not grow on {', '.join(pd)})"
            + (f" although decode received {external} prompt tokens by external_kv_transfer" if external > 0 else "")
        )
    if failed > 0:
        failing = [n for n in pd if deltas[n]["nixl_failed_transfers"]]
        grew = ", ".join(f"{n} +{deltas[n]['nixl_failed_transfers']}" for n in failing)
        problems.append(f"{label}: NIXL failed transfers grew ({grew})")

    return {
        "request": number,
        "prompt_tokens": prompt_tokens,
        "kv_tokens_expected": expected,
        "kv_tokens_transferred": external,
        "decode_local_compute_tokens": local,
        "prefill_served": {n: deltas[n]["prompt_tokens_local_compute"] for n in prefill},
        "decode_served": {n: deltas[n]["prompt_tokens_external_kv_transfer"] for n in decode},
        "nixl_transfers": transfers,
        "nixl_failed_transfers": failed,
        "nixl_failed_by_instance": {
            n: deltas[n]["nixl_failed_transfers"] for n in pd if deltas[n]["nixl_failed_transfers"]
        },
        "nixl_bytes_transferred": _sum(deltas[n]["nixl_bytes_transferred"] for n in pd),
        "nixl_xfer_time_seconds": round(_sum(deltas[n]["nixl_xfer_time_seconds"] for n in pd), 6),
        "handoff_proven": not problems,
        "problems": problems,
    }


def evaluate_pd_proof(per_request, roles):
    """Combine the evaluations of the proof requests (:func:`evaluate_proof_request`) into the proof.

    The handoff is proven only when there is at least one prefill and one decode instance, at least one
    evaluated request, and every request on its own was handed over; totals cannot hide a request that
    decode computed itself.

    Returns a dict with the totals over the requests, ``per_request`` (the requests' figures, without
    their problems), ``handoff_proven`` and ``problems`` (list of str).
    """
    prefill, decode = _roles(roles)
    problems = []
    if not prefill:
        problems.append("the PD proof needs at least one instance with role prefill")
    if not decode:
        problems.append("the PD proof needs at least one instance with role decode")
    if not per_request:
        problems.append("no proof request was served through the router, so the prefill/decode handoff is unproven")
    elif prefill and decode:
        for item in per_request:
            problems.extend(item["problems"])
        # What to do about failed transfers, once after the requests' problems (every request on a broken path fails).
        failing = list(dict.fromkeys(n for item in per_request for n in item.get("nixl_failed_by_instance") or {}))
        if failing:
            problems.append(
                f"NIXL failed transfers on {', '.join(failing)}: after a refused or reset KV connection (a port "
                f"blocked, a network outage) NIXL keeps the peer disconnected and an instance keeps failing until it "
                f"restarts: once the KV path between the hosts works again, roll "
                f"{'it' if len(failing) == 1 else 'them'} (playbooks/rolling_restart.yml -e "
                f"'{{\"vllm_rollout_instances\": {json.dumps(failing)}}}'; docs/day2.md, a broken KV path)"
            )

    def total(key):
        return _sum(item[key] for item in per_request)

    def per_instance(key, names):
        return {n: _sum(item[key].get(n) for item in per_request) for n in names}

    return {
        "requests": len(per_request),
        "prompt_tokens": (
            total("prompt_tokens")
            if per_request and all(item["prompt_tokens"] is not None for item in per_request)
            else None
        ),
        "prefill_served": per_instance("prefill_served", prefill),
        "decode_served": per_instance("decode_served", decode),
        "decode_local_compute_tokens": total("decode_local_compute_tokens"),
        "kv_tokens_transferred": total("kv_tokens_transferred"),
        "nixl_transfers": total("nixl_transfers"),
        "nixl_failed_transfers": total("nixl_failed_transfers"),
        "nixl_bytes_transferred": total("nixl_bytes_transferred"),
        "nixl_xfer_time_seconds": round(total("nixl_xfer_time_seconds"), 6),
        "per_request": [{k: v for k, v in item.items() if k != "problems"} for item in per_request],
        "handoff_proven": not problems,
        "problems": problems,
    }


def judge_kv_throughput(nixl_bytes, nixl_seconds, transport=None, bound_mib_s=0, per_request=None):
    """How fast NIXL moved the proof's KV, judged against the bound of the deployment's KV transport.

    ``nixl_bytes`` / ``nixl_seconds``: the growth of ``vllm:nixl_bytes_transferred_sum`` and
    ``vllm:nixl_xfer_time_seconds_sum`` over the proof requests (the time NIXL spent on the transfers themselves,
    not the requests' time). ``transport``: ``rdma`` or ``tcp`` as the deployment declared it (None when not
    known). ``bound_mib_s``: the least MiB/s expected over that transport; 0 or None judges nothing.

    ``per_request``: the proof requests' figures (:func:`evaluate_proof_request`'s ``request``,
    ``nixl_bytes_transferred``, ``nixl_xfer_time_seconds``), each judged on its own too: one request whose KV
    crawled (a decode that kept a stale agent for a restarted prefill, vLLM issue 49238) is named even when the
    others pull the total above the bound.

    Returns ``kv_transport``, ``nixl_throughput_mib_s`` (None without bytes or time), ``throughput_bound_mib_s``
    (None without a bound), ``throughput_ok`` (None when nothing was judged), ``slow_requests`` (the numbers of
    the requests below the bound) and ``problems``.
    """
    def mib_s(moved, took):
        return moved / 1048576 / took if (moved or 0) > 0 and (took or 0) > 0 else None

    nixl_bytes = nixl_bytes or 0
    nixl_seconds = nixl_seconds or 0.0
    throughput = mib_s(nixl_bytes, nixl_seconds)
    throughput = round(throughput, 3) if throughput is not None else None
    bound = float(bound_mib_s) if bound_mib_s else None
    result = {"kv_transport": transport, "nixl_throughput_mib_s": throughput, "throughput_bound_mib_s": bound,
              "throughput_ok": None, "slow_requests": [], "problems": []}
    if bound is None or throughput is None:
        return result
    slow = []
    for item in per_request or []:
        moved, took = item.get("nixl_bytes_transferred"), item.get("nixl_xfer_time_seconds")
        own = mib_s(moved, took)
        if own is not None and own < bound:
            slow.append(f"request {item.get('request')} at {own:.3g} MiB/s ({moved} bytes in {took * 1000:.1f} ms)")
            result["slow_requests"].append(item.get("request"))
    result["throughput_ok"] = throughput >= bound and not slow
    if slow:
        result["problems"].append(f"NIXL moved these proof requests' KV below the {bound:g} MiB/s expected: "
                                  + "; ".join(slow))
    if throughput < bound:
        over = f"over {transport}" if transport else "over the KV transport"
        why = (": that is the speed of TCP, the sign of UCX falling back from RDMA (docs/fabric.md: ucx_info -d, "
               "UCX_PROTO_INFO=y in the instance's environment shows the transport each transfer took)"
               if transport == "rdma" else
               " (a crowded CPU, a busy-polling NIXL worker or a stale peer after a restart slow it down)")
        result["problems"].append(
            f"NIXL moved the proof's KV at {throughput:g} MiB/s ({nixl_bytes} bytes in "
            f"{nixl_seconds * 1000:.1f} ms of transfers), below the {bound:g} MiB/s expected {over}{why}")
    return result


def router_deltas(before, after):
    """Growth of the router's PD request counters (sum over workers), or None without data."""
    if not before or not after:
        return None
    out = {}
    for key in ("pd_prefill_requests", "pd_decode_requests"):
        old = _sum((before.get(key) or {}).values())
        new = _sum((after.get(key) or {}).values())
        out[key] = max(new - old, 0)
    return out
