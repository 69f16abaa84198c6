"""Time the PD preflight on a 1,000-host inventory.

    python benchmarks/preflight_1000_hosts.py              # the checks alone (pd_preflight + kv_sizing)
    python benchmarks/preflight_1000_hosts.py --playbook   # also ansible-playbook playbooks/preflight.yml

The inventory: 600 prefill hosts with two instances each, 399 decode hosts with one, one router;
the model is tests/preflight/models/smollm2-135m (its config.json is read, once). The checks must
take well under 10 s on 2 cores (they take milliseconds); the playbook figure is informational
(Ansible's per-host task overhead dominates it). No host is contacted: the generated inventory's
hosts are unroutable TEST-NET-1 addresses over SSH.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "tests" / "preflight" / "models" / "smollm2-135m"
PREFILL, DECODE = 600, 399
LIMIT_SECONDS = 10.0


def _load_filter():
    # The rules behind the pd_preflight filter import the collection's private plugin_utils and module_utils by
    # their collection name: the checkout is linked as a collection under .ansible/collections
    # (scripts/sandbox/tools.sh makes the link).
    sys.path.insert(0, str(REPO / ".ansible" / "collections"))
    return importlib.import_module("ansible_collections.inferops.vllm.plugins.plugin_utils._preflight")


def _settings(**kw):
    base = {
        "dtype": "bfloat16", "max_model_len": 4096, "quantization": "", "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1, "enforce_eager": True, "trust_remote_code": False, "kv_cache_dtype": "fp8",
        "kv_cache_memory_bytes": 1 << 30, "gpu_memory_utilization": 0.9, "num_gpu_blocks_override": 0,
        "block_size": 0, "enable_prefix_caching": True, "max_num_seqs": 0, "max_num_batched_tokens": 0,
        "enable_chunked_prefill": None, "kv_buffer_device": "cpu",
    }
    base.update(kw)
    return base


def published_inventory() -> tuple[dict, dict]:
    """What preflight.yml would collect from a 1,000-host inventory: (published_by_host, groups)."""
    published, groups = {}, {"prefill": [], "decode": [], "router": []}
    for role, count, ports in (("prefill", PREFILL, ((8100, 5600), (8101, 5601))), ("decode", DECODE, ((8200, 5700),))):
        for i in range(count):
            host = f"{role}-{i:04d}"
            settings = _settings()
            instances = [{"name": f"{role}-{n}", "port": p, "kv_transfer_port": k, "overrides": {},
                          "settings": dict(settings)} for n, (p, k) in enumerate(ports)]
            published[host] = {"allow_shared_hosts": None, "router": None, "instance": {
                "pd_role": role, "address": f"10.{1 if role == 'prefill' else 2}.{i // 250}.{i % 250 + 1}",
                "address_source": "vllm_instance_host_address", "served_model_name": "smollm2",
                "instances": instances, "settings": settings, "model": str(MODEL), "model_revision": "main",
                "model_is_local": True, "model_facts": {}, "gpu_memory_bytes": 0, "kv_transfer_backend": "nixl",
                "vllm_version": "0.32.0", "vllm_variant": "cpu", "api_key_set": True, "api_key_broken": False,
                "unsupported": {}, "booleans": {"vllm_install_wheelhouse_keep": False},
            }}
            groups[role].append(host)
    published["router-0000"] = {"allow_shared_hosts": None, "instance": None, "router": {
        "port": 8300, "metrics_port": 29000, "front_port": 8000, "replicas": 2, "api_keys_count": 2,
        "api_keys_broken": False, "allow_unauthenticated": False, "tls_certificate": False, "tls_key": False}}
    groups["router"].append("router-0000")
    return published, groups


def write_inventory(directory: Path) -> None:
    """The same inventory as files, for ansible-playbook."""
    lines = ["---"]
    for role, count in (("prefill", PREFILL), ("decode", DECODE), ("router", 1)):
        lines += [f"{role}:", "  hosts:"]
        for i in range(count):
            lines += [f"    {role}-{i:04d}:", f"      ansible_host: 192.0.2.{i % 250 + 1}"]
    (directory / "hosts.yml").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (directory / "group_vars").mkdir()
    (directory / "group_vars" / "all.yml").write_text(
        "---\n"
        "ansible_connection: ssh\n"
        "vllm_install_variant: cpu\n"
        f"vllm_instance_model: {MODEL}\n"
        "vllm_instance_dtype: bfloat16\n"
        "vllm_instance_max_model_len: 4096\n"
        "vllm_instance_kv_cache_dtype: fp8\n"
        "vllm_instance_kv_cache_memory_bytes: 1073741824\n"
        "vllm_instance_kv_buffer_device: cpu\n"
        "vllm_instance_api_key: benchmark-instance-key-0001\n"
        "vllm_router_api_keys: [benchmark-client-key-000001]\n",
        encoding="utf-8",
    )
    (directory / "group_vars" / "prefill.yml").write_text(
        "---\nvllm_instance_instances:\n"
        "  - {name: prefill-0, port: 8100, kv_transfer_port: 5600}\n"
        "  - {name: prefill-1, port: 8101, kv_transfer_port: 5601}\n",
        encoding="utf-8",
    )


def time_playbook() -> tuple[float, int]:
    binary = Path(sys.executable).parent / "ansible-playbook"
    with tempfile.TemporaryDirectory(prefix="inferops-preflight-bench-") as tmp:
        write_inventory(Path(tmp))
        collections = os.environ.get("ANSIBLE_COLLECTIONS_PATH", str(REPO / ".ansible" / "collections"))
        env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
               "ANSIBLE_COLLECTIONS_PATH": collections}
        start = time.perf_counter()
        run = subprocess.run([str(binary) if binary.is_file() else "ansible-playbook", "-i", tmp,
                              str(REPO / "playbooks" / "preflight.yml")],
                             cwd=REPO, env=env, capture_output=True, text=True, check=False)
        elapsed = time.perf_counter() - start
    if run.returncode != 0:
        print(run.stdout[-3000:], run.stderr[-3000:], sep="\n", file=sys.stderr)
    return elapsed, run.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--playbook", action="store_true", help="also time ansible-playbook playbooks/preflight.yml")
    args = parser.parse_args()

    preflight = _load_filter()
    published, groups = published_inventory()
    hosts = len(published)
    start = time.perf_counter()
    problems = preflight.pd_preflight(published, groups, {"client_timeout_seconds": 600})
    sizing = preflight.kv_sizing(published, groups)
    elapsed = time.perf_counter() - start
    print(f"preflight {hosts} hosts: {elapsed:.2f} s ({len(sizing)} instances sized, {len(problems)} problems)")
    if problems or len(sizing) != 2 * PREFILL + DECODE or sizing[0]["tokens"] != 93184:
        print("unexpected result:", problems[:3], sizing[0]["summary"], file=sys.stderr)
        return 1
    if args.playbook:
        seconds, rc = time_playbook()
        print(f"ansible-playbook playbooks/preflight.yml, {hosts} hosts: {seconds:.1f} s (rc={rc})")
    return 0 if elapsed < LIMIT_SECONDS else 1


if __name__ == "__main__":
    sys.exit(main())
