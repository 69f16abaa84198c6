"""The preflight and the launcher agree: one vocabulary, walked value by value.

Every value of the launcher's vocabulary (roles/vllm_instance/files/inferops_vllm_launch.py: DTYPES,
QUANTIZATION_METHODS, KV_CACHE_DTYPES, BLOCK_SIZES, KV_BUFFER_DEVICES, KV_TRANSFER_BACKENDS,
KV_LOAD_FAILURE_POLICIES, the drain's range, the flags extra args may not pass, the variables
[environment] may not set; a test fails when a key with choices is added to the launcher's schema and
not walked here), and values next to it that it
refuses, goes through the launcher's own validate() on a minimal TOML and through the controller-side
preflight (inferops.vllm.pd_preflight on a whole inventory, and launcher_problems as the role's
preflight calls it). The preflight must refuse exactly what the launcher refuses, naming the host,
the instance and the variable. Parity checks compare resolved values (auto dtypes, default block
sizes), with the launcher's rules.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible_collections.inferops.vllm.plugins.plugin_utils import _preflight as pf
from ansible_collections.inferops.vllm.tests.unit.plugins.filter.test_preflight import router
from ansible_collections.inferops.vllm.tests.unit.plugins.filter.utils import COMMIT, GIB, SMOL
from ansible_collections.inferops.vllm.tests.unit.plugins.filter.utils import settings as base_settings

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "roles" / "vllm_instance" / "files" / "inferops_vllm_launch.py"
VOCABULARY_FILE = REPO / "plugins" / "module_utils" / "_vllm_vocabulary.py"
SCHEMA_FILE = REPO / "plugins" / "module_utils" / "_vllm_instance_schema.py"


def _import_launcher():
    spec = importlib.util.spec_from_file_location("inferops_vllm_launch_agreement", LAUNCHER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The launcher as a host runs it, imported on its own (not through the preflight).
launch = _import_launcher()
VOCAB = launch.schema.VOCAB  # what vLLM accepts, as the launcher's schema reads it


def settings(**kw: Any) -> dict[str, Any]:
    """The shared defaults with a context and a KV budget (the launcher needs both)."""
    return base_settings(**{"max_model_len": 512, "kv_cache_memory_bytes": GIB, **kw})


def published(role: str, *, backend: str = "nixl", variant: str = "cpu", facts: dict | None = None,
              instances: list[dict] | None = None, **kw: Any) -> dict[str, Any]:
    """A host's vllm_instance_published as roles/vllm_instance/tasks/publish.yml sets it."""
    host_settings = settings(**kw)
    address = "10.0.0.11" if role == "prefill" else "10.0.0.21"
    if instances is None:
        instances = [{"name": f"{role}-0", "port": 8100 if role == "prefill" else 8200,
                      "kv_transfer_port": 5600 if role == "prefill" else 5700}]
    resolved = [{**i, "overrides": dict(i.get("overrides") or {}),
                 "settings": {**host_settings, **(i.get("overrides") or {})}} for i in instances]
    return {
        "pd_role": role, "address": address, "served_model_name": "smol", "instances": resolved,
        "settings": host_settings, "address_source": "vllm_instance_host_address",
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct", "model_revision": COMMIT, "model_is_local": False,
        "model_facts": dict(SMOL) if facts is None else facts, "kv_transfer_backend": backend,
        "vllm_version": "0.32.0", "vllm_variant": variant, "api_key_set": True, "api_key_broken": False,
        "unsupported": {}, "booleans": {"vllm_install_wheelhouse_keep": False},
    }


def hostvars(prefill: dict | None = None, decode: dict | None = None, variables: dict | None = None,
             **both: Any) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """(hostvars, groups) of p1 (prefill), d1 (decode) and r1 (router): ``both`` goes to the published
    settings of both hosts, ``variables`` into both hosts' inventory variables."""
    out = {
        "p1": {"vllm_instance_published": published("prefill", **{**both, **(prefill or {})}), **(variables or {})},
        "d1": {"vllm_instance_published": published("decode", **{**both, **(decode or {})}), **(variables or {})},
        "r1": {"vllm_router_published": router()},
    }
    return out, {"prefill": ["p1"], "decode": ["d1"], "router": ["r1"]}


def names(line: str, variable: str) -> bool:
    return re.search(rf"(?:\] |: ){re.escape(variable)}: ", line) is not None


# --- the launcher's verdict ---------------------------------------------------------------------------

PD = {"enabled": True, "role": "prefill", "side_channel_host": "10.0.0.11", "kv_transfer_port": 5600}


def launcher_refuses(section: str, key: str, value: Any) -> bool:
    config: dict[str, Any] = {"server": {}, "model": {"name": "/var/lib/vllm/models/m"}}
    if section == "pd_disaggregation":
        config[section] = dict(PD)
    config.setdefault(section, {})[key] = value
    return bool(launch.validate(config))


# --- every value: (setting, TOML section, TOML key, value) ---------------------------------------------

REFUSED_SAMPLES = {
    "dtype": ["bf16", "fp16", "float64", "Auto", "BFLOAT16", "int8", "fp8", "bfloat"],
    "quantization": ["int4", "AWQ", "gptq-4bit", "nf4", "fp4", "awq4", "q4_k_m"],
    "kv_cache_dtype": ["int2", "2bit", "int4", "4-bit", "fp4", "int8", "q8", "FP8", "fp16", "fp8-e4m3", "e4m3"],
    "block_size": [2, 4, 24, 48, 256, 512],
    "kv_buffer_device": ["gpu", "CUDA", "nvme", "host"],
    "kv_transfer_backend": ["nccl", "p2pnccl", "NIXL", "mooncake", "lmcache"],
    "gpu_memory_utilization": [0.0, -0.1, 1.01, 1.5, 2],
    "kv_load_failure_policy": ["Recompute", "FAIL", "retry", "abort", "ignore", ""],
    "shutdown_timeout": [-1, -60],
    # "auto" (the role's default) is resolved before the TOML: rdma on the cuda build, tcp on the cpu build.
    "kv_transport": ["ib", "roce", "RDMA", "TCP", "infiniband"],
}
VOCABULARY = {
    "dtype": ("model", "dtype", VOCAB.DTYPES),
    "quantization": ("model", "quantization", VOCAB.QUANTIZATION_METHODS),
    "kv_cache_dtype": ("kv_cache", "quant_dtype", VOCAB.KV_CACHE_DTYPES),
    "block_size": ("kv_cache", "block_size", VOCAB.BLOCK_SIZES),
    "kv_buffer_device": ("pd_disaggregation", "kv_buffer_device", VOCAB.KV_BUFFER_DEVICES),
    "kv_transfer_backend": ("pd_disaggregation", "kv_transfer_backend", tuple(VOCAB.KV_TRANSFER_BACKENDS)),
    "gpu_memory_utilization": ("kv_cache", "gpu_memory_utilization", (0.05, 0.5, 0.9, 1.0)),
    "kv_load_failure_policy": ("pd_disaggregation", "kv_load_failure_policy", VOCAB.KV_LOAD_FAILURE_POLICIES),
    "shutdown_timeout": ("server", "shutdown_timeout", (0, 1, 60, 86400)),
    "kv_transport": ("kv_fabric", "transport", VOCAB.KV_TRANSPORTS),
}
# Settings only decode instances render (a producer loads no KV): the role's preflight of a prefill host
# does not see them (the role's argument spec refuses a bad value there), pd_preflight checks them everywhere.
DECODE_ONLY = {"kv_load_failure_policy"}
VALUE_CASES = [(setting, section, key, value)
               for setting, (section, key, accepted) in VOCABULARY.items()
               for value in (*accepted, *REFUSED_SAMPLES[setting])]

SECRET = "sk-AGREEMENT-SECRET-0001"
ALLOWED_ARGS = [
    ["--max-log-len", "100"],
    ["--disable-log-requests", "--uvicorn-log-level", "warning"],
    ["--return-tokens-as-token-ids"],
    ["--ssl-keyfile", "/etc/vllm/key.pem"],
    ["--allow-credentials"],
    ["--long-prefill-token-threshold", "512"],
    ["--kv-cache-dtype-skip-layers", "0"],
    ["-O3"],
]
REFUSED_ARGS = (
    # Every flag the launcher generates (both boolean spellings) and every reserved flag, in the
    # spellings vLLM accepts; the secret-bearing ones with a secret that must not be shown.
    [[flag, "1"] for flag in launch.schema.FLAG_OWNERS]
    + [[f"{flag}={SECRET}"] for flag in launch.schema.RESERVED_FLAGS]
    + [[flag.replace("-", "_").replace("__", "--", 1), SECRET] for flag in launch.schema.RESERVED_FLAGS]
    + [[alias, "2"] for alias in launch.schema.SHORT_ALIASES]
    + [["--openai-api-key", SECRET], ["--db-password", SECRET], [f"--s3-secret={SECRET}"], ["--access-token", SECRET],
       ["--api", SECRET], ["--hf-tok", SECRET], ["--max-model", "512"], ["-qawq"], ["max-log-len", "100"]]
)
ALLOWED_ENV = ["UCX_RNDV_SCHEME", "UCX_LOG_LEVEL", "HTTPS_PROXY", "HF_HUB_OFFLINE", "OMP_NUM_THREADS",
               "VLLM_LOGGING_LEVEL"]
REFUSED_ENV = [*launch.schema.ENV_OWNERS, "lower_case", "1ABC", "WITH-DASH"]

ALL_CASES = (
    VALUE_CASES
    + [("extra_args", "extra", "args", args) for args in ALLOWED_ARGS + REFUSED_ARGS]
    + [("environment", "environment", name, {name: SECRET}) for name in ALLOWED_ENV + REFUSED_ENV]
)


def _case_id(case) -> str:
    setting, _section, _key, value = case
    return f"{setting}={value!r}"[:80]


def _launcher_verdict(case) -> bool:
    setting, section, key, value = case
    if setting == "environment":
        return launcher_refuses(section, key, SECRET)
    return launcher_refuses(section, key, value)


def _inventory_for(case) -> tuple[dict[str, Any], dict[str, list[str]]]:
    setting, _section, _key, value = case
    if setting in ("extra_args", "environment"):
        return hostvars(variables={f"vllm_instance_{setting}": value})
    if setting == "kv_transfer_backend":
        return hostvars(backend=value)
    if setting == "gpu_memory_utilization":
        return hostvars(kv_cache_memory_bytes=0, gpu_memory_utilization=value)
    return hostvars(**{setting: value})


def test_every_choice_of_the_launchers_schema_is_walked():
    """A key with a list of values added to the launcher's SCHEMA must be walked here (VOCABULARY)."""
    walked = {(section, key) for section, key, _accepted in VOCABULARY.values()}
    with_choices = {(section, key) for section, keys in launch.schema.SCHEMA.items() for key, spec in keys.items()
                    if spec.choices}
    # The PD role comes from the inventory group, checked by the groups check.
    assert with_choices - walked == {("pd_disaggregation", "role")}
    for setting, (section, key, accepted) in VOCABULARY.items():
        spec = launch.schema.SCHEMA[section][key]
        if spec.choices:
            assert tuple(accepted) == tuple(spec.choices), setting


def test_the_cases_cover_the_whole_vocabulary():
    assert len(ALL_CASES) > 150
    for setting, (section, key, accepted) in VOCABULARY.items():
        assert not any(_launcher_verdict((setting, section, key, v)) for v in accepted), setting
        assert all(_launcher_verdict((setting, section, key, v)) for v in REFUSED_SAMPLES[setting]), setting
    assert not any(_launcher_verdict(("extra_args", "extra", "args", a)) for a in ALLOWED_ARGS)
    assert all(_launcher_verdict(("extra_args", "extra", "args", a)) for a in REFUSED_ARGS)


@pytest.mark.parametrize("case", ALL_CASES, ids=_case_id)
def test_pd_preflight_refuses_exactly_what_the_launcher_refuses(case):
    setting = case[0]
    variable = f"vllm_instance_{setting}"
    refused = _launcher_verdict(case)
    lines = pf.pd_preflight(*_inventory_for(case))
    if not refused:
        assert lines == [], f"the launcher accepts {case[3]!r}, the preflight does not:\n" + "\n".join(lines)
        return
    hits = [line for line in lines if names(line, variable)]
    assert hits, f"the launcher refuses {case[3]!r}, the preflight does not name {variable}:\n" + "\n".join(lines)
    # Both hosts, and for the launcher check the instance too.
    assert any("p1" in line for line in hits) and any("d1" in line for line in hits), hits
    if any(line.startswith("[launcher]") for line in hits):
        assert any("p1/prefill-0" in line and "d1/decode-0" in line for line in hits), hits
    assert SECRET not in "\n".join(lines)


@pytest.mark.parametrize("case", ALL_CASES, ids=_case_id)
def test_the_roles_preflight_refuses_exactly_what_the_launcher_refuses(case):
    """launcher_problems, as roles/vllm_instance/tasks/preflight.yml calls it for one host."""
    setting, _section, _key, value = case
    role, host = ("decode", "d1") if setting in DECODE_ONLY else ("prefill", "p1")
    variables: dict[str, Any] = {}
    kw: dict[str, Any] = {}
    if setting in ("extra_args", "environment"):
        variables[f"vllm_instance_{setting}"] = value
    elif setting == "kv_transfer_backend":
        kw["backend"] = value
    elif setting == "gpu_memory_utilization":
        kw.update(kv_cache_memory_bytes=0, gpu_memory_utilization=value)
    else:
        kw[setting] = value
    lines = pf.launcher_problems(published(role, **kw), host, variables)
    assert bool(lines) is _launcher_verdict(case), "\n".join(lines)
    assert all(line.startswith(f"[launcher] {host}/{role}-0: ") for line in lines), lines
    assert SECRET not in "\n".join(lines)


# --- where a refusal points ---------------------------------------------------------------------------


def test_a_refusal_names_host_instance_and_the_variable_it_comes_from():
    instances = [{"name": "prefill-0", "port": 8100, "kv_transfer_port": 5600},
                 {"name": "prefill-1", "port": 8101, "kv_transfer_port": 5601,
                  "overrides": {"extra_args": ["--hf-token", SECRET]}}]
    hv, groups = hostvars(prefill={"instances": instances})
    # publish.yml leaves extra_args out of what it publishes: the preflight reads the inventory variable.
    for entry in hv["p1"]["vllm_instance_published"]["instances"]:
        entry["overrides"].pop("extra_args", None)
        entry["settings"].pop("extra_args", None)
    hv["p1"]["vllm_instance_instances"] = instances
    hv["d1"]["vllm_instance_extra_args"] = ["--max-log-len", "100", f"--api-key={SECRET}"]
    lines = pf.pd_preflight(hv, groups)
    assert len(lines) == 2, lines
    assert lines[0].startswith(
        '[launcher] p1/prefill-1: vllm_instance_instances[prefill-1].overrides.extra_args: the launcher on the host '
        "would refuse the instance's extra.args[0]: \"--hf-token\" is not allowed: --hf-token would put the Hugging "
        "Face token on vLLM's command line")
    assert lines[1].startswith(
        "[launcher] d1/decode-0: vllm_instance_extra_args: the launcher on the host would refuse the instance's "
        'extra.args[2]: "--api-key" is not allowed')
    assert "Fix: name a keys file with server.api_keys_file, or put the key in the EnvironmentFile and name it with " \
           "server.api_key_env (the vllm_instance role: set vllm_instance_api_key)." in lines[1]
    assert SECRET not in "\n".join(lines)


@pytest.mark.parametrize(("kw", "variable", "fragment"), [
    ({"tensor_parallel_size": 0}, "vllm_instance_tensor_parallel_size", "[topology]"),
    ({"max_num_seqs": -1}, None, None),  # rendered only when > 0: vLLM's default, like 0
    ({"kv_cache_dtype": ""}, "vllm_instance_kv_cache_dtype", "kv_cache.quant_dtype: must not be empty"),
    ({"dtype": 16}, "vllm_instance_dtype", "model.dtype: must be a string, got integer 16"),
    ({"enable_chunked_prefill": None}, None, None),  # not rendered: vLLM's default
])
def test_values_the_template_converts_are_judged_as_rendered(kw, variable, fragment):
    hv, groups = hostvars(**kw)
    lines = pf.pd_preflight(hv, groups)
    if variable is None:
        assert lines == [], lines
        return
    hits = [line for line in lines if names(line, variable)]
    assert len(hits) == 1 and fragment in hits[0], lines


def test_environment_values_are_never_shown():
    environment = {"VLLM_API_KEY": SECRET, "lower": SECRET, "VLLM_NIXL_SIDE_CHANNEL_PORT": SECRET}
    hv, groups = hostvars(variables={"vllm_instance_environment": environment})
    lines = pf.pd_preflight(hv, groups)
    assert len([line for line in lines if names(line, "vllm_instance_environment")]) == 3, lines
    assert SECRET not in "\n".join(lines)


def test_settings_that_cannot_be_rendered_are_refused():
    hv, groups = hostvars(variables={"vllm_instance_extra_args": "--max-log-len 100",
                                     "vllm_instance_environment": ["UCX_TLS=tcp"]})
    lines = pf.pd_preflight(hv, groups)
    assert any(names(line, "vllm_instance_extra_args") and "not a list of vLLM flags" in line for line in lines)
    assert any(names(line, "vllm_instance_environment") and "not a mapping of NAME: value" in line for line in lines)


# --- parity on resolved values ------------------------------------------------------------------------


def parity(lines: list[str], variable: str) -> list[str]:
    return [line for line in lines if line.startswith(f"[parity] {variable}:")]


@pytest.mark.parametrize(("checkpoint", "prefill", "decode", "agree"), [
    ("bfloat16", "auto", "bfloat16", True),
    ("float16", "auto", "half", True),
    ("float32", "auto", "bfloat16", True),  # vLLM 0.32: float32 checkpoints run in bfloat16
    ("float32", "auto", "float16", False),
    ("float32", "auto", "float32", False),
    ("float32", "float", "float32", True),
    ("bfloat16", "auto", "float16", False),
])
def test_weight_dtype_parity_compares_what_vllm_runs(checkpoint, prefill, decode, agree):
    facts = {**SMOL, "torch_dtype": checkpoint}
    lines = pf.pd_preflight(*hostvars(prefill={"dtype": prefill}, decode={"dtype": decode}, facts=facts))
    assert (parity(lines, "vllm_instance_dtype") == []) is agree, lines


@pytest.mark.parametrize(("checkpoint", "prefill", "decode", "agree"), [
    ("bfloat16", {"kv_cache_dtype": "auto"}, {"kv_cache_dtype": "bfloat16"}, True),
    ("float32", {"kv_cache_dtype": "auto"}, {"kv_cache_dtype": "bfloat16"}, True),
    ("float16", {"kv_cache_dtype": "auto"}, {"kv_cache_dtype": "bfloat16"}, False),
    ("bfloat16", {"kv_cache_dtype": "fp8"}, {"kv_cache_dtype": "fp8_e4m3"}, True),
    ("bfloat16", {"kv_cache_dtype": "fp8"}, {"kv_cache_dtype": "fp8_e5m2"}, False),
    # auto follows each side's resolved weight dtype.
    ("bfloat16", {"kv_cache_dtype": "auto", "dtype": "float16"}, {"kv_cache_dtype": "auto"}, False),
    ("bfloat16", {"kv_cache_dtype": "auto", "dtype": "half"}, {"kv_cache_dtype": "auto", "dtype": "float16"}, True),
])
def test_kv_cache_dtype_parity_compares_what_vllm_stores(checkpoint, prefill, decode, agree):
    facts = {**SMOL, "torch_dtype": checkpoint}
    lines = pf.pd_preflight(*hostvars(prefill=prefill, decode=decode, facts=facts))
    assert (parity(lines, "vllm_instance_kv_cache_dtype") == []) is agree, lines


@pytest.mark.parametrize(("prefill", "decode", "problem"), [
    ({"variant": "cuda", "block_size": 0}, {"variant": "cuda", "block_size": 8},
     "prefill's KV block size (16 = vLLM's default on cuda, vllm_instance_block_size 0 on p1) exceeds decode's "
     "(8 on d1)"),
    ({"variant": "cpu", "block_size": 0}, {"variant": "cpu", "block_size": 64},
     "(128 = vLLM's default on cpu, vllm_instance_block_size 0 on p1) exceeds decode's (64 on d1)"),
    ({"variant": "cpu", "block_size": 32}, {"variant": "cuda", "block_size": 0},
     "prefill's KV block size (32 on p1) exceeds decode's (16 = vLLM's default on cuda"),
    ({"variant": "cpu", "block_size": 0}, {"variant": "cpu", "block_size": 128}, None),
    ({"variant": "cuda", "block_size": 0}, {"variant": "cuda", "block_size": 16}, None),
    ({"variant": "cuda", "block_size": 16}, {"variant": "cpu", "block_size": 0}, None),
    ({"variant": "cuda", "block_size": 0}, {"variant": "cuda", "block_size": 0}, None),
])
def test_block_size_parity_applies_the_default_of_each_build(prefill, decode, problem):
    lines = parity(pf.pd_preflight(*hostvars(prefill=prefill, decode=decode)), "vllm_instance_block_size")
    if problem is None:
        assert lines == []
    else:
        assert len(lines) == 1 and problem in lines[0], lines


def test_the_defaults_come_from_the_vocabulary(monkeypatch):
    """Change the vocabulary and the preflight follows: it has no copy of its own, and the launcher it runs
    reads the same module."""
    loaded = pf.vocab
    assert pf.schema.VOCAB is loaded and launch.schema is pf.schema
    both = {"prefill": {"variant": "cuda", "block_size": 0}, "decode": {"variant": "cuda", "block_size": 32}}
    assert parity(pf.pd_preflight(*hostvars(**both)), "vllm_instance_block_size") == []
    monkeypatch.setitem(loaded.DEFAULT_BLOCK_SIZES, "cuda", 64)
    (line,) = parity(pf.pd_preflight(*hostvars(**both)), "vllm_instance_block_size")
    assert "(64 = vLLM's default on cuda" in line
    facts = {**SMOL, "torch_dtype": "float32"}
    assert parity(pf.pd_preflight(*hostvars(prefill={"dtype": "auto"}, decode={"dtype": "float16"}, facts=facts)),
                  "vllm_instance_dtype")
    monkeypatch.setitem(loaded.AUTO_DTYPES, "float32", "float16")
    assert parity(pf.pd_preflight(*hostvars(prefill={"dtype": "auto"}, decode={"dtype": "float16"}, facts=facts)),
                  "vllm_instance_dtype") == []


def test_kv_sizing_uses_the_resolved_dtype():
    facts = {**SMOL, "torch_dtype": "float32"}
    hv, groups = hostvars(facts=facts)
    sizes = pf.kv_sizing(hv, groups)
    # auto on a float32 checkpoint runs in bfloat16: 2 bytes per element, as for the bf16 sandbox model.
    assert [s["tokens"] for s in sizes] == [46592, 46592]
    assert "auto = bfloat16" in sizes[0]["summary"]


# --- the key rule -------------------------------------------------------------------------------------


class Vaulted:
    """Stands in for a vaulted string, which decrypts on str()."""

    def __init__(self, text: str) -> None:
        self._text = text

    def __str__(self) -> str:
        return self._text


class Broken:
    def __str__(self) -> str:
        raise RuntimeError("the vault password is wrong")


@pytest.mark.parametrize(("value", "allow_empty", "valid"), [
    ("preflight-test-instance-key-0001", False, True),
    ("A" * 16, False, True),
    ("abc.DEF_ghi~jkl+mno/pqr=stu-vwx", False, True),
    ("A" * 15, False, False),
    ("", False, False),
    ("", True, True),
    ("key with spaces 0000000", True, False),
    ("goodkey-0000000000\n", True, False),  # a trailing newline would end the EnvironmentFile line
    ("goodkey-0000000000\nX=1", True, False),
    ('quote"key-0000000000', True, False),
    ("semicolon;key-000000000", True, False),
    ("ключ-0000000000000000", True, False),
    (None, True, False),
    (1234567890123456789, True, False),
    (True, True, False),
    (["a" * 20], True, False),
    (Vaulted("vaulted-key-000000000"), False, True),
    (Vaulted("bad vaulted key 000000"), False, False),
    (Broken(), True, False),
])
def test_valid_api_key(value, allow_empty, valid):
    assert pf.valid_api_key(value, allow_empty=allow_empty) is valid


def test_both_roles_use_the_one_key_rule():
    """The router's record counts its client keys that fail the rule and says whether the worker key passes it (never a
    key); router_problems and the PD preflight report them. The instance role asserts its key unlogged."""
    router = (REPO / "roles" / "vllm_router" / "tasks" / "preflight.yml").read_text(encoding="utf-8")
    publish = (REPO / "roles" / "vllm_router" / "tasks" / "publish.yml").read_text(encoding="utf-8")
    instance = (REPO / "roles" / "vllm_instance" / "tasks" / "preflight.yml").read_text(encoding="utf-8")
    assert "__api_keys | map('inferops.vllm.valid_api_key') | reject | list | length" in publish
    assert "vllm_router_worker_api_key | inferops.vllm.valid_api_key(allow_empty=true)" in publish
    assert "inferops.vllm.router_problems" in router
    assert "vllm_instance_api_key | inferops.vllm.valid_api_key(allow_empty=true)" in instance
    assert "{16,}" not in router and "{16,}" not in instance and "{16,}" not in publish
    key_tasks = [t for t in yaml.safe_load(instance) if "valid_api_key" in str(t.get("ansible.builtin.assert"))]
    assert key_tasks and all(t.get("no_log") is True for t in key_tasks)


@pytest.mark.parametrize(("key", "valid"), [("instance-key-000000000001", True), ("", True), ("short", False),
                                            ("has a space 000000000", False)])
def test_pd_preflight_checks_the_instance_key_without_showing_it(key, valid):
    hv, groups = hostvars(variables={"vllm_instance_api_key": key})
    lines = pf.pd_preflight(hv, groups)
    hits = [line for line in lines if names(line, "vllm_instance_api_key")]
    if valid:
        assert hits == []
        return
    assert len(hits) == 1 and hits[0].startswith("[secrets] p1, d1: vllm_instance_api_key: is not a usable key")
    assert key not in "\n".join(lines)


def test_pd_preflight_checks_the_client_keys_without_showing_them():
    hv, groups = hostvars()
    # As roles/vllm_router/tasks/publish.yml publishes three keys of which two are not usable: no key itself.
    hv["r1"]["vllm_router_published"] = router(api_keys_count=3, api_keys_invalid=2)
    lines = pf.pd_preflight(hv, groups)
    (line,) = [line for line in lines if names(line, "vllm_router_api_keys")]
    assert line.startswith("[secrets] r1: vllm_router_api_keys: 2 of its keys are not usable (not shown)")
    assert "short-KEY" not in "\n".join(lines) and "space" not in "\n".join(lines)


# --- one vocabulary, wherever it is written down (the argument spec: tests/unit/test_vocabulary.py) --------


def test_the_launcher_finds_its_schema_and_vocabulary_beside_it_as_on_a_host(tmp_path):
    """On a host the launcher, its schema and the vocabulary are three files in one directory (configure.yml copies
    them); the launcher imports the schema by name from its own directory, and the schema the vocabulary."""
    for path in (LAUNCHER, SCHEMA_FILE, VOCABULARY_FILE):
        (tmp_path / path.name).write_bytes(path.read_bytes())
    (tmp_path / "config.toml").write_text('[server]\nport = 8100\n[model]\nname = "m"\ndtype = "bf16"\n',
                                          encoding="utf-8")
    # -E -s: no PYTHONPATH, no user site; the script's directory is on sys.path, as on a host (-I would drop it).
    command = [sys.executable, "-E", "-s", str(tmp_path / LAUNCHER.name), "--check", "--config",
               str(tmp_path / "config.toml")]
    result = subprocess.run(command, capture_output=True, text=True, check=False, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert 'model.dtype: "bf16" is not a spelling vLLM\'s --dtype accepts; write "bfloat16"' in result.stderr
    for missing in (VOCABULARY_FILE, SCHEMA_FILE):
        (tmp_path / missing.name).unlink()
        result = subprocess.run(command, capture_output=True, text=True, check=False, cwd=tmp_path)
        assert result.returncode != 0 and "must be beside it in " + str(tmp_path) in result.stderr, result.stderr
        assert f"No module named '{missing.stem}'" in result.stderr, result.stderr
