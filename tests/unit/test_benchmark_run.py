"""vllm_benchmark's runs, with a stand-in `vllm` (a script in a temporary venv that writes the result JSON
`vllm bench serve` would), by the real ansible-playbook on localhost: one bench_scenarios plan per target (the
front, then the colocated instance), every scenario run against each, each result fetched to its directory on
the controller; the colocated runs use the next seed and go to the instance's URL. The instances' /metrics are
stand-in HTTP servers on localhost (the decode one counts two more NIXL transfers at every read), read from the
router host (localhost too) with the instance key before and after each scenario through the front, and the
scenario's KV path lands in <run>/kv/. No other host is contacted."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from test_preflight_inventories import ANSIBLE_PLAYBOOK, REPO, playbook_env

pytestmark = pytest.mark.skipif(ANSIBLE_PLAYBOOK is None, reason="ansible-playbook is not installed")

FAKE_VLLM = """\
#!{python}
import json, os, sys
args = sys.argv[1:]
def value(flag):
    return args[args.index(flag) + 1]
if "--dataset-path" in args and not os.path.isfile(value("--dataset-path")):
    sys.exit("no dataset at " + value("--dataset-path"))
with open(os.environ["FAKE_VLLM_LOG"], "a") as log:
    log.write(json.dumps({{"base_url": value("--base-url"), "seed": value("--seed"),
                          "key": os.environ.get("OPENAI_API_KEY"),
                          "result": os.path.join(value("--result-dir"), value("--result-filename"))}}) + "\\n")
with open(os.path.join(value("--result-dir"), value("--result-filename")), "w") as out:
    json.dump({{"completed": 4, "failed": 0, "duration": 1.5, "p50_ttft_ms": 10, "p99_ttft_ms": 20, "p50_itl_ms": 1,
               "output_throughput": 40.0, "request_throughput": 2.0, "total_input_tokens": 400,
               "request_goodput": 1.5 if "--goodput" in args else None}}, out)
"""
INSTANCE_KEY = "instance-key-00000001"
# Bytes of each stand-in transfer, and the transfers the decode instance counts more at each read.
TRANSFER_BYTES, PER_READ = 1_048_576, 2


class Metrics(BaseHTTPRequestHandler):
    """An instance's /metrics: with ``nixl``, vLLM 0.32's NIXL histograms, PER_READ transfers more each read."""

    def do_GET(self):  # noqa: N802 - http.server's name
        server = self.server
        server.auth.append(self.headers.get("Authorization"))
        lines = ['vllm:num_requests_running{engine="0"} 0.0']
        if server.nixl:
            n = PER_READ * len(server.auth)
            lines = ["# TYPE vllm:nixl_xfer_time_seconds histogram",
                     *(f'vllm:nixl_xfer_time_seconds_bucket{{engine="0",le="{le}"}} {n}.0'
                       for le in ("0.005", "0.01", "+Inf")),
                     f'vllm:nixl_xfer_time_seconds_count{{engine="0"}} {n}.0',
                     f'vllm:nixl_xfer_time_seconds_sum{{engine="0"}} {n * 0.004}',
                     "# TYPE vllm:nixl_bytes_transferred histogram",
                     f'vllm:nixl_bytes_transferred_bucket{{engine="0",le="+Inf"}} {n}.0',
                     f'vllm:nixl_bytes_transferred_count{{engine="0"}} {n}.0',
                     f'vllm:nixl_bytes_transferred_sum{{engine="0"}} {n * TRANSFER_BYTES}.0', *lines]
        body = ("\n".join(lines) + "\n").encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def instances():
    """Two stand-in instances' /metrics on localhost: a prefill without NIXL metrics, a decode with them."""
    servers = []
    for nixl in (False, True):
        server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
        server.nixl, server.auth = nixl, []
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    yield servers
    for server in servers:
        server.shutdown()
        server.server_close()


def record(address: str, name: str, port: int) -> dict:
    settings = {"max_model_len": 2048, "kv_cache_dtype": "auto", "enable_prefix_caching": True, "block_size": 16}
    return {"pd_role": "prefill", "address": address, "served_model_name": "m", "settings": settings,
            "instances": [{"name": name, "port": port, "kv_transfer_port": 5600, "settings": settings}]}


PLAYBOOK = """\
- name: Publish stand-in records
  hosts: prefill:decode
  gather_facts: false
  tasks:
    - name: Publish
      ansible.builtin.set_fact:
        vllm_instance_published: "{{ records[inventory_hostname] }}"

- name: What the controller and the router decided before
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Decide
      ansible.builtin.set_fact:
        __vllm_benchmark_run: "{{ run }}"
        __vllm_benchmark_deployment: "{{ deployment }}"

- name: Run the scenarios
  hosts: p1
  gather_facts: false
  tasks:
    - name: Run them
      ansible.builtin.include_role:
        name: inferops.vllm.vllm_benchmark
"""


@pytest.mark.parametrize("colocated", [False, True])
def test_each_target_gets_every_scenario(tmp_path, colocated, instances):
    prefill_port, decode_port = (server.server_address[1] for server in instances)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "vllm"
    fake.write_text(FAKE_VLLM.format(python=sys.executable), encoding="utf-8")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    run_dir = tmp_path / "results" / "20261201-000000"
    run_dir.mkdir(parents=True)
    inventory = {"prefill": {"hosts": {"p1": {"ansible_connection": "local",
                                              "ansible_python_interpreter": sys.executable}}},
                 "decode": {"hosts": {"d1": {}}},
                 # The router host reads the instances' /metrics.
                 "router": {"hosts": {"r1": {"ansible_connection": "local",
                                             "ansible_python_interpreter": sys.executable}}}}
    (tmp_path / "hosts.json").write_text(json.dumps(inventory), encoding="utf-8")
    (tmp_path / "play.yml").write_text(PLAYBOOK, encoding="utf-8")
    sharegpt = tmp_path / "sharegpt.json"
    turns = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]
    sharegpt.write_text(json.dumps([{"conversations": turns}]), encoding="utf-8")
    scenarios = [{"name": name, "dataset": "random", "input_len": 100, "output_len": 10, "num_prompts": 4, "rate": 1}
                 for name in ("short", "other")]
    # A ShareGPT file goes to each target's directory on the benchmark host.
    scenarios.append({"name": "chat", "dataset": "sharegpt", "dataset_path": str(sharegpt), "output_len": 10,
                      "num_prompts": 4, "rate": 1, "goodput": {}})
    extra = {
        "records": {"p1": record("127.0.0.1", "vllm-0", prefill_port),
                    "d1": {**record("127.0.0.1", "vllm-0", decode_port), "pd_role": "decode"}},
        "run": {"seed": 7, "model": "m", "front": {"url": "http://127.0.0.1:8000", "router": "r1"},
                "dir": str(run_dir)},
        "deployment": {"instances": [{"name": "vllm-0", "url": f"http://127.0.0.1:{prefill_port}", "cache_dtype": "fp8",
                                      "enable_prefix_caching": True}],
                       "configuration": "PD 1P+1D", "kv_dtype": "auto", "prefix_caching": "on"},
        "vllm_benchmark_venv": str(venv), "vllm_benchmark_tokenizer": str(tmp_path),
        "vllm_benchmark_api_key": "benchmark-client-key-0001", "vllm_instance_api_key": INSTANCE_KEY,
        "vllm_benchmark_goodput_slos": {"ttft_ms": 500, "tpot_ms": 100},
        "vllm_benchmark_colocated": colocated, "vllm_benchmark_scenarios": scenarios,
        "vllm_benchmark_poll_interval": 1, "vllm_install_variant": "cpu",
    }
    log = tmp_path / "vllm.log"
    run = subprocess.run(
        [ANSIBLE_PLAYBOOK, "-i", str(tmp_path / "hosts.json"), str(tmp_path / "play.yml"), "-e", json.dumps(extra)],
        cwd=REPO, env=playbook_env(FAKE_VLLM_LOG=str(log), ANSIBLE_LOCALHOST_WARNING="0"), capture_output=True,
        text=True, timeout=300, check=False)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    calls = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
    front = [(c["base_url"], c["seed"], c["key"], Path(c["result"]).name) for c in calls[:3]]
    assert front == [("http://127.0.0.1:8000", "7", "benchmark-client-key-0001", "short.json"),
                     ("http://127.0.0.1:8000", "7", "benchmark-client-key-0001", "other.json"),
                     ("http://127.0.0.1:8000", "7", "benchmark-client-key-0001", "chat.json")], calls
    assert sorted(p.name for p in run_dir.glob("*.json")) == ["chat.json", "other.json", "short.json"]
    # Goodput: the role's SLOs for short and other, none for chat (goodput: {}), in the result's metadata.
    goodput = {name: json.loads((run_dir / f"{name}.json").read_text()).get("request_goodput")
               for name in ("short", "other", "chat")}
    assert goodput == {"short": 1.5, "other": 1.5, "chat": None}
    # The KV path: each instance read before and after each of the front's scenarios (never for the colocated
    # ones), with the instance key; the decode's two more transfers per read are one scenario's delta.
    for server in instances:
        assert server.auth == [f"Bearer {INSTANCE_KEY}"] * 6, server.auth
    assert sorted(p.name for p in (run_dir / "kv").glob("*.json")) == ["chat.json", "other.json", "short.json"]
    kv = json.loads((run_dir / "kv" / "short.json").read_text())
    expected = (PER_READ, PER_READ * TRANSFER_BYTES, [], True)
    assert (kv["transfers"], kv["bytes"], kv["problems"], kv["complete"]) == expected
    assert kv["bytes_per_prompt_token"] == round(PER_READ * TRANSFER_BYTES / 400, 1)
    assert {i["instance"]: i["status"] for i in kv["instances"]} == {"p1 vllm-0": "missing", "d1 vllm-0": "ok"}
    assert f"{PER_READ} NIXL transfers, {PER_READ * TRANSFER_BYTES} bytes" in " ".join(output.split())
    assert INSTANCE_KEY not in output
    if not colocated:
        assert len(calls) == 3 and not (run_dir / "colocated").exists()
        return
    alone = [(c["base_url"], c["key"], Path(c["result"]).parent.name, Path(c["result"]).name) for c in calls[3:]]
    url = f"http://127.0.0.1:{prefill_port}"
    assert alone == [(url, INSTANCE_KEY, "colocated", "short.json"), (url, INSTANCE_KEY, "colocated", "other.json"),
                     (url, INSTANCE_KEY, "colocated", "chat.json")], calls
    assert not (run_dir / "colocated" / "kv").exists()
    # The next seed: the colocated runs send none of the front's prompts again.
    assert [int(c["seed"]) for c in calls[3:]] == [int(c["seed"]) + 1 for c in calls[:3]]
    assert sorted(p.name for p in (run_dir / "colocated").glob("*.json")) == ["chat.json", "other.json", "short.json"]
    assert "short against p1 vllm-0 alone (no router, no PD)" in " ".join(output.split())
