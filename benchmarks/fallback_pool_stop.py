# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Client requests through the front while the local decode pool is stopped, with a fallback configured
(issue #13), and the local path's latency with and without the fallback; prints the figures.

    python3 benchmarks/fallback_pool_stop.py            # the sandbox of scripts/sandbox/up.sh must be up
    python3 benchmarks/fallback_pool_stop.py --keep     # leave the cloud and the front's fallback in place
    python3 benchmarks/fallback_pool_stop.py --json fallback.json

What it does:

  1. the "cloud": a container inferops-cloud-1 (10.89.250.14 on the sandbox network, created if missing)
     with a vLLM instance deployed by this collection without PD, behind TLS with its own CA and key
     (molecule/default/cloud.yml, the molecule test's cloud);
  2. deploy_pd.yml with the cloud as the front's fallback; --latency sequential requests through the front
     (/v1/completions, 1 token), served locally; the same requests are measured again at the end without
     the fallback (step 4): the local path's added latency (target <= +5 %);
  3. a pool stop under steady load: `vllm bench serve` (the real client, benchmarks/bench_load.py) through the
     front; after --before seconds every decode instance is stopped (`systemctl stop`: vLLM drains what it
     has), --down seconds later started again; the load goes on until the front serves locally again and
     --after seconds more. Figures: requests sent, failed (target 0), and during the stop how many the
     front sent to the cloud (its counter) and the cloud finished (its own counter); TTFT p50 local and
     while falling back; seconds from decode's start until the front served locally again;
  4. unless --keep: deploy_pd.yml without the fallback, the local path measured again, the cloud container
     removed.

It asserts nothing (exit status 1 only when a step failed to run); the figures go to benchmarks/RESULTS.md
by hand. On 2 cores the cloud's vLLM shares the cores with the sandbox's: its TTFT is no cloud's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench_load import BenchLoad
from sandbox_costs import (
    DECODE_HOST,
    MODEL,
    PREFILL_HOST,
    REPO,
    ROUTER_HOST,
    container_ip,
    podman,
    require_sandbox,
    secret,
    secrets_dir,
)

CLOUD_HOST = "inferops-cloud-1"
CLOUD_ADDRESS = "10.89.250.14"
SANDBOX_NETWORK = "inferops-sandbox"
TARGETS = {"failed": "0 while the pool is down", "local_path": "<= +5 % with the fallback configured"}


def sandbox(argv: list[str], log: Path) -> tuple[float, int, str]:
    """A command with the sandbox's environment (scripts/sandbox/lib.sh), output to a log."""
    script = ('source scripts/sandbox/lib.sh && export_sandbox_env && PATH="$(tools_venv_dir)/bin:$PATH" '
              'ANSIBLE_NOCOLOR=1 exec "$@"')
    started = time.monotonic()
    with log.open("w", encoding="utf-8") as out:
        run = subprocess.run(["bash", "-c", script, "bash", *argv], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                             check=False)
    return time.monotonic() - started, run.returncode, log.read_text(encoding="utf-8", errors="replace")


def start_cloud_host() -> None:
    """The cloud's container, as scripts/sandbox/up.sh starts a sandbox host (SSH key, fixed address)."""
    exists = subprocess.run(["podman", "container", "exists", CLOUD_HOST], check=False).returncode == 0
    if not exists:
        image = podman("inspect", "-f", "{{.ImageName}}", PREFILL_HOST).strip()
        podman("run", "-d", "--name", CLOUD_HOST, "--hostname", CLOUD_HOST, "--network", SANDBOX_NETWORK,
               "--ip", CLOUD_ADDRESS, "--systemd=always", "--shm-size=1g", image, "/sbin/init")
        time.sleep(3)
    key = subprocess.run(["podman", "exec", PREFILL_HOST, "cat", "/root/.ssh/authorized_keys"], capture_output=True,
                         text=True, check=True).stdout
    subprocess.run(["podman", "exec", "-i", CLOUD_HOST, "sh", "-c", "install -d -m 0700 /root/.ssh && cat "
                    ">/root/.ssh/authorized_keys && chmod 0600 /root/.ssh/authorized_keys"], input=key, text=True,
                   check=True)


def cloud_inventory(directory: Path) -> Path:
    """A second inventory (-i inventories/sandbox -i THIS) with the cloud group."""
    path = directory / "cloud-inventory.yml"
    path.write_text(json.dumps({"cloud": {"hosts": {CLOUD_HOST: {"ansible_host": CLOUD_ADDRESS}}}}))
    return path


def front_call(url: str, key: str) -> tuple[float, str]:
    """(seconds, served-by) of one 1-token completion through the front."""
    body = json.dumps({"model": MODEL, "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0})
    req = urllib.request.Request(f"{url}/v1/completions", data=body.encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    started = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as resp:
        resp.read()
        return time.perf_counter() - started, resp.headers.get("X-Inferops-Served-By", "")


def local_path(url: str, key: str, count: int, fallback: bool) -> dict:
    """Sequential requests through the front, all served locally (the header only exists with fallbacks)."""
    front_call(url, key)  # warm
    seconds = []
    for _request in range(count):
        elapsed, served_by = front_call(url, key)
        if served_by != ("local" if fallback else ""):
            raise RuntimeError(f"a local-path request was served by {served_by!r}")
        seconds.append(elapsed * 1000)
    ordered = sorted(seconds)
    p90 = ordered[int(0.9 * (len(ordered) - 1))]
    return {"median_ms": round(statistics.median(seconds), 1), "p90_ms": round(p90, 1), "requests": count}


def fallback_counts() -> float:
    text = podman("exec", ROUTER_HOST, "python3", "-c", "import urllib.request; print(urllib.request.urlopen("
                  "'http://127.0.0.1:8090/fallback_metrics', timeout=10).read().decode())")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("inferops_vllm_front_fallbacks_total{"))


def cloud_requests() -> float:
    # The cloud's vLLM wants its key on /metrics too (roles/vllm_instance's inferops_vllm_auth.py, issue #25).
    key = (secrets_dir() / "fallback-cloud" / "api_key").read_text().split()[0]
    req = urllib.request.Request(f"http://{CLOUD_ADDRESS}:8100/metrics", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{"))


def decode_units() -> list[str]:
    out = podman("exec", DECODE_HOST, "sh", "-c", "systemctl list-units --all --plain --no-legend 'vllm@*.service' "
                 "| awk '{print $1}'")
    return sorted(out.split())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=int, default=30, help="seconds of load before the stop (default 30)")
    parser.add_argument("--down", type=int, default=60, help="seconds the decode pool stays stopped (default 60)")
    parser.add_argument("--after", type=int, default=30, help="seconds of load once local again (default 30)")
    parser.add_argument("--latency", type=int, default=40, help="local-path requests per side (default 40)")
    parser.add_argument("--keep", action="store_true", help="leave the cloud and the front's fallback in place")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    require_sandbox()
    work = Path(tempfile.mkdtemp(prefix="inferops-fallback-"))
    # Kept between runs (its key too): a new key would restart the cloud's vLLM.
    cloud_dir = secrets_dir() / "fallback-cloud"
    inventory = ["-i", "inventories/sandbox", "-i", str(cloud_inventory(work))]
    figures: dict = {"date": datetime.date.today().isoformat(), "targets": TARGETS}
    print(f"logs in {work}", flush=True)
    front = f"http://{container_ip(ROUTER_HOST)}:8000"
    key = secret("client_api_key")

    start_cloud_host()
    seconds, rc, out = sandbox(["ansible-playbook", "molecule/default/cloud.yml", *inventory, "-e",
                                f"cloud_dir={cloud_dir}"], work / "cloud.log")
    print(f"cloud deployed (cloud.yml): {seconds:.0f} s, exit {rc}", flush=True)
    if rc != 0:
        print(out[-3000:])
        return 1
    seconds, rc, out = sandbox(["ansible-playbook", "playbooks/deploy_pd.yml", *inventory, "-e",
                                f"@{cloud_dir}/fallbacks.yml"], work / "deploy-fallback.log")
    print(f"front with the fallback (deploy_pd.yml): {seconds:.0f} s, exit {rc}", flush=True)
    if rc != 0:
        print(out[-3000:])
        return 1
    figures["local_path_with"] = local_path(front, key, args.latency, fallback=True)
    toml = podman("exec", PREFILL_HOST, "cat", "/etc/vllm/prefill-0.toml")
    tokenizer = re.search(r'^name = "([^"]+)"', toml, re.MULTILINE).group(1)
    bench = BenchLoad(PREFILL_HOST, front, MODEL, tokenizer, key, rate=0.5, window=120, overlap=40)
    units = decode_units()
    front_before, cloud_before = fallback_counts(), cloud_requests()
    load_start = bench.start()
    time.sleep(args.before)
    stop_at = time.perf_counter()
    podman("exec", DECODE_HOST, "systemctl", "stop", *units, timeout=900)
    stopped_at = time.perf_counter()
    time.sleep(args.down)
    podman("exec", DECODE_HOST, "systemctl", "start", *units, timeout=300)
    started_at = time.perf_counter()
    local_again = None
    while time.perf_counter() - started_at < 900:
        try:
            if front_call(front, key)[1] == "local":
                local_again = time.perf_counter()
                break
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(2)
    time.sleep(args.after)
    load_end = time.perf_counter()
    result = bench.stop()
    front_after, cloud_after = fallback_counts(), cloud_requests()
    during = result.between(stop_at, local_again or load_end)
    local = [r for r in result.between(load_start, stop_at) if not r[2] and r[1] is not None]
    fallback = [r for r in during if not r[2] and r[1] is not None]
    figures["pool_stop"] = {
        "decode_units": units, "stop_seconds": round(stopped_at - stop_at, 1), "down_seconds": args.down,
        "local_again_seconds": round(local_again - started_at, 1) if local_again else None,
        "requests": len(result.requests), "completed": result.completed, "failed": result.failed,
        "failed_during_stop": sum(1 for r in during if r[2]), "requests_during_stop": len(during),
        "front_fallbacks": front_after - front_before, "cloud_finished": cloud_after - cloud_before,
        "ttft_p50_local_ms": round(statistics.median(r[1] for r in local) * 1000) if local else None,
        "ttft_p50_during_stop_ms": round(statistics.median(r[1] for r in fallback) * 1000) if fallback else None,
        "errors": sorted(set(result.errors()))[:5],
    }
    stop = figures["pool_stop"]
    print(f"pool stop under load: {stop['requests']} requests, {stop['failed']} failed "
          f"({stop['failed_during_stop']} of {stop['requests_during_stop']} sent while decode was down or not yet "
          f"back); the front sent {stop['front_fallbacks']:.0f} to the cloud, which finished "
          f"{stop['cloud_finished']:.0f} "
          f"(it also counts the probes); TTFT p50 {stop['ttft_p50_local_ms']} ms local, "
          f"{stop['ttft_p50_during_stop_ms']} ms while down; stopping took {stop['stop_seconds']} s; local again "
          f"{stop['local_again_seconds']} s after decode started", flush=True)
    if stop["errors"]:
        print("errors: " + " | ".join(stop["errors"]))

    if not args.keep:
        seconds, rc, _out = sandbox(["ansible-playbook", "playbooks/deploy_pd.yml", "-i", "inventories/sandbox"],
                                    work / "deploy-back.log")
        print(f"front without the fallback again: {seconds:.0f} s, exit {rc}")
        if rc == 0:
            figures["local_path_without"] = local_path(front, key, args.latency, fallback=False)
            ratio = figures["local_path_with"]["median_ms"] / figures["local_path_without"]["median_ms"] - 1
            figures["local_path_added_pct"] = round(ratio * 100, 1)
            without, with_ = figures["local_path_without"]["median_ms"], figures["local_path_with"]["median_ms"]
            print(f"local path, median of {args.latency} 1-token completions through the front: {without} ms "
                  f"without, {with_} ms with the fallback configured ({figures['local_path_added_pct']:+.1f} %)")

        subprocess.run(["podman", "rm", "-f", "-t", "5", CLOUD_HOST], capture_output=True, check=False)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
