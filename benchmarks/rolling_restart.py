# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Measure a rolling restart of the decode pool under steady load, and print the figures.

    python3 benchmarks/rolling_restart.py            # the sandbox of scripts/sandbox/up.sh must be up
    python3 benchmarks/rolling_restart.py --keep     # leave decode-1 running afterwards
    python3 benchmarks/rolling_restart.py --json roll.json

What it does, with steady load from `vllm bench serve` (the real client, run in the prefill host's
vLLM venv; benchmarks/bench_load.py) through the front all along:

  1. scale-out: adds decode-1 (port 8201) beside decode-0 on the decode host (`up.sh -i` a
     temporary inventory whose host_vars give that host two instances): failed requests during
     the deploy_pd.yml run, and whether prefill-0 and decode-0 kept running (same PID);
  2. steady: --steady seconds of load alone: TTFT p50/p99;
  3. roll: playbooks/rolling_restart.yml restarts decode-0 then decode-1: failed requests, TTFT
     p50/p99 of the requests sent during the roll, the roll's wall time and each instance's time
     from the rollout role's own messages ("decode-0 rolled in N s");
  4. unless --keep: scale-in under load, deploy_pd.yml with the plain sandbox inventory again (decode-1 taken
     out of the routers and drained, then stopped, the
     routers restart one replica at a time).

It asserts nothing (exit status 1 only when a step failed to run); the figures and their targets
go to benchmarks/RESULTS.md by hand. On a 2-core machine three vLLM processes share the cores
with the load: TTFT during the roll is dominated by the restarting instance's start-up.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_load import BenchLoad, summary
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
)

DECODE_INSTANCES = [
    {"name": "decode-0", "port": 8200, "kv_transfer_port": 5700, "cpus": "1"},
    {"name": "decode-1", "port": 8201, "kv_transfer_port": 5701, "cpus": "1"},
]
TARGETS = {"failed": "0", "ttft": "p99 during the roll <= 5x steady p99"}


def write_inventory(decode_1_cpus: str | None = None, decode_0_overrides: dict | None = None) -> Path:
    """A second inventory (ansible-playbook -i ... -i THIS) that gives the decode host two instances (decode-1 on
    `decode_1_cpus` and decode-0 with `decode_0_overrides` when given)."""
    changes = {"decode-0": {"overrides": decode_0_overrides} if decode_0_overrides else {},
               "decode-1": {"cpus": decode_1_cpus} if decode_1_cpus else {}}
    return write_host_inventory(DECODE_HOST, [dict(i, **changes[i["name"]]) for i in DECODE_INSTANCES])


def write_host_inventory(host: str, instances: list[dict]) -> Path:
    """A second inventory (ansible-playbook -i ... -i THIS) that gives `host` these vllm_instance_instances."""
    directory = Path(tempfile.mkdtemp(prefix="inferops-roll-"))
    (directory / "host_vars").mkdir()
    (directory / "hosts.yml").write_text(json.dumps({"all": {"hosts": {host: {}}}}))
    (directory / "host_vars" / f"{host}.yml").write_text(json.dumps({"vllm_instance_instances": instances}))
    return directory


def playbook(name: str, *args: str, log: Path) -> tuple[float, int, str]:
    """ansible-playbook with the sandbox's environment (scripts/sandbox/lib.sh), output to a log."""
    script = ('source scripts/sandbox/lib.sh && export_sandbox_env && PATH="$(tools_venv_dir)/bin:$PATH" '
              'ANSIBLE_NOCOLOR=1 exec ansible-playbook "$@"')
    argv = ["bash", "-c", script, "bash", f"playbooks/{name}", "-i", "inventories/sandbox", *args]
    started = time.monotonic()
    with log.open("w", encoding="utf-8") as out:
        run = subprocess.run(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, check=False)
    return time.monotonic() - started, run.returncode, log.read_text(encoding="utf-8", errors="replace")


def main_pid(container: str, unit: str) -> str:
    return podman("exec", container, "systemctl", "show", "-p", "MainPID", "--value", unit).strip()


def load() -> BenchLoad:
    toml = podman("exec", PREFILL_HOST, "cat", "/etc/vllm/prefill-0.toml")
    tokenizer = re.search(r'^name = "([^"]+)"', toml, re.MULTILINE).group(1)
    return BenchLoad(PREFILL_HOST, f"http://{container_ip(ROUTER_HOST)}:8000", MODEL, tokenizer,
                     secret("client_api_key"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steady", type=int, default=90, help="seconds of load alone (default 90)")
    parser.add_argument("--keep", action="store_true", help="leave decode-1 running afterwards")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    require_sandbox()
    extra = write_inventory()
    logs = Path(tempfile.mkdtemp(prefix="inferops-roll-logs-"))
    figures: dict = {"date": datetime.date.today().isoformat()}
    print(f"logs in {logs}", flush=True)

    before = {"prefill-0": main_pid(PREFILL_HOST, "vllm@prefill-0"), "decode-0": main_pid(DECODE_HOST, "vllm@decode-0")}
    bench = load()
    start = bench.start()
    seconds, rc, output = playbook("deploy_pd.yml", "-i", str(extra), log=logs / "scale-out.log")
    end = time.perf_counter()
    result = bench.stop()
    kept = all(main_pid(host, f"vllm@{name}") == before[name]
               for host, name in ((PREFILL_HOST, "prefill-0"), (DECODE_HOST, "decode-0")))
    print(f"scale-out (deploy_pd.yml adds decode-1): {seconds:.0f} s, exit {rc}; {summary(result, start, end)}; "
          f"prefill-0 and decode-0 kept running: {'yes' if kept else 'NO'}")
    if rc != 0:
        print(output[-3000:])
        return 1
    failed = len([r for r in result.between(start, end) if r[2]])
    figures["scale_out"] = {"seconds": round(seconds, 1), "failed": failed, "others_kept_running": kept}

    bench = load()
    start = bench.start()
    time.sleep(args.steady)
    end = time.perf_counter()
    result = bench.stop()
    steady = {"p50_ms": result.ttft_ms(start, end, 50), "p99_ms": result.ttft_ms(start, end, 99),
              "requests": len(result.between(start, end)), "failed": result.failed}
    print(f"steady state: {summary(result, start, end)}; TTFT p50 {steady['p50_ms']} ms, p99 {steady['p99_ms']} ms")
    figures["steady"] = steady

    bench = load()
    start = bench.start()
    seconds, rc, output = playbook("rolling_restart.yml", "-i", str(extra), "-e",
                                   '{"vllm_rollout_instances": ["decode-0", "decode-1"]}', log=logs / "roll.log")
    end = time.perf_counter()
    result = bench.stop()
    per_instance = {m.group(1): float(m.group(2)) for m in re.finditer(r"(decode-\d) rolled in ([0-9.]+) s", output)}
    roll = {"seconds": round(seconds, 1), "exit": rc, "per_instance_seconds": per_instance,
            "requests": len(result.between(start, end)), "failed": result.failed,
            "p50_ms": result.ttft_ms(start, end, 50), "p99_ms": result.ttft_ms(start, end, 99),
            "errors": result.errors()[:5]}
    print(f"rolling restart of decode-0, decode-1: {seconds:.0f} s, exit {rc}; per instance {per_instance}; "
          f"{summary(result, start, end)}; TTFT p50 {roll['p50_ms']} ms, p99 {roll['p99_ms']} ms")
    if result.errors():
        print(f"  errors: {result.errors()[:5]}")
    figures["roll"] = roll
    print(f"targets: failed requests {TARGETS['failed']}; {TARGETS['ttft']}")

    if not args.keep:
        bench = load()
        start = bench.start()
        seconds, rc2, output2 = playbook("deploy_pd.yml", log=logs / "scale-in.log")
        end = time.perf_counter()
        result = bench.stop()
        failed = len([r for r in result.between(start, end) if r[2]])
        print(f"scale-in (deploy_pd.yml without decode-1: out of the routers, drained, stopped): {seconds:.0f} s, "
              f"exit {rc2}; {summary(result, start, end)}")
        figures["scale_in"] = {"seconds": round(seconds, 1), "exit": rc2, "failed": failed}
        if rc2 != 0:
            print(output2[-3000:])
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
