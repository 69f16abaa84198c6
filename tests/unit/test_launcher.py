"""Unit tests for roles/vllm_instance/files/inferops_vllm_launch.py (the vLLM instance launcher)."""

import importlib.util
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

LAUNCHER = Path(__file__).resolve().parents[2] / "roles" / "vllm_instance" / "files" / "inferops_vllm_launch.py"
PREFIX = "inferops-vllm-launch"


def _import_launcher(name: str = "inferops_vllm_launch") -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, LAUNCHER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


launch = _import_launcher()
VOCAB = launch.schema.VOCAB  # what vLLM accepts, as the launcher's schema reads it
# On a host the launcher imports these by name from its own directory (the vllm_instance role copies them there).
BESIDE = [Path(launch.schema.__file__), Path(VOCAB.__file__), LAUNCHER.parent / "inferops_vllm_auth.py"]


def on_a_host(directory: Path) -> Path:
    """The launcher as the vllm_instance role installs it: a copy beside copies of its schema and vocabulary
    (a script run from the checkout finds no schema beside it)."""
    directory.mkdir(exist_ok=True)
    for path in (LAUNCHER, *BESIDE):
        (directory / path.name).write_bytes(path.read_bytes())
    return directory / LAUNCHER.name


# The launcher's own parser: tomllib on Python 3.11+, tomli on 3.10.
TOML = launch.tomllib
if TOML is None:  # pragma: no cover
    pytest.skip("no TOML parser (Python 3.10 without tomli)", allow_module_level=True)


# --------------------------------------------------------------------------- helpers


def minimal(**sections: dict) -> dict:
    """A valid minimal config, with extra sections/keys merged in."""
    config: dict = {"server": {}, "model": {"name": "/var/lib/vllm/models/x"}}
    for section, table in sections.items():
        config.setdefault(section, {}).update(table)
    return config


def problems_of(config: dict, environ: dict | None = None) -> list[str]:
    return launch.validate(config, environ)


def only_problem(config: dict, environ: dict | None = None) -> str:
    problems = problems_of(config, environ)
    assert len(problems) == 1, problems
    return problems[0]


def args_of(config: dict, environ: dict | None = None) -> list[str]:
    args = launch.build(config, environ or {})[0]
    return args


# Last on every argv: no media domain (and, with an API key, the key middleware).
NO_MEDIA = ["--allowed-media-domains", launch.schema.NO_MEDIA_DOMAIN]
KEY_MIDDLEWARE = ["--middleware", "inferops_vllm_auth.InstanceKeyMiddleware"]


def flags_of(config: dict, environ: dict | None = None) -> list[str]:
    """The flags between the model and the security flags (checked to be there, then left out)."""
    args = args_of(config, environ)
    assert args[:2] == ["serve", "/var/lib/vllm/models/x"]
    tail = NO_MEDIA + (KEY_MIDDLEWARE if config["server"].get("api_key_env") else [])
    assert args[-len(tail):] == tail
    return args[2:-len(tail)]


def env_of(config: dict, environ: dict | None = None) -> dict[str, str]:
    env = launch.build(config, environ or {})[1]
    return env


def pd(**keys) -> dict:
    table = {"enabled": True, "role": "prefill", "side_channel_host": "10.0.0.11", "kv_transfer_port": 5600}
    table.update(keys)
    return {k: v for k, v in table.items() if v is not None}


@pytest.fixture
def write_toml(tmp_path):
    def write(text: str, name: str = "inst.toml") -> Path:
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        return path

    return write


@pytest.fixture
def no_exec(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError(f"vLLM must not be started: {args}")

    monkeypatch.setattr(launch, "supervise", forbidden)


@pytest.fixture(autouse=True)
def pinned(monkeypatch):
    """The CPUs each in-process main() pinned itself to (recorded, not applied to the test process)."""
    calls: list[set[int]] = []
    monkeypatch.setattr(launch.os, "sched_setaffinity", lambda pid, cpus: calls.append(set(cpus)))
    return calls


@pytest.fixture
def fake_exec(monkeypatch):
    calls: list[tuple[str, list[str], dict[str, str]]] = []

    def record(path, argv, env):
        calls.append((path, list(argv), dict(env)))
        return 0

    monkeypatch.setattr(launch, "supervise", record)
    return calls


FULL_TOML = """
[server]
host = "0.0.0.0"
port = 8100
served_model_name = "smol"
api_key_env = "INSTANCE_KEY"
shutdown_timeout = 60

[model]
name = "/var/lib/vllm/models/x"
revision = "abc123"
dtype = "bfloat16"
max_model_len = 512
quantization = "awq"
tensor_parallel_size = 2
pipeline_parallel_size = 1
enforce_eager = true
trust_remote_code = false

[kv_cache]
quant_dtype = "fp8"
gpu_memory_utilization = 0.85
num_gpu_blocks_override = 8192
block_size = 16
enable_prefix_caching = true

[scheduler]
max_num_seqs = 256
max_num_batched_tokens = 8192
enable_chunked_prefill = false

[pd_disaggregation]
enabled = true
role = "decode"
kv_transfer_backend = "nixl"
kv_buffer_device = "cuda"
side_channel_host = "10.0.0.21"
kv_transfer_port = 5601
kv_load_failure_policy = "recompute"
prefill_instances = ["http://10.0.0.11:8100"]
decode_instances = ["http://10.0.0.21:8200", "https://decode.example:8200"]

[cpu]
omp_threads_bind = "0-1"
kvcache_space_gib = 4

[devices]
cuda_visible_devices = "0,1"

[kv_fabric]
transport = "rdma"
net_devices = "mlx5_0:1,mlx5_1:1"
tls = "rc_x,rc,cuda_copy,cuda_ipc"
ib_gid_index = 3

[environment]
UCX_RNDV_SCHEME = "get_zcopy"
HF_HUB_OFFLINE = "1"

[extra]
args = ["--max-log-len", "100", "--disable-log-requests"]
"""

FULL_ARGS = [
    "serve",
    "/var/lib/vllm/models/x",
    "--host", "0.0.0.0",
    "--port", "8100",
    "--served-model-name", "smol",
    "--shutdown-timeout", "60",
    "--revision", "abc123",
    "--dtype", "bfloat16",
    "--max-model-len", "512",
    "--quantization", "awq",
    "--tensor-parallel-size", "2",
    "--pipeline-parallel-size", "1",
    "--enforce-eager",
    "--kv-cache-dtype", "fp8",
    "--gpu-memory-utilization", "0.85",
    "--num-gpu-blocks-override", "8192",
    "--block-size", "16",
    "--enable-prefix-caching",
    "--max-num-seqs", "256",
    "--max-num-batched-tokens", "8192",
    "--no-enable-chunked-prefill",
    "--kv-transfer-config",
    '{"kv_buffer_device":"cuda","kv_connector":"NixlConnector","kv_load_failure_policy":"recompute",'
    '"kv_role":"kv_consumer"}',
    "--max-log-len", "100",
    "--disable-log-requests",
    "--allowed-media-domains", "media-urls-disabled.invalid",
    "--middleware", "inferops_vllm_auth.InstanceKeyMiddleware",
]  # fmt: skip

FULL_ENV = {
    "VLLM_API_KEY": "s3cr3t-value",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.21",
    "VLLM_NIXL_SIDE_CHANNEL_PORT": "5601",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_KVCACHE_SPACE": "4",
    "CUDA_VISIBLE_DEVICES": "0,1",
    "UCX_NET_DEVICES": "mlx5_0:1,mlx5_1:1",
    "UCX_TLS": "rc_x,rc,cuda_copy,cuda_ipc",
    "UCX_IB_GID_INDEX": "3",
    "UCX_RNDV_SCHEME": "get_zcopy",
    "HF_HUB_OFFLINE": "1",
    "PYTHONPATH": str(LAUNCHER.parent),
}


# --------------------------------------------------------------------------- complete build


def test_full_config_builds_exact_argv_and_env():
    config = TOML.loads(FULL_TOML)
    environ = {"INSTANCE_KEY": "s3cr3t-value", "PATH": "/usr/bin"}
    assert launch.validate(config, environ) == []
    args, env = launch.build(config, environ)
    assert args == FULL_ARGS
    assert env == FULL_ENV
    assert list(env) == list(FULL_ENV)  # deterministic order too


def test_build_is_deterministic_and_does_not_mutate_inputs():
    config = TOML.loads(FULL_TOML)
    snapshot = json.dumps(config, sort_keys=True)
    environ = {"INSTANCE_KEY": "k"}
    first = launch.build(config, environ)
    second = launch.build(config, environ)
    assert first == second
    assert json.dumps(config, sort_keys=True) == snapshot
    assert environ == {"INSTANCE_KEY": "k"}


def test_minimal_config():
    args, env = launch.build(minimal(), {})
    assert args == ["serve", "/var/lib/vllm/models/x", *NO_MEDIA]
    assert env == {}


def test_model_name_is_the_positional_argument_right_after_serve():
    args = args_of(minimal(model={"name": "Qwen/Qwen2.5-0.5B"}, server={"port": 8100}))
    assert args[:2] == ["serve", "Qwen/Qwen2.5-0.5B"]
    assert "--model" not in args


# --------------------------------------------------------------------------- every mapped key

FLAG_CASES = [
    ("server", "host", "127.0.0.1", ["--host", "127.0.0.1"]),
    ("server", "port", 8100, ["--port", "8100"]),
    ("server", "served_model_name", "smol", ["--served-model-name", "smol"]),
    ("server", "shutdown_timeout", 60, ["--shutdown-timeout", "60"]),
    ("server", "shutdown_timeout", 0, ["--shutdown-timeout", "0"]),
    ("model", "revision", "abc", ["--revision", "abc"]),
    ("model", "dtype", "float16", ["--dtype", "float16"]),
    ("model", "max_model_len", 512, ["--max-model-len", "512"]),
    ("model", "quantization", "gptq", ["--quantization", "gptq"]),
    ("model", "tensor_parallel_size", 4, ["--tensor-parallel-size", "4"]),
    ("model", "pipeline_parallel_size", 2, ["--pipeline-parallel-size", "2"]),
    ("model", "enforce_eager", True, ["--enforce-eager"]),
    ("model", "enforce_eager", False, []),
    ("model", "trust_remote_code", True, ["--trust-remote-code"]),
    ("model", "trust_remote_code", False, []),
    ("model", "generation_config", "vllm", ["--generation-config", "vllm"]),
    ("model", "generation_config", "/srv/generation", ["--generation-config", "/srv/generation"]),
    ("kv_cache", "quant_dtype", "fp8", ["--kv-cache-dtype", "fp8"]),
    ("kv_cache", "memory_bytes", 1073741824, ["--kv-cache-memory-bytes", "1073741824"]),
    ("kv_cache", "gpu_memory_utilization", 0.9, ["--gpu-memory-utilization", "0.9"]),
    ("kv_cache", "gpu_memory_utilization", 1, ["--gpu-memory-utilization", "1"]),
    ("kv_cache", "gpu_memory_utilization", 1.0, ["--gpu-memory-utilization", "1.0"]),
    ("kv_cache", "num_gpu_blocks_override", 8192, ["--num-gpu-blocks-override", "8192"]),
    ("kv_cache", "block_size", 32, ["--block-size", "32"]),
    ("kv_cache", "enable_prefix_caching", True, ["--enable-prefix-caching"]),
    ("kv_cache", "enable_prefix_caching", False, ["--no-enable-prefix-caching"]),
    ("scheduler", "max_num_seqs", 256, ["--max-num-seqs", "256"]),
    ("scheduler", "max_num_batched_tokens", 8192, ["--max-num-batched-tokens", "8192"]),
    ("scheduler", "enable_chunked_prefill", True, ["--enable-chunked-prefill"]),
    ("scheduler", "enable_chunked_prefill", False, ["--no-enable-chunked-prefill"]),
]


@pytest.mark.parametrize(("section", "key", "value", "expected"), FLAG_CASES)
def test_each_key_maps_to_its_flag(section, key, value, expected):
    assert flags_of(minimal(**{section: {key: value}})) == expected


def test_flag_cases_cover_every_flag_in_the_schema():
    """Adding a flag-mapped key to the schema without a mapping test fails here."""
    mapped = {(s, k) for s, keys in launch.schema.SCHEMA.items() for k, spec in keys.items() if spec.flag}
    # server.allowed_media_domains: last on argv, tested on its own (test_media_domains_*).
    tested = {case[:2] for case in FLAG_CASES} | {("server", "allowed_media_domains")}
    assert mapped == tested


ENV_CASES = [
    ("cpu", "omp_threads_bind", "0-3", "VLLM_CPU_OMP_THREADS_BIND", "0-3"),
    ("cpu", "kvcache_space_gib", 8, "VLLM_CPU_KVCACHE_SPACE", "8"),
    ("devices", "cuda_visible_devices", "0,1", "CUDA_VISIBLE_DEVICES", "0,1"),
    ("kv_fabric", "net_devices", "mlx5_0:1", "UCX_NET_DEVICES", "mlx5_0:1"),
    ("kv_fabric", "tls", "rc_x,rc,cuda_copy", "UCX_TLS", "rc_x,rc,cuda_copy"),
    ("kv_fabric", "ib_gid_index", 3, "UCX_IB_GID_INDEX", "3"),
]


@pytest.mark.parametrize(("section", "key", "value", "var", "expected"), ENV_CASES)
def test_each_env_key_maps_to_its_variable(section, key, value, var, expected):
    args, env = launch.build(minimal(**{section: {key: value}}), {})
    assert env == {var: expected}
    assert args == ["serve", "/var/lib/vllm/models/x", *NO_MEDIA]


def test_env_cases_cover_every_env_key_in_the_schema():
    mapped = {(s, k) for s, keys in launch.schema.SCHEMA.items() for k, spec in keys.items() if spec.env}
    tested = {case[:2] for case in ENV_CASES} | {
        ("pd_disaggregation", "side_channel_host"),
        ("pd_disaggregation", "kv_transfer_port"),
    }
    assert mapped == tested


def test_environment_table_is_passed_through():
    env = env_of(minimal(environment={"UCX_RNDV_SCHEME": "get_zcopy", "NCCL_DEBUG": "INFO", "_X1": ""}))
    assert env == {"UCX_RNDV_SCHEME": "get_zcopy", "NCCL_DEBUG": "INFO", "_X1": ""}


def test_extra_args_are_appended_last_verbatim():
    config = minimal(server={"port": 8100}, extra={"args": ["--max-log-len", "100", "--uvicorn-log-level=warning"]})
    assert flags_of(config) == ["--port", "8100", "--max-log-len", "100", "--uvicorn-log-level=warning"]


def test_extra_args_may_hold_negative_numbers_and_empty_values():
    config = minimal(extra={"args": ["--max-logprobs", "-1", "--chat-template", ""]})
    assert flags_of(config) == ["--max-logprobs", "-1", "--chat-template", ""]


# --------------------------------------------------------------------------- pd_disaggregation


@pytest.mark.parametrize(("role", "kv_role"), [("prefill", "kv_producer"), ("decode", "kv_consumer")])
def test_pd_role_selects_kv_role(role, kv_role):
    args = args_of(minimal(pd_disaggregation=pd(role=role)))
    index = args.index("--kv-transfer-config")
    assert json.loads(args[index + 1]) == {
        "kv_connector": "NixlConnector",
        "kv_role": kv_role,
        "kv_buffer_device": "cuda",
    }
    assert args[index + 1] == json.dumps(
        {"kv_connector": "NixlConnector", "kv_role": kv_role, "kv_buffer_device": "cuda"},
        sort_keys=True,
        separators=(",", ":"),
    )


def test_pd_kv_buffer_device_cpu_and_explicit_backend():
    args = args_of(minimal(pd_disaggregation=pd(kv_buffer_device="cpu", kv_transfer_backend="nixl")))
    value = args[args.index("--kv-transfer-config") + 1]
    assert value == '{"kv_buffer_device":"cpu","kv_connector":"NixlConnector","kv_role":"kv_producer"}'


def test_pd_enabled_sets_side_channel_env():
    env = env_of(minimal(pd_disaggregation=pd()))
    assert env == {"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.11", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600"}


def test_pd_transfer_flag_comes_after_scheduler_and_before_extra():
    config = minimal(
        pd_disaggregation=pd(),
        scheduler={"max_num_seqs": 8},
        extra={"args": ["--max-log-len", "1"]},
    )
    flags = flags_of(config)
    assert flags[0:2] == ["--max-num-seqs", "8"]
    assert flags[2] == "--kv-transfer-config"
    assert flags[4:] == ["--max-log-len", "1"]


@pytest.mark.parametrize("enabled", [False, None])
def test_pd_disabled_or_absent_means_no_kv_transfer(enabled):
    config = minimal(pd_disaggregation=pd(enabled=enabled))
    args, env = launch.build(config, {})
    assert args == ["serve", "/var/lib/vllm/models/x", *NO_MEDIA]
    assert env == {}


def test_pd_disabled_section_is_still_validated():
    problem = only_problem(minimal(pd_disaggregation={"enabled": False, "role": "mixed"}))
    assert problem.startswith("pd_disaggregation.role: ")
    assert '"mixed" is not supported' in problem
    assert '"prefill", "decode"' in problem


def test_pd_disabled_does_not_require_role_or_side_channel():
    assert problems_of(minimal(pd_disaggregation={"enabled": False})) == []


@pytest.mark.parametrize("missing", ["role", "side_channel_host", "kv_transfer_port"])
def test_pd_required_keys_when_enabled(missing):
    problem = only_problem(minimal(pd_disaggregation=pd(**{missing: None})))
    assert problem.startswith(f"pd_disaggregation.{missing}: required when pd_disaggregation.enabled = true")


def test_pd_all_required_keys_reported_together():
    problems = problems_of(minimal(pd_disaggregation={"enabled": True}))
    assert [p.split(":")[0] for p in problems] == [
        "pd_disaggregation.role",
        "pd_disaggregation.side_channel_host",
        "pd_disaggregation.kv_transfer_port",
    ]


def test_pd_kv_transfer_port_must_differ_from_server_port():
    problem = only_problem(minimal(server={"port": 8100}, pd_disaggregation=pd(kv_transfer_port=8100)))
    assert problem.startswith("pd_disaggregation.kv_transfer_port: 8100 is also the HTTP port (server.port)")
    assert "use a different port" in problem


def test_pd_kv_transfer_port_must_differ_from_vllm_default_port():
    problem = only_problem(minimal(pd_disaggregation=pd(kv_transfer_port=8000)))
    assert problem.startswith("pd_disaggregation.kv_transfer_port: 8000 is also the HTTP port")


def test_pd_nccl_backend_is_rejected_with_replacement():
    problem = only_problem(minimal(pd_disaggregation=pd(kv_transfer_backend="nccl")))
    assert problem == (
        "pd_disaggregation.kv_transfer_backend: the P2pNcclConnector (nccl backend) was removed from vLLM; "
        'use kv_transfer_backend = "nixl" (NixlConnector, UCX over RDMA/TCP), which works within and across hosts'
    )


def test_pd_other_backend_lists_supported():
    problem = only_problem(minimal(pd_disaggregation=pd(kv_transfer_backend="mooncake")))
    assert problem == 'pd_disaggregation.kv_transfer_backend: "mooncake" is not supported; use one of: "nixl"'


def test_pd_bad_kv_buffer_device():
    problem = only_problem(minimal(pd_disaggregation=pd(kv_buffer_device="gpu")))
    assert problem == 'pd_disaggregation.kv_buffer_device: "gpu" is not supported; use one of: "cuda", "cpu"'


def test_pd_instance_urls():
    config = minimal(
        pd_disaggregation=pd(
            prefill_instances=["http://10.0.0.11:8100", "10.0.0.12:8100"],
            decode_instances=["https://d:8200", 5],
        )
    )
    assert problems_of(config) == [
        'pd_disaggregation.prefill_instances[1]: "10.0.0.12:8100" is not an http(s) URL; '
        'write it as "http://HOST:PORT"',
        'pd_disaggregation.decode_instances[1]: must be a string, got integer 5; quote it: "5"',
    ]


def test_pd_instance_urls_must_be_a_list():
    problem = only_problem(minimal(pd_disaggregation=pd(decode_instances="http://d:8200")))
    assert problem.startswith('pd_disaggregation.decode_instances: must be an array of strings, got string "http')


def test_pd_instances_do_not_change_argv():
    with_peers = minimal(pd_disaggregation=pd(prefill_instances=["http://a:1"], decode_instances=["http://b:2"]))
    assert args_of(with_peers) == args_of(minimal(pd_disaggregation=pd()))
    assert env_of(with_peers) == env_of(minimal(pd_disaggregation=pd()))


def test_pd_instances_are_documented_as_informational_and_ignored():
    """Hand-written configs (the sources' skeletons) may keep the peer lists; the role no longer writes them."""
    doc = launch.schema.__doc__
    entry = doc.split("prefill_instances / decode_instances", 1)[1].split("cpu.omp_threads_bind", 1)[0]
    entry = " ".join(entry.split())
    assert "ignored" in entry and "informational" in entry and "no longer writes them" in entry


def transfer_config(config: dict) -> dict:
    args = args_of(config)
    return json.loads(args[args.index("--kv-transfer-config") + 1])


@pytest.mark.parametrize("policy", VOCAB.KV_LOAD_FAILURE_POLICIES)
def test_pd_kv_load_failure_policy_goes_into_the_consumers_transfer_config(policy):
    config = minimal(pd_disaggregation=pd(role="decode", kv_load_failure_policy=policy))
    assert transfer_config(config) == {"kv_buffer_device": "cuda", "kv_connector": "NixlConnector",
                                       "kv_role": "kv_consumer", "kv_load_failure_policy": policy}
    args = args_of(config)
    assert args[args.index("--kv-transfer-config") + 1] == (
        '{"kv_buffer_device":"cuda","kv_connector":"NixlConnector",'
        f'"kv_load_failure_policy":"{policy}","kv_role":"kv_consumer"}}'
    )


def test_pd_kv_load_failure_policy_absent_leaves_vllms_default():
    assert "kv_load_failure_policy" not in transfer_config(minimal(pd_disaggregation=pd(role="decode")))


@pytest.mark.parametrize("policy", VOCAB.KV_LOAD_FAILURE_POLICIES)
def test_pd_kv_load_failure_policy_is_accepted_and_ignored_on_a_producer(policy):
    config = minimal(pd_disaggregation=pd(role="prefill", kv_load_failure_policy=policy))
    assert problems_of(config) == []
    assert args_of(config) == args_of(minimal(pd_disaggregation=pd(role="prefill")))


@pytest.mark.parametrize(("value", "text"), [
    ("retry", '"retry" is not supported; use one of: "recompute", "fail"'),
    ("Recompute", '"Recompute" is not supported (values are case-sensitive); write "recompute"'),
    ("", "must not be empty"),
    (True, "must be a string, got boolean true"),
])
def test_pd_kv_load_failure_policy_values(value, text):
    for role in ("decode", "prefill"):
        problem = only_problem(minimal(pd_disaggregation=pd(role=role, kv_load_failure_policy=value)))
        assert problem.startswith("pd_disaggregation.kv_load_failure_policy: ") and text in problem, problem


# --------------------------------------------------------------------------- drain on stop


@pytest.mark.parametrize(("value", "text"), [
    (-1, "-1 is out of range; use an integer >= 0"),
    (1.5, "must be an integer, got float 1.5"),
    ("60", "write 60 without quotes"),
    (True, "a boolean is not a number"),
])
def test_shutdown_timeout_values(value, text):
    problem = only_problem(minimal(server={"shutdown_timeout": value}))
    assert problem.startswith("server.shutdown_timeout: ") and text in problem, problem


def test_shutdown_timeout_absent_passes_no_flag():
    assert "--shutdown-timeout" not in args_of(minimal())


@pytest.mark.parametrize("item", ["--shutdown-timeout", "--shutdown_timeout=0", "--shutdown-timeout=600"])
def test_extra_args_cannot_set_the_drain(item):
    problem = only_problem(minimal(extra={"args": [item, "0"] if "=" not in item else [item]}))
    assert problem.endswith("is generated from server.shutdown_timeout; set server.shutdown_timeout in the TOML "
                            "instead"), problem


def test_the_drain_fits_in_the_units_stop_timeout():
    """The role's drop-in waits shutdown_timeout + a margin; the margin covers the launcher's cleanup."""
    role = LAUNCHER.parents[1]
    margin = re.search(r"^_vllm_instance_stop_margin: (\d+)$", (role / "vars" / "main.yml").read_text(), re.M)
    assert margin and int(margin[1]) >= launch.ORPHAN_GRACE_SECONDS + 5


# --------------------------------------------------------------------------- rejected keys

REJECTED_CASES = [
    ("server", "api_key", "sk-literal-secret", "put the keys in a file named by api_keys_file"),
    (
        "model",
        "quantization_bits",
        4,
        "the bit width comes from the quantized checkpoint; vLLM has no such flag: "
        "use a pre-quantized (AWQ/GPTQ) model and set model.quantization",
    ),
    ("kv_cache", "enable_token_eviction", True, "token eviction is not in vLLM 0.32"),
    ("kv_cache", "eviction_ratio", 0.5, "token eviction is not in vLLM 0.32"),
    (
        "kv_cache",
        "swap_space",
        4,
        "--swap-space was removed from vLLM; preempted requests are recomputed. Use kv_cache.memory_bytes / "
        "gpu_memory_utilization to size the KV cache (or CPU offloading via extra args)",
    ),
    (
        "kv_cache",
        "calculate_kv_scales",
        True,
        "removed from vLLM; fp8 KV scales come from the checkpoint or default to 1.0",
    ),
]


@pytest.mark.parametrize(("section", "key", "value", "text"), REJECTED_CASES)
def test_rejected_keys(section, key, value, text):
    problem = only_problem(minimal(**{section: {key: value}}))
    assert problem.startswith(f"{section}.{key}: ")
    assert text in problem


@pytest.mark.parametrize("key", ["enable_token_eviction", "eviction_ratio"])
def test_token_eviction_message_names_the_alternatives(key):
    problem = only_problem(minimal(kv_cache={key: True}))
    for alternative in ("kv_cache.memory_bytes", "gpu_memory_utilization", 'quant_dtype = "fp8"', "max_model_len"):
        assert alternative in problem


def test_rejected_cases_cover_the_rejected_table():
    assert {case[:2] for case in REJECTED_CASES} == set(launch.schema.REJECTED_KEYS)


def test_rejected_api_key_value_is_not_echoed():
    problems = problems_of(minimal(server={"api_key": "sk-literal-secret"}))
    assert not any("sk-literal-secret" in p for p in problems)


def test_rejected_keys_are_rejected_even_with_valid_looking_values():
    assert only_problem(minimal(kv_cache={"swap_space": 0})).startswith("kv_cache.swap_space: ")


# --------------------------------------------------------------------------- value checks


@pytest.mark.parametrize("value", ["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"])
def test_kv_cache_dtype_accepted(value):
    assert flags_of(minimal(kv_cache={"quant_dtype": value})) == ["--kv-cache-dtype", value]


@pytest.mark.parametrize(("value", "why"), [
    ("fp8_inc", "fp8_inc is Intel Gaudi's FP8 KV cache (vLLM's HPU build)"),
    ("fp8_ds_mla", "fp8_ds_mla is the FP8 KV layout of DeepSeek's sparse MLA models only"),
])
def test_kv_cache_dtypes_of_other_builds_and_layouts_are_refused_with_the_reason(value, why):
    problem = only_problem(minimal(kv_cache={"quant_dtype": value}))
    assert problem.startswith(f"kv_cache.quant_dtype: {why}")
    assert problem.endswith("; use fp8 (halves KV memory vs 16-bit) or auto")


@pytest.mark.parametrize(
    ("value", "label"),
    [
        ("2bit", "2-bit"),
        ("int2", "2-bit"),
        ("int4", "4-bit"),
        ("4bit", "4-bit"),
        ("4-bit", "4-bit"),
        ("fp4", "4-bit"),
        ("int8", "8-bit integer"),
        ("8bit", "8-bit integer"),
    ],
)
def test_kv_cache_low_bit_dtypes_rejected(value, label):
    problem = only_problem(minimal(kv_cache={"quant_dtype": value}))
    assert problem == (
        f"kv_cache.quant_dtype: vLLM 0.32 has no {label} KV cache; use fp8 (halves KV memory vs 16-bit) or auto"
    )


def test_kv_cache_other_dtype_lists_choices():
    problem = only_problem(minimal(kv_cache={"quant_dtype": "float16"}))
    assert problem == (
        'kv_cache.quant_dtype: "float16" is not supported; use one of: "auto", "bfloat16", "fp8", '
        '"fp8_e4m3", "fp8_e5m2"'
    )


def test_choices_are_case_sensitive_with_a_hint():
    problem = only_problem(minimal(kv_cache={"quant_dtype": "FP8"}))
    assert problem == 'kv_cache.quant_dtype: "FP8" is not supported (values are case-sensitive); write "fp8"'


@pytest.mark.parametrize("value", list(VOCAB.QUANTIZATION_METHODS))
def test_quantization_methods_accepted(value):
    assert flags_of(minimal(model={"quantization": value})) == ["--quantization", value]


def test_quantization_unknown_lists_supported():
    problem = only_problem(minimal(model={"quantization": "int4"}))
    assert problem.startswith('model.quantization: "int4" is not a supported weight quantization method; use one of: ')
    for method in ("awq", "gptq", "bitsandbytes", "compressed-tensors", "gguf", "experts_int8", "mxfp4"):
        assert f'"{method}"' in problem


@pytest.mark.parametrize("value", ["auto", "bfloat16", "float16", "float32", "half", "float"])
def test_dtype_accepted(value):
    assert flags_of(minimal(model={"dtype": value})) == ["--dtype", value]


@pytest.mark.parametrize(("value", "spelling"), [("bf16", "bfloat16"), ("fp16", "float16"), ("FP32", "float32")])
def test_dtype_misspellings_name_the_spelling_vllm_accepts(value, spelling):
    problem = only_problem(minimal(model={"dtype": value}))
    assert problem == f'model.dtype: "{value}" is not a spelling vLLM\'s --dtype accepts; write "{spelling}"'


def test_dtype_rejected():
    problem = only_problem(minimal(model={"dtype": "fp8"}))
    assert problem == (
        'model.dtype: "fp8" is not supported; use one of: "auto", "bfloat16", "float16", "float32", "half", "float"'
    )


@pytest.mark.parametrize("value", [1, 8, 16, 32, 64, 128])
def test_block_size_accepted(value):
    assert flags_of(minimal(kv_cache={"block_size": value})) == ["--block-size", str(value)]


@pytest.mark.parametrize("value", ["Vllm", "relative/dir", "none", "model"])
def test_a_generation_config_vllm_would_read_as_a_relative_directory_is_refused(value):
    """vLLM 0.32 reads any --generation-config but "auto" and "vllm" as a directory (ModelConfig.generation_config)."""
    problem = only_problem(minimal(model={"generation_config": value}))
    assert problem == (f'model.generation_config: "{value}" is neither "auto" (the model\'s generation_config.json), '
                       '"vllm" (vLLM\'s own sampling defaults) nor an absolute directory holding a '
                       "generation_config.json; write one of those")


def test_block_size_rejected():
    problem = only_problem(minimal(kv_cache={"block_size": 24}))
    assert problem == "kv_cache.block_size: 24 is not supported; use one of: 1, 8, 16, 32, 64, 128"


RANGE_CASES = [
    ("server", "port", 0, "server.port: 0 is out of range; use an integer between 1 and 65535"),
    ("server", "port", 65536, "server.port: 65536 is out of range; use an integer between 1 and 65535"),
    ("model", "max_model_len", 0, "model.max_model_len: 0 is out of range; use an integer >= 1"),
    ("model", "tensor_parallel_size", 0, "model.tensor_parallel_size: 0 is out of range; use an integer >= 1"),
    ("model", "pipeline_parallel_size", -1, "model.pipeline_parallel_size: -1 is out of range; use an integer >= 1"),
    ("kv_cache", "memory_bytes", 0, "kv_cache.memory_bytes: 0 is out of range; use an integer >= 1"),
    ("kv_cache", "num_gpu_blocks_override", 0, "kv_cache.num_gpu_blocks_override: 0 is out of range"),
    ("scheduler", "max_num_seqs", 0, "scheduler.max_num_seqs: 0 is out of range; use an integer >= 1"),
    ("scheduler", "max_num_batched_tokens", -5, "scheduler.max_num_batched_tokens: -5 is out of range"),
    ("cpu", "kvcache_space_gib", 0, "cpu.kvcache_space_gib: 0 is out of range; use an integer >= 1"),
    ("pd_disaggregation", "kv_transfer_port", 70000, "pd_disaggregation.kv_transfer_port: 70000 is out of range"),
    ("kv_cache", "gpu_memory_utilization", 0, "kv_cache.gpu_memory_utilization: 0 is out of range"),
    ("kv_cache", "gpu_memory_utilization", 0.0, "kv_cache.gpu_memory_utilization: 0.0 is out of range"),
    ("kv_cache", "gpu_memory_utilization", 1.5, "kv_cache.gpu_memory_utilization: 1.5 is out of range"),
    ("kv_cache", "gpu_memory_utilization", 2, "kv_cache.gpu_memory_utilization: 2 is out of range"),
    ("kv_cache", "gpu_memory_utilization", -0.1, "kv_cache.gpu_memory_utilization: -0.1 is out of range"),
    ("kv_cache", "gpu_memory_utilization", math.nan, "kv_cache.gpu_memory_utilization: nan is out of range"),
    ("kv_cache", "gpu_memory_utilization", math.inf, "kv_cache.gpu_memory_utilization: inf is out of range"),
]


@pytest.mark.parametrize(("section", "key", "value", "text"), RANGE_CASES)
def test_ranges(section, key, value, text):
    problem = only_problem(minimal(**{section: {key: value}}))
    assert problem.startswith(text)


def test_fraction_range_message_says_what_to_do():
    problem = only_problem(minimal(kv_cache={"gpu_memory_utilization": 90}))
    assert problem.endswith("use a fraction greater than 0 and at most 1, e.g. 0.9")


def test_port_bounds_are_inclusive():
    assert flags_of(minimal(server={"port": 1})) == ["--port", "1"]
    assert flags_of(minimal(server={"port": 65535})) == ["--port", "65535"]


def test_memory_bytes_and_gpu_memory_utilization_together_is_an_error():
    problem = only_problem(minimal(kv_cache={"memory_bytes": 1 << 30, "gpu_memory_utilization": 0.9}))
    assert problem.startswith("kv_cache.gpu_memory_utilization: set together with kv_cache.memory_bytes")
    assert "vLLM uses memory_bytes and ignores gpu_memory_utilization" in problem
    assert "pick one" in problem


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ("server", "host"),
        ("server", "served_model_name"),
        ("model", "name"),
        ("pd_disaggregation", "side_channel_host"),
        ("devices", "cuda_visible_devices"),
    ],
)
def test_empty_strings_are_rejected(section, key):
    config = minimal(**{section: {key: "  "}})
    problem = only_problem(config)
    assert problem == f"{section}.{key}: must not be empty; set a value or remove the key"


def test_nul_in_list_item_rejected():
    assert only_problem(minimal(extra={"args": ["--max-log-len", "1\0"]})) == (
        "extra.args[1]: must not contain NUL characters; remove them"
    )


def test_nul_in_string_rejected():
    assert only_problem(minimal(server={"host": "a\0b"})) == (
        "server.host: must not contain NUL characters; remove them"
    )


# --------------------------------------------------------------------------- wrong types

TYPE_CASES = [
    # string "true" where a bool is expected
    ("model", "enforce_eager", "true", 'must be a boolean, got string "true"; write true without quotes'),
    ("kv_cache", "enable_prefix_caching", "False", 'must be a boolean, got string "False"; write false without quotes'),
    ("scheduler", "enable_chunked_prefill", 1, "must be a boolean, got integer 1; write true or false without quotes"),
    ("pd_disaggregation", "enabled", "yes", 'must be a boolean, got string "yes"; write true or false without quotes'),
    # bool where an int is expected (bool is a subclass of int in Python)
    ("server", "port", True, "must be an integer, got boolean true; a boolean is not a number"),
    ("model", "max_model_len", False, "must be an integer, got boolean false"),
    ("model", "tensor_parallel_size", True, "must be an integer, got boolean true"),
    ("kv_cache", "block_size", True, "must be an integer, got boolean true"),
    ("cpu", "kvcache_space_gib", True, "must be an integer, got boolean true"),
    ("pd_disaggregation", "kv_transfer_port", True, "must be an integer, got boolean true"),
    ("kv_cache", "gpu_memory_utilization", True, "must be a number, got boolean true; a boolean is not a number"),
    # other int mistakes
    ("server", "port", "8100", 'must be an integer, got string "8100"; write 8100 without quotes'),
    ("scheduler", "max_num_seqs", 8.0, "must be an integer, got float 8.0; write 8 without a decimal point"),
    ("kv_cache", "memory_bytes", "1G", 'must be an integer, got string "1G"; write a whole number without quotes'),
    ("kv_cache", "gpu_memory_utilization", "0.9", 'must be a number, got string "0.9"; write 0.9 without quotes'),
    # str mistakes
    ("devices", "cuda_visible_devices", 0, 'must be a string, got integer 0; quote it: "0"'),
    ("server", "host", ["0.0.0.0"], "must be a string, got an array; write a quoted string"),
    ("model", "name", True, 'must be a string, got boolean true; quote it: "true"'),
    ("server", "api_key_env", 12, 'must be a string, got integer 12; quote it: "12"'),
    ("cpu", "omp_threads_bind", 0.5, 'must be a string, got float 0.5; quote it: "0.5"'),
    # tables / arrays
    ("extra", "args", "--max-log-len 100", 'must be an array of strings, got string "--max-log-len 100"'),
    ("pd_disaggregation", "prefill_instances", {"a": 1}, "must be an array of strings, got a table"),
]


@pytest.mark.parametrize(("section", "key", "value", "text"), TYPE_CASES)
def test_wrong_types(section, key, value, text):
    problem = only_problem(minimal(**{section: {key: value}}))
    assert problem.startswith(f"{section}.{key}: ")
    assert text in problem


def test_wrong_type_in_extra_args_item():
    problem = only_problem(minimal(extra={"args": ["--max-log-len", 100]}))
    assert problem == 'extra.args[1]: must be a string, got integer 100; quote it: "100"'


def test_datetime_value_is_a_type_error():
    config = TOML.loads('[server]\nhost = 1979-05-27\n[model]\nname = "m"\n')
    assert only_problem(config) == "server.host: must be a string, got date; write a quoted string"


# --------------------------------------------------------------------------- structure / unknown names


def test_unknown_section_suggests_close_match():
    config = minimal()
    config["sever"] = {"port": 1}
    assert only_problem(config) == "sever: unknown section; did you mean 'server'?"


def test_unknown_section_without_close_match_lists_valid():
    config = minimal()
    config["zzz"] = {}
    problem = only_problem(config)
    assert problem.startswith("zzz: unknown section; valid: server, model, kv_cache, scheduler, pd_disaggregation")


@pytest.mark.parametrize(
    ("section", "key", "suggestion"),
    [
        ("server", "prot", "port"),
        ("model", "nmae", "name"),
        ("model", "max_len", "max_model_len"),
        ("kv_cache", "quant_dtyp", "quant_dtype"),
        ("kv_cache", "block-size", "block_size"),
        ("scheduler", "max_num_seq", "max_num_seqs"),
        ("pd_disaggregation", "enable", "enabled"),
        ("cpu", "kvcache_space", "kvcache_space_gib"),
        ("devices", "CUDA_VISIBLE_DEVICES", "cuda_visible_devices"),
        ("extra", "arg", "args"),
    ],
)
def test_unknown_key_suggests_close_match(section, key, suggestion):
    problem = only_problem(minimal(**{section: {key: 1}}))
    assert problem == f"{section}.{key}: unknown key; did you mean {suggestion!r}?"


def test_unknown_key_without_close_match_lists_valid_keys():
    problem = only_problem(minimal(scheduler={"policy": "fcfs"}))
    assert problem == (
        "scheduler.policy: unknown key; valid: max_num_seqs, max_num_batched_tokens, enable_chunked_prefill"
    )


@pytest.mark.parametrize("section", ["server", "model"])
def test_required_sections(section):
    config = minimal()
    del config[section]
    problems = problems_of(config)
    assert f"{section}: required section [{section}] is missing; add it" in problems


def test_model_name_required():
    assert only_problem({"server": {}, "model": {"revision": "x"}}) == (
        "model.name: required; set it to the model directory or Hugging Face model id"
    )


def test_section_that_is_not_a_table():
    config = minimal()
    config["scheduler"] = 5
    assert only_problem(config) == "scheduler: must be a table, got integer 5; write it as a [scheduler] section"


def test_top_level_scalar_is_an_unknown_section():
    config = TOML.loads('port = 8100\n[server]\n[model]\nname = "m"\n')
    assert only_problem(config) == (
        "port: unknown section; valid: server, model, kv_cache, scheduler, pd_disaggregation, cpu, devices, "
        "kv_fabric, environment, extra"
    )


def test_section_names_are_case_sensitive_with_suggestion():
    assert only_problem(minimal(Model={})) == "Model: unknown section; did you mean 'model'?"


def test_all_problems_are_collected_and_each_names_its_key():
    config = {
        "server": {"port": "8100", "api_key": "x"},
        "model": {"enforce_eager": "true", "quantization_bits": 4},
        "kv_cache": {"quant_dtype": "int4", "swap_space": 4},
        "pd_disaggregation": {"enabled": True, "kv_transfer_backend": "nccl"},
        "extra": {"args": ["--port", "9000"]},
        "bogus": {},
    }
    problems = problems_of(config)
    names = [p.split(":", 1)[0] for p in problems]
    assert names == [
        "bogus",
        "server.port",
        "server.api_key",
        "model.enforce_eager",
        "model.quantization_bits",
        "kv_cache.quant_dtype",
        "kv_cache.swap_space",
        "pd_disaggregation.kv_transfer_backend",
        "extra.args[0]",
        "model.name",
        "pd_disaggregation.role",
        "pd_disaggregation.side_channel_host",
        "pd_disaggregation.kv_transfer_port",
    ]
    # every problem says what to do: it has a "; ..." or ": ..." remedy part after the key
    assert all(len(p.split(": ", 1)[1]) > 10 for p in problems)


def test_build_raises_config_error_with_all_problems():
    with pytest.raises(launch.ConfigError) as caught:
        launch.build({"server": {"port": 0}, "model": {}}, {})
    assert caught.value.problems == [
        "server.port: 0 is out of range; use an integer between 1 and 65535",
        "model.name: required; set it to the model directory or Hugging Face model id",
    ]


# --------------------------------------------------------------------------- API key


def test_api_key_env_exports_vllm_api_key_and_never_uses_argv():
    config = minimal(server={"api_key_env": "INSTANCE_KEY"})
    args, env = launch.build(config, {"INSTANCE_KEY": "sk-123"})
    assert env == {"VLLM_API_KEY": "sk-123", "PYTHONPATH": str(LAUNCHER.parent)}
    assert "--api-key" not in args
    assert not any("sk-123" in a for a in args)


def test_api_key_env_named_vllm_api_key():
    args, env = launch.build(minimal(server={"api_key_env": "VLLM_API_KEY"}), {"VLLM_API_KEY": "sk-1"})
    assert env == {"VLLM_API_KEY": "sk-1", "PYTHONPATH": str(LAUNCHER.parent)}
    assert not any("sk-1" in a for a in args)


@pytest.mark.parametrize("environ", [{}, {"INSTANCE_KEY": ""}, {"OTHER": "x"}])
def test_api_key_env_variable_must_be_set_and_non_empty(environ):
    problem = only_problem(minimal(server={"api_key_env": "INSTANCE_KEY"}), environ)
    assert problem.startswith("server.api_key_env: environment variable INSTANCE_KEY is not set")
    assert "EnvironmentFile" in problem


def test_api_key_env_presence_is_not_checked_without_environ():
    assert problems_of(minimal(server={"api_key_env": "INSTANCE_KEY"}), None) == []


@pytest.mark.parametrize("name", ["my-key", "lower", "1KEY", "KEY NAME"])
def test_api_key_env_must_be_a_variable_name(name):
    problem = only_problem(minimal(server={"api_key_env": name}))
    assert problem.startswith(f"server.api_key_env: {json.dumps(name)} is not a valid environment variable name")


def test_no_api_key_env_means_no_vllm_api_key_even_if_inherited():
    env = launch.build(minimal(), {"VLLM_API_KEY": "inherited"})[1]
    assert "VLLM_API_KEY" not in env


def test_key_variable_may_not_be_set_in_environment_table():
    config = minimal(server={"api_key_env": "INSTANCE_KEY"}, environment={"INSTANCE_KEY": "sk-in-toml"})
    problem = only_problem(config, {"INSTANCE_KEY": "x"})
    assert problem.startswith("environment.INSTANCE_KEY: this is the API key variable named by server.api_key_env")
    assert "sk-in-toml" not in problem


# --------------------------------------------------------------------------- [environment]


@pytest.mark.parametrize("name", sorted(set(launch.schema.ENV_OWNERS) - {"VLLM_API_KEY"}))
def test_environment_cannot_set_launcher_variables(name):
    owner = launch.schema.ENV_OWNERS[name]
    problem = only_problem(minimal(environment={name: "x"}))
    assert problem == f"environment.{name}: {name} is set by the launcher from {owner}; set {owner} instead"


def test_environment_owned_variables_are_the_expected_ones():
    assert launch.schema.ENV_OWNERS == {
        "VLLM_API_KEY": "server.api_key_env",
        "INFEROPS_VLLM_API_KEYS_FILE": "server.api_keys_file",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "pd_disaggregation.side_channel_host",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "pd_disaggregation.kv_transfer_port",
        "VLLM_CPU_OMP_THREADS_BIND": "cpu.omp_threads_bind",
        "VLLM_CPU_KVCACHE_SPACE": "cpu.kvcache_space_gib",
        "CUDA_VISIBLE_DEVICES": "devices.cuda_visible_devices",
        "UCX_NET_DEVICES": "kv_fabric.net_devices",
        "UCX_TLS": "kv_fabric.tls",
        "UCX_IB_GID_INDEX": "kv_fabric.ib_gid_index",
    }


# --------------------------------------------------------------------------- [kv_fabric]


def test_the_kv_transport_sets_no_variable_itself():
    assert env_of(minimal(kv_fabric={"transport": "tcp"})) == {}
    assert only_problem(minimal(kv_fabric={"transport": "ib"})).startswith("kv_fabric.transport: ")


@pytest.mark.parametrize("tls", ["rc_x,rc,cuda_copy,cuda_ipc", "rc,sm,self", "dc_x,cuda_copy", "^tcp"])
def test_rdma_transport_lists_are_accepted(tls):
    assert problems_of(minimal(kv_fabric={"transport": "rdma", "tls": tls})) == []


@pytest.mark.parametrize("tls", ["rc,tcp", "all"])
def test_tcp_in_an_rdma_list_is_refused_because_ucx_would_fall_back_silently(tls):
    problem = only_problem(minimal(kv_fabric={"transport": "rdma", "tls": tls}))
    assert problem.startswith(f'kv_fabric.tls: "{tls}" lets UCX carry KV over TCP when RDMA fails, silently')


def test_an_rdma_transport_without_an_rdma_transport_list_is_refused():
    assert "has no RDMA transport" in only_problem(minimal(kv_fabric={"transport": "rdma", "tls": "sm,self"}))


def test_rdma_names_with_the_tcp_transport_are_refused():
    problem = only_problem(minimal(kv_fabric={"transport": "tcp", "tls": "tcp,rc_x"}))
    assert problem == ('kv_fabric.tls: rc_x (RDMA) in the list but kv_fabric.transport is "tcp"; remove them, or set '
                       'kv_fabric.transport = "rdma"')
    assert problems_of(minimal(kv_fabric={"transport": "tcp", "tls": "tcp,sm,self"})) == []


def test_unknown_ucx_transports_are_refused_with_the_names_ucx_has():
    problem = only_problem(minimal(kv_fabric={"tls": "rc,verbs"}))
    assert problem.startswith('kv_fabric.tls: "verbs" is not a UCX transport; write a comma-separated list of ib, ')


def test_net_devices_are_ucx_device_names():
    assert problems_of(minimal(kv_fabric={"net_devices": "mlx5_0:1,mlx5_bond_0:1,eth0"})) == []
    assert only_problem(minimal(kv_fabric={"net_devices": "mlx5_0:1 mlx5_1:1"})).startswith(
        'kv_fabric.net_devices: "mlx5_0:1 mlx5_1:1" is not a UCX device; write RDMA ports as DEVICE:PORT')


def test_a_gid_index_is_for_roce_only():
    assert only_problem(minimal(kv_fabric={"transport": "tcp", "ib_gid_index": 3})).startswith(
        "kv_fabric.ib_gid_index: only RoCE uses a GID index")
    assert only_problem(minimal(kv_fabric={"ib_gid_index": 256})).startswith("kv_fabric.ib_gid_index: ")


def test_environment_cannot_set_vllm_api_key():
    problem = only_problem(minimal(environment={"VLLM_API_KEY": "sk-toml"}))
    assert problem == (
        "environment.VLLM_API_KEY: the API key must not be in the TOML; put it in the EnvironmentFile "
        "and name it with server.api_key_env"
    )


@pytest.mark.parametrize("name", ["ucx_tls", "1ABC", "A-B", "A.B", ""])
def test_environment_names_must_be_upper_case(name):
    problem = only_problem(minimal(environment={name: "x"}))
    assert problem.startswith(f"environment.{name}: {json.dumps(name)} is not a valid environment variable name")


@pytest.mark.parametrize(("value", "text"), [(1, "got integer 1"), (True, "got boolean true"), (["a"], "an array")])
def test_environment_values_must_be_strings(value, text):
    problem = only_problem(minimal(environment={"UCX_LOG_LEVEL": value}))
    assert problem.startswith("environment.UCX_LOG_LEVEL: must be a string, ")
    assert text in problem


def test_environment_section_must_be_a_table():
    config = minimal()
    config["environment"] = ["UCX_TLS=tcp"]
    assert only_problem(config).startswith("environment: must be a table, got an array")


# --------------------------------------------------------------------------- extra.args escape hatch


@pytest.mark.parametrize("flag", sorted(launch.schema.FLAG_OWNERS))
def test_extra_args_cannot_pass_generated_flags(flag):
    owner = launch.schema.FLAG_OWNERS[flag]
    problem = only_problem(minimal(extra={"args": [flag, "1"]}))
    assert problem == (
        f'extra.args[0]: "{flag}" is not allowed: {flag} is generated from {owner}; set {owner} in the TOML instead'
    )


def test_generated_flags_include_both_boolean_spellings():
    for name in ("enforce-eager", "trust-remote-code", "enable-prefix-caching", "enable-chunked-prefill"):
        assert f"--{name}" in launch.schema.FLAG_OWNERS
        assert f"--no-{name}" in launch.schema.FLAG_OWNERS


def test_escape_hatch_cannot_override_a_flag_the_toml_sets():
    config = minimal(server={"port": 8100}, extra={"args": ["--port", "9000"]})
    problem = only_problem(config)
    assert problem == (
        'extra.args[0]: "--port" is not allowed: --port is generated from server.port; set server.port in the TOML '
        "instead"
    )
    with pytest.raises(launch.ConfigError):
        launch.build(config, {})


@pytest.mark.parametrize(
    ("item", "owner"),
    [
        ("--port=9000", "server.port"),
        ("--max_model_len", "model.max_model_len"),
        ("--max_model_len=4096", "model.max_model_len"),
        ("--Tensor-parallel-size", None),  # not a vLLM spelling: allowed through (vLLM rejects it itself)
        ("-tp", "model.tensor_parallel_size"),
        ("-tp=2", "model.tensor_parallel_size"),
        ("-pp", "model.pipeline_parallel_size"),
        ("-q", "model.quantization"),
        ("-qawq", "model.quantization"),
        ("--no_enable_prefix_caching", "kv_cache.enable_prefix_caching"),
        ("--gpu-memory-utilization=0.5", "kv_cache.gpu_memory_utilization"),
    ],
)
def test_extra_args_flag_spellings_are_normalised(item, owner):
    problems = problems_of(minimal(extra={"args": ["--max-log-len", "1", item]}))
    if owner is None:
        assert problems == []
    else:
        assert len(problems) == 1, problems
        assert problems[0].startswith(f"extra.args[2]: {json.dumps(item.split('=', 1)[0])} is not allowed: ")
        assert f"set {owner} in the TOML instead" in problems[0]


@pytest.mark.parametrize(
    ("item", "text"),
    [
        ("--kv-transfer-config", "--kv-transfer-config is generated from [pd_disaggregation]"),
        ("--kv-transfer-config.kv_role", "--kv-transfer-config is generated from [pd_disaggregation]"),
        ("--kv_transfer_config={}", "--kv-transfer-config is generated from [pd_disaggregation]"),
        ("--api-key", "--api-key would put the API key on vLLM's command line"),
        ("--api_key=sk-x", "name it with server.api_key_env"),
        ("--config", "--config (a vLLM YAML config) would bypass this TOML"),
        ("--config=/tmp/x.yaml", "set the matching key in the TOML instead"),
        ("--model", "--model is generated from model.name"),
        ("--model=other", "set model.name instead"),
    ],
)
def test_extra_args_reserved_flags(item, text):
    problem = only_problem(minimal(extra={"args": [item, "v"]}))
    assert problem.startswith(f"extra.args[0]: {json.dumps(item.split('=', 1)[0])} is not allowed: ")
    assert text in problem


def test_api_key_in_extra_args_is_not_echoed():
    problems = problems_of(minimal(extra={"args": ["--api-key=sk-supersecret"]}))
    assert problems and not any("sk-supersecret" in p for p in problems)


SECRET_ARGS = [
    ["--api-key", "sk-SECRET"],
    ["--api-key=sk-SECRET"],
    ["--api_key=sk-SECRET"],
    ["--api-ke", "sk-SECRET"],  # an abbreviation argparse accepts
    ["--hf-token", "hf_SECRET"],
    ["--hf-token=hf_SECRET"],
    ["--hf_token", "hf_SECRET"],
    ["--hf-tok=hf_SECRET"],
    ["--max-log-len", "100", "--hf-token", "hf_SECRET"],
    ["--openai-api-key", "sk-SECRET"],  # any --*-key / --*-token / --*-secret / --*-password
    ["--s3-secret=SECRET"],
    ["--db-password", "SECRET"],
    ["--proxy-passwd=SECRET"],
    ["--access-token", "SECRET"],
]


@pytest.mark.parametrize("args", SECRET_ARGS)
def test_secret_bearing_extra_args_are_refused_without_echoing_the_secret(args):
    problems = problems_of(minimal(extra={"args": args}))
    assert len(problems) == 1, problems
    assert " is not allowed: " in problems[0]
    assert "EnvironmentFile" in problems[0]
    assert "SECRET" not in problems[0]


@pytest.mark.parametrize(("item", "text"), [
    ("--api-key", "the vllm_instance role: set vllm_instance_api_key"),
    ("--hf-token", "put HF_TOKEN in the instance's EnvironmentFile"),
    ("--my-token", "the vllm_instance role writes vllm_instance_api_key there"),
])
def test_secret_flags_say_where_the_secret_goes_instead(item, text):
    assert text in only_problem(minimal(extra={"args": [item, "x"]}))


@pytest.mark.parametrize("args", [
    ["--return-tokens-as-token-ids"],
    ["--enable-prompt-tokens-details"],
    ["--ssl-keyfile", "/etc/vllm/key.pem", "--ssl-certfile", "/etc/vllm/cert.pem"],
    ["--allow-credentials"],
    ["--long-prefill-token-threshold", "512"],
    ["--tokenizer-mode", "auto"],
])
def test_flags_that_only_mention_keys_or_tokens_are_allowed(args):
    assert problems_of(minimal(extra={"args": args})) == []


@pytest.mark.parametrize(("item", "target"), [("--max-model", "--max-model-len"), ("--api", "--api-key")])
def test_extra_args_abbreviations_of_owned_flags(item, target):
    problem = only_problem(minimal(extra={"args": [item, "1"]}))
    assert f"vLLM would read it as an abbreviation of {target}" in problem


@pytest.mark.parametrize(
    "args",
    [
        ["--max-log-len", "100"],
        ["--disable-log-requests", "--uvicorn-log-level", "warning"],
        ["--kv-cache-dtype-skip-layers", "0"],  # an owned flag is a prefix of it, not the other way round
        ["--model-impl", "vllm"],
        ["--config-format", "hf"],
        ["-O3"],
        [],
    ],
)
def test_extra_args_allowed(args):
    assert problems_of(minimal(extra={"args": args})) == []
    assert flags_of(minimal(extra={"args": args})) == args


def test_extra_args_must_start_with_a_flag():
    problem = only_problem(minimal(extra={"args": ["max-log-len", "100"]}))
    assert problem.startswith('extra.args[0]: "max-log-len" is not a flag')
    assert 'must start with a flag such as "--max-log-len"' in problem


# --------------------------------------------------------------------------- load_config


def test_load_config_parses_file(write_toml):
    path = write_toml(FULL_TOML)
    assert launch.load_config(path) == TOML.loads(FULL_TOML)


def test_load_config_syntax_error_has_line_and_column(write_toml):
    path = write_toml('[server]\nport = \n[model]\nname = "m"\n')
    with pytest.raises(launch.ConfigError) as caught:
        launch.load_config(path)
    (message,) = caught.value.problems
    assert message.startswith("TOML syntax error: ")
    assert "line 2" in message and "column" in message


def test_load_config_missing_file(tmp_path):
    with pytest.raises(launch.ConfigError) as caught:
        launch.load_config(tmp_path / "missing.toml")
    assert caught.value.problems == [
        "cannot read config file: No such file or directory; check the path and its permissions"
    ]


def test_load_config_not_utf8(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[model]\nname = "caf\xe9"\n')
    with pytest.raises(launch.ConfigError) as caught:
        launch.load_config(path)
    assert caught.value.problems[0].startswith("config file is not valid UTF-8")


def test_tomli_fallback_and_missing_parser(monkeypatch, capsys, write_toml):
    fake_tomli = types.ModuleType("tomli")
    fake_tomli.loads = TOML.loads
    fake_tomli.TOMLDecodeError = TOML.TOMLDecodeError
    monkeypatch.setitem(sys.modules, "tomllib", None)  # as on Python 3.10 (import raises ModuleNotFoundError)
    monkeypatch.setitem(sys.modules, "tomli", fake_tomli)
    with_tomli = _import_launcher("launcher_with_tomli")
    assert with_tomli.tomllib is fake_tomli
    assert with_tomli.load_config(write_toml('[server]\n[model]\nname = "m"\n')) == {
        "server": {},
        "model": {"name": "m"},
    }

    monkeypatch.setitem(sys.modules, "tomli", None)
    without = _import_launcher("launcher_without_toml")
    assert without.tomllib is None
    rc = without.main(["--config", str(write_toml("[server]\n")), "--check"])
    assert rc == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{PREFIX}: no TOML parser: ")
    assert "pip install tomli" in err


# --------------------------------------------------------------------------- main: --check


def test_check_mode_prints_command_and_ok(write_toml, capsys, no_exec, monkeypatch):
    monkeypatch.setenv("INSTANCE_KEY", "s3cr3t-value")
    path = write_toml(FULL_TOML)
    rc = launch.main(["--config", str(path), "--check", "--vllm-bin", "/opt/venv/bin/vllm"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert err == ""
    lines = out.splitlines()
    assert lines[0] == f"{PREFIX}: exec: " + shlex.join(["/opt/venv/bin/vllm", *FULL_ARGS])
    assert shlex.split(lines[0].removeprefix(f"{PREFIX}: exec: ")) == ["/opt/venv/bin/vllm", *FULL_ARGS]
    assert lines[1] == f"{PREFIX}: env: VLLM_API_KEY=<redacted>"
    assert f"{PREFIX}: env: VLLM_NIXL_SIDE_CHANNEL_HOST=10.0.0.21" in lines
    assert f"{PREFIX}: env: CUDA_VISIBLE_DEVICES=0,1" in lines
    assert f"{PREFIX}: env: UCX_TLS=rc_x,rc,cuda_copy,cuda_ipc" in lines
    assert lines[-1] == f"{PREFIX}: {path}: config OK"
    assert len(lines) == 1 + len(FULL_ENV) + 1
    assert "s3cr3t-value" not in out


def test_check_mode_invalid_config_exit_2(write_toml, capsys, no_exec):
    path = write_toml('[server]\nport = "8100"\nprot = 1\n[model]\nname = "m"\n[kv_cache]\nswap_space = 4\n')
    rc = launch.main(["--config", str(path), "--check"])
    out, err = capsys.readouterr()
    assert rc == 2
    assert out == ""
    assert err.splitlines() == [
        f'{PREFIX}: {path}: server.port: must be an integer, got string "8100"; write 8100 without quotes',
        f"{PREFIX}: {path}: server.prot: unknown key; did you mean 'port'?",
        f"{PREFIX}: {path}: kv_cache.swap_space: " + launch.schema.REJECTED_KEYS["kv_cache", "swap_space"],
    ]


@pytest.mark.parametrize("check", [True, False])
def test_syntax_error_exit_2(write_toml, capsys, no_exec, check):
    path = write_toml('[server]\nport = 8100\n[model\nname = "m"\n')
    rc = launch.main(["--config", str(path)] + (["--check"] if check else []))
    out, err = capsys.readouterr()
    assert rc == 2
    assert out == ""
    assert err.startswith(f"{PREFIX}: {path}: TOML syntax error: ")
    assert "(at line 3, column" in err


@pytest.mark.parametrize("check", [True, False])
def test_missing_file_exit_2(tmp_path, capsys, no_exec, check):
    path = tmp_path / "nope.toml"
    rc = launch.main(["--config", str(path)] + (["--check"] if check else []))
    err = capsys.readouterr().err
    assert rc == 2
    reason = "cannot read config file: No such file or directory; check the path and its permissions"
    assert err == f"{PREFIX}: {path}: {reason}\n"


def test_directory_instead_of_file_exit_2(tmp_path, capsys, no_exec):
    rc = launch.main(["--config", str(tmp_path), "--check"])
    assert rc == 2
    assert f"{PREFIX}: {tmp_path}: cannot read config file: " in capsys.readouterr().err


def test_check_mode_does_not_require_the_api_key_variable(write_toml, capsys, no_exec, monkeypatch):
    # Ansible's `validate` runs --check where systemd's EnvironmentFile is not loaded.
    monkeypatch.delenv("INSTANCE_KEY", raising=False)
    path = write_toml('[server]\napi_key_env = "INSTANCE_KEY"\n[model]\nname = "m"\n')
    rc = launch.main(["--config", str(path), "--check"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "VLLM_API_KEY=<redacted>" in out


def test_missing_api_key_variable_fails_at_start(write_toml, capsys, no_exec, monkeypatch):
    monkeypatch.delenv("INSTANCE_KEY", raising=False)
    path = write_toml('[server]\napi_key_env = "INSTANCE_KEY"\n[model]\nname = "m"\n')
    rc = launch.main(["--config", str(path)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith(
        f"{PREFIX}: {path}: server.api_key_env: environment variable INSTANCE_KEY is not set or is empty"
    )


def test_usage_error_without_config(capsys):
    with pytest.raises(SystemExit) as caught:
        launch.main([])
    assert caught.value.code == 2
    assert "--config" in capsys.readouterr().err


# --------------------------------------------------------------------------- main: exec


def test_exec_mode_calls_execve_with_argv_and_env(write_toml, capsys, fake_exec, monkeypatch):
    monkeypatch.setenv("INSTANCE_KEY", "s3cr3t-value")
    monkeypatch.setenv("KEEP_ME", "inherited")
    environ_before = dict(os.environ)
    path = write_toml(FULL_TOML)
    rc = launch.main(["--config", str(path), "--vllm-bin", "/opt/venv/bin/vllm"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert len(fake_exec) == 1
    exec_path, argv, env = fake_exec[0]
    assert exec_path == "/opt/venv/bin/vllm"
    assert argv == ["/opt/venv/bin/vllm", *FULL_ARGS]
    assert env == {**environ_before, **FULL_ENV}
    assert env["KEEP_ME"] == "inherited"
    assert env["VLLM_API_KEY"] == "s3cr3t-value"
    assert "--api-key" not in argv
    assert not any("s3cr3t-value" in a for a in argv)
    assert dict(os.environ) == environ_before  # the launcher's own environment is untouched
    # logging: stderr only, one exec line, env lines, secrets redacted
    assert out == ""
    lines = err.splitlines()
    assert lines[0] == f"{PREFIX}: exec: " + shlex.join(argv)
    assert f"{PREFIX}: env: VLLM_API_KEY=<redacted>" in lines
    assert f"{PREFIX}: env: VLLM_NIXL_SIDE_CHANNEL_PORT=5601" in lines
    # ... and the one line that says where the instance runs (FULL_TOML binds it to CPUs 0-1).
    assert lines[-1] == f"{PREFIX}: the instance runs on CPUs 0-1 (cpu.omp_threads_bind)"
    assert len(lines) == 1 + len(FULL_ENV) + 1
    assert "s3cr3t-value" not in err


def test_exec_mode_default_vllm_bin_is_next_to_interpreter(write_toml, fake_exec, capsys):
    path = write_toml('[server]\n[model]\nname = "m"\n')
    assert launch.main(["--config", str(path)]) == 0
    expected = str(Path(sys.executable).parent / "vllm")
    assert fake_exec[0][0] == expected
    assert fake_exec[0][1] == [expected, "serve", "m", *NO_MEDIA]


def test_exec_mode_invalid_config_does_not_exec(write_toml, capsys, no_exec):
    path = write_toml('[server]\n[model]\nname = "m"\nquantization_bits = 4\n')
    assert launch.main(["--config", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"{PREFIX}: {path}: model.quantization_bits: the bit width comes from the quantized")


def _not_executable(tmp_path: Path) -> Path:
    script = tmp_path / "vllm"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o644)
    return script


EXEC_ERRORS = [
    (lambda tmp_path: tmp_path / "missing" / "vllm", "No such file or directory", 127),
    (_not_executable, "Permission denied", 126),
]


@pytest.mark.parametrize(("make_bin", "reason", "code"), EXEC_ERRORS)
def test_exec_failure_exit_codes(write_toml, capsys, monkeypatch, tmp_path, make_bin, reason, code):
    monkeypatch.setattr(launch, "_become_subreaper", lambda: None)  # leave the test process as it is
    vllm_bin = make_bin(tmp_path)
    path = write_toml('[server]\n[model]\nname = "m"\n')
    assert launch.main(["--config", str(path), "--vllm-bin", str(vllm_bin)]) == code
    err = capsys.readouterr().err
    assert f"{PREFIX}: cannot exec {vllm_bin}: {reason}; install vLLM into this venv or pass --vllm-bin" in err


# --------------------------------------------------------------------------- supervision (real processes)

# A stand-in for `vllm serve`: leaves a grandchild that ignores SIGTERM behind (as vLLM's resource
# tracker does), writes both PIDs, then waits; SIGTERM makes it exit with status 0, and its first
# argument after `serve` can make it exit with a status or die of SIGKILL instead.
FAKE_VLLM = """\
import os, signal, sys, time
out = next(a for a in sys.argv if a.startswith("--marks=")).removeprefix("--marks=")
if os.fork() == 0:
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with open(out + ".orphan", "w") as f:
            f.write(str(os.getpid()))
        while True:
            time.sleep(1)
    os._exit(0)
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
with open(out + ".main", "w") as f:
    f.write(str(os.getpid()))
how = sys.argv[2]
while not os.path.exists(out + ".orphan"):
    time.sleep(0.05)
if how == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if how.isdigit():
    sys.exit(int(how))
while True:
    time.sleep(1)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _start_launcher(tmp_path: Path, how: str) -> tuple[subprocess.Popen, Path]:
    fake = tmp_path / "vllm"
    fake.write_text(f"#!{sys.executable}\n{FAKE_VLLM}")
    fake.chmod(0o755)
    marks = tmp_path / "pids"
    config = tmp_path / "inst.toml"
    config.write_text(f'[server]\n[model]\nname = "{how}"\n[extra]\nargs = ["--marks={marks}"]\n')
    host = on_a_host(tmp_path / "lib")
    proc = subprocess.Popen([sys.executable, str(host), "--config", str(config), "--vllm-bin", str(fake)],
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not (Path(f"{marks}.main").exists() and Path(f"{marks}.orphan").exists()):
        assert proc.poll() is None or how != "serve", proc.stderr.read()
        assert time.monotonic() < deadline, "the stand-in vLLM did not start"
        time.sleep(0.05)
    return proc, marks


def _pid(marks: Path, which: str) -> int:
    return int(Path(f"{marks}.{which}").read_text())


def test_stop_forwards_sigterm_and_leaves_no_process_behind(tmp_path):
    proc, marks = _start_launcher(tmp_path, "serve")
    main_pid, orphan = _pid(marks, "main"), _pid(marks, "orphan")
    assert main_pid != proc.pid, "vLLM runs as the launcher's child"
    assert _alive(orphan)
    began = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=launch.ORPHAN_GRACE_SECONDS + 10) == 0, proc.stderr.read()
    # The orphan ignored SIGTERM: it got SIGKILL after the grace period, and was reaped.
    assert launch.ORPHAN_GRACE_SECONDS - 1 < time.monotonic() - began < launch.ORPHAN_GRACE_SECONDS + 5
    assert not _alive(main_pid) and not _alive(orphan)


def test_exit_status_of_vllm_is_the_launchers_and_leftovers_are_stopped(tmp_path):
    proc, marks = _start_launcher(tmp_path, "3")
    assert proc.wait(timeout=launch.ORPHAN_GRACE_SECONDS + 10) == 3, proc.stderr.read()
    assert not _alive(_pid(marks, "orphan"))


def test_vllm_killed_by_a_signal_kills_the_launcher_with_it(tmp_path):
    proc, marks = _start_launcher(tmp_path, "kill")
    assert proc.wait(timeout=launch.ORPHAN_GRACE_SECONDS + 10) == -signal.SIGKILL
    assert not _alive(_pid(marks, "orphan"))


def test_secret_looking_environment_values_are_redacted_in_log(write_toml, capsys, fake_exec):
    path = write_toml('[server]\n[model]\nname = "m"\n[environment]\nHF_TOKEN = "hf_abc"\n'
                      'UCX_RNDV_SCHEME = "get_zcopy"\n')
    assert launch.main(["--config", str(path)]) == 0
    err = capsys.readouterr().err
    assert f"{PREFIX}: env: HF_TOKEN=<redacted>" in err
    assert f"{PREFIX}: env: UCX_RNDV_SCHEME=get_zcopy" in err
    assert "hf_abc" not in err
    assert fake_exec[0][2]["HF_TOKEN"] == "hf_abc"


def test_log_line_quotes_values_for_the_shell(write_toml, capsys, fake_exec):
    path = write_toml('[server]\nserved_model_name = "my model"\n[model]\nname = "/m"\n'
                      '[environment]\nUCX_LOG_FILE = "/var/log/ucx %h.log"\n')
    assert launch.main(["--config", str(path), "--vllm-bin", "/v/vllm"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (f"{PREFIX}: exec: /v/vllm serve /m --served-model-name 'my model' "
                      f"--allowed-media-domains {launch.schema.NO_MEDIA_DOMAIN}")
    assert err[1] == f"{PREFIX}: env: UCX_LOG_FILE='/var/log/ucx %h.log'"


# Values the log shows (known-safe names) and values it must not (anything else, secret-looking names under
# a safe prefix, URL credentials under any name).
SHOWN_ENV = {
    "CUDA_VISIBLE_DEVICES": "0,1",
    "OMP_NUM_THREADS": "4",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "VLLM_LOGGING_LEVEL": "INFO",
    "VLLM_USAGE_STATS_SERVER": "https://stats.example",
    "UCX_RNDV_SCHEME": "get_zcopy",
    "NCCL_SOCKET_IFNAME": "eth0",
}
REDACTED_ENV = {
    "HTTPS_PROXY": "http://proxyuser:Pr0xyPassw0rd@proxy.example:3128",
    "HTTP_PROXY": "http://proxy.example:3128",  # not a known-safe name: redacted even without a password
    "NO_PROXY": "localhost",
    "MY_SETTING": "harmless-but-unknown",
    "DATABASE_URL": "postgres://app:dbsecret@db/app",
    "HF_TOKEN": "hf_abcdefSECRET",
    "VLLM_S3_SECRET_ACCESS": "s3SECRET",
    "VLLM_CUSTOM_AUTH_HEADER": "Bearer xyzSECRET",
    "UCX_PASSWORD": "ucxSECRET",
    "VLLM_USAGE_STATS_URL": "https://statsuser:statsSECRET@stats.example",  # a safe prefix, but URL credentials
}


def test_only_known_safe_environment_values_are_logged(write_toml, capsys, fake_exec, monkeypatch):
    monkeypatch.setenv("SITE_KEY", "site-key-SECRET-0123456789")
    table = "".join(f"{name} = {json.dumps(value)}\n" for name, value in {**SHOWN_ENV, **REDACTED_ENV}.items()
                    if name != "CUDA_VISIBLE_DEVICES")
    path = write_toml(f'[server]\napi_key_env = "SITE_KEY"\n[model]\nname = "m"\n[devices]\n'
                      f'cuda_visible_devices = "0,1"\n[environment]\n{table}')
    assert launch.main(["--config", str(path)]) == 0
    err = capsys.readouterr().err
    assert f"{PREFIX}: env: VLLM_API_KEY=<redacted>" in err.splitlines()
    for name, value in SHOWN_ENV.items():
        assert f"{PREFIX}: env: {name}={shlex.quote(value)}" in err.splitlines(), name
    for name, value in REDACTED_ENV.items():
        assert f"{PREFIX}: env: {name}=<redacted>" in err.splitlines(), name
        assert value not in err, name
    assert "site-key-SECRET" not in err and "Passw0rd" not in err
    # The child still gets every value.
    assert {name: fake_exec[0][2][name] for name in REDACTED_ENV} == REDACTED_ENV


@pytest.mark.parametrize(("name", "value", "shown"), [
    ("VLLM_API_KEY", "abc", False),
    ("SITE_KEY", "abc", False),  # the api_key_env variable, whatever its name
    ("VLLM_NIXL_SIDE_CHANNEL_HOST", "10.0.0.1", True),
    ("VLLM_CPU_OMP_THREADS_BIND", "0-3", True),
    ("VLLM_CPU_KVCACHE_SPACE", "4", True),
    ("VLLM_MAX_TOKENS_PER_EXPERT", "8", False),  # looks secret (TOKEN): redacted, to be safe
    ("NCCL_DEBUG", "ftp://u:p@h/x", False),
    ("NCCL_DEBUG", "INFO", True),
    ("lower_case", "x", False),
])
def test_loggable(name, value, shown):
    assert launch.loggable(name, value, "SITE_KEY") is shown


def test_every_variable_the_launcher_sets_is_logged_in_the_clear_except_the_key():
    for name in launch.schema.ENV_OWNERS:
        assert launch.loggable(name, "x") is (name != launch.schema.API_KEY_VAR), name


# --------------------------------------------------------------------------- as a script


def test_script_check_mode_end_to_end(write_toml, tmp_path):
    path = write_toml('[server]\nport = 8100\n[model]\nname = "m"\n')
    result = subprocess.run(
        [sys.executable, str(on_a_host(tmp_path / "lib")), "--config", str(path), "--check", "--vllm-bin", "/x/vllm"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == (f"{PREFIX}: exec: /x/vllm serve m --port 8100 "
                             f"--allowed-media-domains {launch.schema.NO_MEDIA_DOMAIN}\n{PREFIX}: {path}: config OK\n")


def test_script_invalid_config_end_to_end(write_toml, tmp_path):
    path = write_toml('[server]\nport = true\n[model]\nname = "m"\n')
    result = subprocess.run(
        [sys.executable, str(on_a_host(tmp_path / "lib")), "--config", str(path), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith(f"{PREFIX}: {path}: server.port: must be an integer, got boolean true")


def test_the_preflight_and_this_launcher_read_one_schema_and_one_vocabulary():
    # The launcher runs on hosts with the standard library only; it imports the collection's schema module
    # (beside it on a host, plugins/module_utils/ here), which imports the vocabulary beside it. The
    # controller-side preflight imports both modules by their collection names: one module each, no copy.
    from ansible_collections.inferops.vllm.plugins.module_utils import _vllm_instance_schema, _vllm_vocabulary
    from ansible_collections.inferops.vllm.plugins.plugin_utils import _preflight as preflight

    assert launch.schema is _vllm_instance_schema and preflight.schema is _vllm_instance_schema
    assert preflight.vocab is _vllm_vocabulary and VOCAB is _vllm_vocabulary
    assert launch.validate is _vllm_instance_schema.validate
    for name in ("DTYPES", "QUANTIZATION_METHODS", "KV_CACHE_DTYPES", "BLOCK_SIZES", "DEFAULT_BLOCK_SIZES",
                 "KV_TRANSFER_BACKENDS", "KV_BUFFER_DEVICES", "LOW_BIT_KV_RE", "DTYPE_SYNONYMS", "AUTO_DTYPES",
                 "KV_LOAD_FAILURE_POLICIES", "CHECKPOINT_DTYPES", "DTYPE_BYTES"):
        assert not hasattr(preflight, name), name
        assert not hasattr(launch, name), name
        assert not hasattr(launch.schema, name), name
    for name in ("SCHEMA", "Key", "RESERVED_FLAGS", "REJECTED_KEYS"):
        assert not hasattr(launch, name), name
    sources = [(LAUNCHER.parents[3] / "plugins" / "filter" / "preflight.py").read_text(encoding="utf-8"),
               LAUNCHER.read_text(encoding="utf-8"), Path(_vllm_instance_schema.__file__).read_text(encoding="utf-8")]
    for source in sources:
        for value in ('"compressed-tensors"', '"fp8_e5m2"', "(1, 8, 16, 32, 64, 128)", '"experts_int8"'):
            assert value not in source, value
        assert "importlib" not in source and "spec_from_file_location" not in source


# --------------------------------------------------------------------------- vocabulary: resolved values


@pytest.mark.parametrize(("dtype", "checkpoint", "resolved"), [
    ("auto", "bfloat16", "bfloat16"),
    ("auto", "float16", "float16"),
    ("auto", "float32", "bfloat16"),  # vLLM 0.32 downcasts float32 checkpoints to the platform's preferred dtype
    ("auto", "half", "float16"),
    ("auto", None, None),
    (None, "bfloat16", "bfloat16"),
    ("", "float16", "float16"),
    ("half", "bfloat16", "float16"),
    ("float", "bfloat16", "float32"),
    ("float32", None, "float32"),
    ("bfloat16", "float16", "bfloat16"),
])
def test_resolve_dtype(dtype, checkpoint, resolved):
    assert VOCAB.resolve_dtype(dtype, checkpoint) == resolved


@pytest.mark.parametrize(("kv", "model", "resolved"), [
    ("auto", "bfloat16", "bfloat16"),
    ("auto", "float16", "float16"),
    ("auto", None, None),
    (None, "float32", "float32"),
    ("fp8", "bfloat16", "fp8_e4m3"),
    ("fp8_e4m3", "float16", "fp8_e4m3"),
    ("fp8_e5m2", None, "fp8_e5m2"),
    ("bfloat16", "float16", "bfloat16"),
])
def test_resolve_kv_cache_dtype(kv, model, resolved):
    assert VOCAB.resolve_kv_cache_dtype(kv, model) == resolved


@pytest.mark.parametrize(("block", "variant", "resolved"), [
    (None, "cuda", 16), (0, "cuda", 16), (0, "cpu", 128), (None, "cpu", 128), (32, "cpu", 32), (8, "cuda", 8),
    (0, "rocm", 16),
])
def test_resolve_block_size(block, variant, resolved):
    assert VOCAB.resolve_block_size(block, variant) == resolved


def test_vocabulary_resolves_into_itself():
    assert set(VOCAB.DEFAULT_BLOCK_SIZES.values()) <= set(VOCAB.BLOCK_SIZES)
    assert set(VOCAB.DTYPE_SYNONYMS) | set(VOCAB.DTYPE_SYNONYMS.values()) <= set(VOCAB.DTYPES)
    assert set(VOCAB.AUTO_DTYPES.values()) <= set(VOCAB.DTYPES)
    kv_synonyms = set(VOCAB.KV_CACHE_DTYPE_SYNONYMS) | set(VOCAB.KV_CACHE_DTYPE_SYNONYMS.values())
    assert kv_synonyms <= set(VOCAB.KV_CACHE_DTYPES)


# --------------------------------------------------------------------------- media domains, key middleware (issue #25)


def test_media_domains_none_by_default_and_when_empty():
    """vLLM fetches from every host when the list is absent or empty: the launcher always passes one."""
    for server in ({}, {"allowed_media_domains": []}):
        args = args_of(minimal(server=server))
        assert args[-2:] == ["--allowed-media-domains", "media-urls-disabled.invalid"]
        assert launch.schema.NO_MEDIA_DOMAIN.endswith(".invalid")  # RFC 6761: never resolves


def test_media_domains_listed_are_passed_as_separate_arguments_last():
    config = minimal(server={"allowed_media_domains": ["images.example.com", "cdn.example.org"]},
                     extra={"args": ["--max-log-len", "1"]})
    assert args_of(config)[2:] == ["--max-log-len", "1", "--allowed-media-domains", "images.example.com",
                                   "cdn.example.org"]


@pytest.mark.parametrize("domain", ["https://images.example.com", "images.example.com:443", "*.example.com",
                                    "Images.Example.com", "", "a b", "example.com/path"])
def test_media_domains_must_be_plain_host_names(domain):
    problem = only_problem(minimal(server={"allowed_media_domains": [domain]}))
    assert problem.startswith("server.allowed_media_domains: ") and "is not a host name" in problem


def test_media_domains_flag_is_refused_in_extra_args():
    problem = only_problem(minimal(extra={"args": ["--allowed-media-domains", "x.example.com"]}))
    assert "server.allowed_media_domains" in problem


def test_key_middleware_and_its_path_only_with_an_api_key():
    args, env = launch.build(minimal(), {})
    assert "--middleware" not in args and "PYTHONPATH" not in env
    args, env = launch.build(minimal(server={"api_key_env": "VLLM_API_KEY"}), {"VLLM_API_KEY": "k" * 20})
    assert args[-2:] == KEY_MIDDLEWARE
    assert env["PYTHONPATH"] == str(LAUNCHER.parent)
    assert (LAUNCHER.parent / "inferops_vllm_auth.py").is_file()


def test_key_middleware_path_comes_before_one_the_toml_sets():
    config = minimal(server={"api_key_env": "VLLM_API_KEY"}, environment={"PYTHONPATH": "/opt/mine"})
    env = launch.build(config, {"VLLM_API_KEY": "k" * 20})[1]
    assert env["PYTHONPATH"] == f"{LAUNCHER.parent}:/opt/mine"


def test_key_middleware_imports_as_vllm_imports_it():
    """vLLM does importlib.import_module(path).getattr(name) with the launcher's PYTHONPATH."""
    env = launch.build(minimal(server={"api_key_env": "VLLM_API_KEY"}), {"VLLM_API_KEY": "k" * 20})[1]
    module, name = KEY_MIDDLEWARE[1].rsplit(".", 1)
    code = (f"import importlib, inspect; c = getattr(importlib.import_module({module!r}), {name!r}); "
            "print(inspect.isclass(c))")
    result = subprocess.run([sys.executable, "-c", code], env={"PATH": os.environ.get("PATH", ""), **env},
                            capture_output=True, text=True, check=False, cwd="/")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


# --------------------------------------------------------------------------- server.api_keys_file (rotations)


@pytest.fixture
def keys_file(tmp_path):
    path = tmp_path / "api-keys"
    path.write_text("sk-new\nsk-old\n")
    path.chmod(0o640)
    return path


def test_api_keys_file_is_exported_for_the_middleware_and_vllm_gets_no_key(
        keys_file, write_toml, fake_exec, monkeypatch, capsys):
    """The middleware reads the file (and again when it changes); vLLM's own check, which would take one key
    only, gets none: VLLM_API_KEY inherited from the unit's environment is not passed on."""
    monkeypatch.setenv("VLLM_API_KEY", "sk-stale-inherited")
    path = write_toml(f'[server]\napi_keys_file = "{keys_file}"\n[model]\nname = "/m"\n')
    assert launch.main(["--config", str(path), "--vllm-bin", "/v/vllm"]) == 0
    (_bin, argv, env), = fake_exec
    assert env["INFEROPS_VLLM_API_KEYS_FILE"] == str(keys_file)
    assert "VLLM_API_KEY" not in env
    assert argv[-2:] == ["--middleware", launch.AUTH_MIDDLEWARE] and "--api-key" not in argv
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(launch.AUTH_MODULE_DIR)
    err = capsys.readouterr().err
    assert f"INFEROPS_VLLM_API_KEYS_FILE={keys_file}" in err and "sk-new" not in err and "sk-old" not in err


@pytest.mark.parametrize(("content", "mode", "fragment"), [
    (None, 0o640, "cannot read"),
    ("", 0o640, "holds no key"),
    ("# only a comment\n\n", 0o640, "holds no key"),
    ("sk-new\n", 0o644, "is readable by every user (mode 0644)"),
])
def test_api_keys_file_must_hold_a_key_and_stay_private_at_start(tmp_path, content, mode, fragment):
    path = tmp_path / "api-keys"
    if content is not None:
        path.write_text(content)
        path.chmod(mode)
    problem = only_problem(minimal(server={"api_keys_file": str(path)}), {})
    assert problem.startswith("server.api_keys_file: ") and fragment in problem, problem


def test_api_keys_file_content_is_not_checked_without_environ(tmp_path):
    """--check (Ansible's validate step) runs before the role may have written the file."""
    assert problems_of(minimal(server={"api_keys_file": str(tmp_path / "not-yet")}), None) == []


@pytest.mark.parametrize(("server", "fragment"), [
    ({"api_keys_file": "relative/keys"}, "is not an absolute path"),
    ({"api_keys_file": "/etc/vllm/api-keys", "api_key_env": "VLLM_API_KEY"}, "name the keys one way only"),
])
def test_api_keys_file_refusals(server, fragment):
    problem = only_problem(minimal(server=server), None)
    assert problem.startswith("server.api_keys_file") and fragment in problem, problem


# --------------------------------------------------------------------------- the instance's CPUs


@pytest.mark.parametrize(("bind", "cpus"), [
    ("0", {0}), ("0-3", {0, 1, 2, 3}), ("0,2", {0, 2}), ("0-1|4-5", {0, 1, 4, 5}), (" 3 ", {3}),
    ("auto", None), ("nobind", None), ("", None), ("0-", None), ("a-b", None),
])
def test_bound_cpus(bind, cpus):
    assert launch.schema.bound_cpus(bind) == cpus


@pytest.mark.parametrize("bind", ["0-", "cores 0-3", "0;1"])
def test_a_bind_that_is_no_cpu_list_is_refused(bind):
    problem = only_problem(minimal(cpu={"omp_threads_bind": bind}))
    assert problem.startswith("cpu.omp_threads_bind: ") and "is not a CPU list" in problem and '"0-3|4-7"' in problem


@pytest.mark.parametrize("bind", ["auto", "nobind", "0-1|2-3"])
def test_vllms_own_words_and_lists_are_accepted(bind):
    assert problems_of(minimal(cpu={"omp_threads_bind": bind})) == []


def test_the_launcher_pins_itself_to_the_instances_cpus_before_vllm_starts(write_toml, fake_exec, pinned, capsys):
    path = write_toml('[server]\n[model]\nname = "/m"\n[cpu]\nomp_threads_bind = "0-1|4"\n')
    assert launch.main(["--config", str(path), "--vllm-bin", "/v/vllm"]) == 0
    assert pinned == [{0, 1, 4}] and len(fake_exec) == 1
    assert "the instance runs on CPUs 0-1|4 (cpu.omp_threads_bind)" in capsys.readouterr().err


def test_no_cpu_list_pins_nothing(write_toml, fake_exec, pinned):
    path = write_toml('[server]\n[model]\nname = "/m"\n[cpu]\nomp_threads_bind = "auto"\n')
    assert launch.main(["--config", str(path), "--vllm-bin", "/v/vllm"]) == 0
    assert pinned == [] and len(fake_exec) == 1


def test_cpus_the_host_refuses_stop_the_start_with_the_fix(write_toml, no_exec, monkeypatch, capsys):
    def refuse(pid, cpus):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(launch.os, "sched_setaffinity", refuse)
    path = write_toml('[server]\n[model]\nname = "/m"\n[cpu]\nomp_threads_bind = "999"\n')
    assert launch.main(["--config", str(path), "--vllm-bin", "/v/vllm"]) == launch.EXIT_CONFIG
    err = capsys.readouterr().err
    assert 'cpu.omp_threads_bind = "999": cannot run on those CPUs (Invalid argument)' in err
    assert "Fix the instance's cpus in the inventory" in err


def test_every_process_of_the_instance_inherits_the_cpus(tmp_path):
    """For real: the launcher in its own process, and the stand-in vLLM it starts reports its affinity."""
    cpu = min(os.sched_getaffinity(0))
    fake = tmp_path / "vllm"
    fake.write_text(f"#!{sys.executable}\nimport os, sys\nprint(sorted(os.sched_getaffinity(0)))\n")
    fake.chmod(0o755)
    config = tmp_path / "inst.toml"
    config.write_text(f'[server]\n[model]\nname = "/m"\n[cpu]\nomp_threads_bind = "{cpu}"\n')
    installed = on_a_host(tmp_path / "lib")
    result = subprocess.run([sys.executable, str(installed), "--config", str(config), "--vllm-bin", str(fake)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str([cpu])
