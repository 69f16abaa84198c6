# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Routine operations and faults under steady load on the sandbox, and what each cost: failed requests and the
time until the front answers `ok` again.

    python3 benchmarks/chaos.py                      # the sandbox of scripts/sandbox/up.sh must be up
    python3 benchmarks/chaos.py --only nginx-reload,replica-kill,decode-kill
    python3 benchmarks/chaos.py --json chaos.json --keep

One load runs all along: streamed 8-token completions through the front at --rate requests/s from this process
(benchmarks/bench_load.py FrontLoad). First the decode host gets a second instance (decode-1, port 8201, so that a
decode instance can leave rotation without emptying the pool), then each operation runs in turn and the front must
answer `ok` (every instance healthy) before the next one; at the end decode-1 leaves again (unless --keep).
With --pool prefill the prefill host gets the second instance instead (prefill-1, port 8101, KV port 5601, on
prefill-0's core: three vLLM processes are what the two cores carry): prefill-roll rolls the prefill pool of two
without downtime, prefill-kill is bounded, and the decode operations hit the only decode instance (outages).

Operations (planned ones must fail no request; a fault may fail what was in flight plus what the routers sent the
dead instance before their health checks took it out, and nothing after the recovery):

  nginx-reload     planned  `systemctl reload nginx` on the router host, three times, 5 s apart
  replica-kill     fault    SIGKILL of router replica 1 (systemd restarts it; nginx uses replica 0 meanwhile)
  client-key       planned  a client key rotation: deploy_pd.yml with the old and a new key, the load switches to
                            the new key, deploy_pd.yml with the new key alone (docs/key-rotation.md)
  instance-key     planned  a new vllm_instance_api_key, one deploy_pd.yml run
  decode-roll      planned  playbooks/rolling_restart.yml over decode-0 and decode-1
  prefill-roll     planned  playbooks/rolling_restart.yml over prefill-0 with vllm_rollout_allow_downtime (the only
                            prefill instance: an outage, no bound); proven against both decode instances first
  decode-kill      fault    SIGKILL of decode-0's vLLM process (systemd restarts the unit)
  prefill-kill     fault    SIGKILL of prefill-0's vLLM process (systemd restarts the unit; with --pool prefill,
                            prefill-1 serves)
  kv-block         fault    every packet between the prefill and the decode host dropped for --block seconds
                            (on the prefill host, its own nftables table): kv_load_failure_policy recompute must
                            keep the requests answering
  prefill-restart  fault    `podman restart` of the prefill host: the sandbox's only prefill instance, so the
                            service is down until it is back (no bound; the figure is the outage)

Every instance's /health is probed all along from the router host (where the routers' own health checks come
from), every --probe-interval s with a 60 s timeout, so that a late answer is measured instead of cut: the table
below the operations has each instance's /health latency per operation (p50, p99, max, and how many probes took
longer than the routers' timeout). --decode-1-cpus puts decode-1 on other cores, e.g. "0", the prefill
instance's core (issue #24's layout).

Bounded: at most --rate requests/s, each operation waits at most --recovery s for the front, the whole run stops
at the first operation that does not recover. Traffic goes to the sandbox's containers only. It asserts nothing
(exit 1 only when an operation could not run); the table goes to benchmarks/RESULTS.md by hand.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import secrets
import string
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench_load import FrontLoad, LoadResult, percentile
from rolling_restart import DECODE_INSTANCES, playbook, write_host_inventory, write_inventory
from sandbox_costs import (
    DECODE_HOST,
    FRONT_PORT,
    MODEL,
    PREFILL_HOST,
    ROUTER_HOST,
    container_ip,
    machine_description,
    podman,
    require_sandbox,
    secret,
    secrets_dir,
)
from sandbox_faults import kill_vllm_command, peer_block_rules

OPERATIONS = ("nginx-reload", "replica-kill", "client-key", "instance-key", "decode-roll", "prefill-roll",
              "decode-kill", "prefill-kill", "kv-block", "prefill-restart")
# Operations on a pool's only instance: the service is down until it is back (no bound). By the pool of two.
OUTAGES = {"decode": {"prefill-roll", "prefill-kill", "prefill-restart"},
           "prefill": {"decode-roll", "decode-kill", "prefill-restart"}}
FAULTS = {"replica-kill", "decode-kill", "prefill-kill", "kv-block", "prefill-restart"}
# --pool prefill: the prefill host's instances (the sandbox's prefill-0 and a second one on its core).
PREFILL_INSTANCES = [
    {"name": "prefill-0", "port": 8100, "kv_transfer_port": 5600, "cpus": "0"},
    {"name": "prefill-1", "port": 8101, "kv_transfer_port": 5601, "cpus": "0"},
]
# What a fault may fail beyond the requests in flight: the routers' health window (vllm_router defaults:
# interval 2 s x 2 failures + timeout 5 s), at the load's rate.
HEALTH_WINDOW = 2 * 2 + 5
SETTLE = 10


@dataclass
class Outcome:
    name: str
    kind: str
    start: float
    end: float = 0.0
    recovered_at: float | None = None
    bound: float | None = 0
    note: str = ""
    sent: int = 0
    failed: int = 0
    failed_after_recovery: int = 0
    ttft_p50_ms: float | None = None
    errors: list[str] = field(default_factory=list)
    # instance -> (probes, p50 ms, p99 ms, max ms, probes over the routers' health timeout)
    health: dict = field(default_factory=dict)

    def verdict(self) -> str:
        if self.note.startswith("failed: "):
            return "operation failed"
        if self.recovered_at is None:
            return "not recovered"
        if self.failed_after_recovery:
            return "not met (failed after the recovery)"
        if self.bound is None:
            return "no bound (outage)"
        return "met" if self.failed <= self.bound else "not met"


def front_url() -> str:
    return f"http://{container_ip(ROUTER_HOST)}:{FRONT_PORT}"


def front_health(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
            return resp.status, resp.read().decode(errors="replace").strip()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace").strip()
    except OSError as exc:
        return 0, str(exc)


def wait_ok(url: str, timeout: float) -> float | None:
    """When the front answers 200 `ok` (every pool's instances healthy), or None after `timeout`."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        status, body = front_health(url)
        if status == 200 and body.split()[:1] == ["ok"]:
            return time.perf_counter()
        time.sleep(1)
    return None


def write_secret(name: str, value: str) -> None:
    """Replace a sandbox key where the inventory's password lookup reads it (0600, atomic)."""
    path = secrets_dir() / name
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    os.replace(tmp, path)


def new_key() -> str:
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _position in range(40))


def exec_in(container: str, *argv: str, timeout: float = 120) -> str:
    return podman("exec", container, *argv, timeout=timeout)


# Runs on the router host (python3 of the distribution): one thread per instance URL, a GET of /health every
# INTERVAL s with a 60 s timeout; prints "<CLOCK_MONOTONIC at the start> <url> <ms> <status>" per probe (the
# container shares the kernel's monotonic clock with this process's perf_counter).
PROBE_SCRIPT = """
import sys, threading, time, urllib.request, urllib.error
interval = float(sys.argv[1])
lock = threading.Lock()
def probe(url):
    while True:
        start = time.monotonic()
        try:
            with urllib.request.urlopen(url, timeout=60) as resp:
                status = resp.status
        except urllib.error.HTTPError as exc:
            status = exc.code
        except OSError:
            status = 0
        ms = (time.monotonic() - start) * 1000
        with lock:
            print(f"{start:.3f} {url} {ms:.1f} {status}", flush=True)
        time.sleep(max(0.0, interval - ms / 1000))
for url in sys.argv[2:]:
    threading.Thread(target=probe, args=(url,), daemon=True).start()
sys.stdin.read()
"""


class HealthProbe:
    """Every instance's /health latency, measured from the router host all along the run."""

    def __init__(self, urls: dict[str, str], interval: float):
        self.names = {url: name for name, url in urls.items()}
        self.samples: list[tuple[float, str, float, int]] = []
        self.proc = subprocess.Popen(  # pylint: disable=consider-using-with
            ["podman", "exec", "-i", ROUTER_HOST, "python3", "-u", "-c", PROBE_SCRIPT, str(interval), *urls.values()],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            parts = line.split()
            if len(parts) == 4 and parts[1] in self.names:
                self.samples.append((float(parts[0]), self.names[parts[1]], float(parts[2]), int(parts[3])))

    def stop(self) -> None:
        self.proc.stdin.close()  # the script exits at the end of its input
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.reader.join(timeout=10)

    def summary(self, start: float, end: float, timeout_s: float) -> dict:
        """Per instance, the probes started in [start, end]: count, p50, p99, max (ms), and over `timeout_s`."""
        out = {}
        for name in sorted(set(self.names.values())):
            ms = [m for t, n, m, _status in self.samples if n == name and start <= t <= end]
            if ms:
                out[name] = (len(ms), round(percentile(ms, 50)), round(percentile(ms, 99)), round(max(ms)),
                             sum(1 for m in ms if m > timeout_s * 1000))
        return out


class Chaos:
    def __init__(self, args, load: FrontLoad, url: str, extra: Path, logs: Path):
        self.args, self.load, self.url, self.extra, self.logs = args, load, url, extra, logs

    def deploy(self, name: str, *args: str, pool_of_two: bool = True) -> None:
        """deploy_pd.yml on the sandbox, with the second instance (the second inventory) unless `pool_of_two` is
        false."""
        extra = ("-i", str(self.extra)) if pool_of_two else ()
        seconds, rc, output = playbook("deploy_pd.yml", *extra, *args, log=self.logs / f"{name}.log")
        if rc != 0:
            raise RuntimeError(f"{name}: deploy_pd.yml failed after {seconds:.0f} s (log: {self.logs / name}.log): "
                               f"{output[-1500:]}")

    def nginx_reload(self) -> None:
        for _time in range(3):
            exec_in(ROUTER_HOST, "systemctl", "reload", "nginx.service")
            time.sleep(5)

    def wait_back(self, container: str, unit: str, url: str) -> None:
        """Until `unit` is active in `container` and `url` (its health route, on the container's loopback) answers
        200: what the operation broke is back (the routers' view follows within their health window)."""
        probe = f"import urllib.request; urllib.request.urlopen('{url}', timeout=5)"
        deadline = time.monotonic() + self.args.recovery
        time.sleep(1)
        while time.monotonic() < deadline:
            active = subprocess.run(["podman", "exec", container, "systemctl", "is-active", unit],
                                    capture_output=True, text=True, check=False).stdout.strip()
            if active == "active" and subprocess.run(["podman", "exec", container, "python3", "-c", probe],
                                                     capture_output=True, check=False).returncode == 0:
                return
            time.sleep(1)
        raise RuntimeError(f"{unit} on {container} not back within {self.args.recovery:.0f} s")

    def replica_kill(self) -> None:
        """The operation lasts until the killed replica is back: active and ready (its /readiness 200)."""
        exec_in(ROUTER_HOST, "systemctl", "kill", "-s", "KILL", "vllm-router@1.service")
        env = exec_in(ROUTER_HOST, "cat", "/etc/vllm-router/replica-1.env")
        port = next(int(line.split("=", 1)[1]) for line in env.splitlines() if line.startswith("VLLM_ROUTER_PORT="))
        self.wait_back(ROUTER_HOST, "vllm-router@1.service", f"http://127.0.0.1:{port}/readiness")

    def client_key(self) -> None:
        old, new = secret("client_api_key"), new_key()
        with tempfile.TemporaryDirectory(prefix="inferops-chaos-keys-") as directory:
            both = Path(directory) / "keys.json"
            fd = os.open(both, os.O_WRONLY | os.O_CREAT, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"vllm_router_api_keys": [old, new]}, f)
            self.deploy("client-key-accept-both", "-e", f"@{both}")
        self.load.api_key = new  # the clients switch
        write_secret("client_api_key", new)  # the inventory's list is now the new key alone
        self.deploy("client-key-drop-old")

    def instance_key(self) -> None:
        write_secret("instance_api_key", new_key())
        self.deploy("instance-key")

    def roll(self, role: str) -> None:
        """rolling_restart.yml over the pool of `role`: both instances of the pool of two, each proven against
        every instance of the other role (the KV throughput floor) before it goes back; the pool of one with
        vllm_rollout_allow_downtime (an outage)."""
        two = self.args.pool == role
        names = [f"{role}-0", f"{role}-1"] if two else [f"{role}-0"]
        seconds, rc, output = playbook("rolling_restart.yml", "-i", str(self.extra), "-e",
                                       json.dumps({"vllm_rollout_instances": names,
                                                   "vllm_rollout_allow_downtime": not two}),
                                       log=self.logs / f"{role}-roll.log")
        if rc != 0:
            raise RuntimeError(f"{role}-roll: failed after {seconds:.0f} s: {output[-1500:]}")

    def kill(self, container: str, name: str, port: int) -> None:
        """SIGKILL of the instance's vLLM process (as a crash or the OOM killer), not of its whole unit: on a cgroup
        v1 host the containers' systemd would wait the unit's TimeoutStopSec before restarting it (docs/testing.md)."""
        exec_in(container, "sh", "-c", kill_vllm_command([f"vllm@{name}.service"]))
        self.wait_back(container, f"vllm@{name}.service", f"http://127.0.0.1:{port}/health")

    def kv_block(self) -> None:
        decode = container_ip(DECODE_HOST)
        rules = peer_block_rules("inferops_chaos", decode, "drop")
        subprocess.run(["podman", "exec", "-i", PREFILL_HOST, "nft", "-f", "-"], input=rules, text=True,
                       check=True, timeout=30)
        try:
            time.sleep(self.args.block)
        finally:
            exec_in(PREFILL_HOST, "nft", "delete", "table", "inet", "inferops_chaos")

    def prefill_restart(self) -> None:
        podman("restart", "--time", "30", PREFILL_HOST, timeout=180)
        self.wait_back(PREFILL_HOST, "vllm@prefill-0.service", "http://127.0.0.1:8100/health")


def judge(outcome: Outcome, result: LoadResult, rate: float, max_concurrency: int) -> None:
    """The requests sent from the operation's start until the front was `ok` again; those sent in the SETTLE
    seconds after that must not fail."""
    recovered = outcome.recovered_at if outcome.recovered_at is not None else outcome.end
    inside = result.between(outcome.start, max(outcome.end, recovered))
    outcome.sent = len(inside)
    failed = [r for r in inside if r[2]]
    outcome.failed = len(failed)
    outcome.errors = sorted({r[2][:160] for r in failed})[:4]
    outcome.failed_after_recovery = sum(1 for r in result.between(max(outcome.end, recovered),
                                                                  max(outcome.end, recovered) + SETTLE) if r[2])
    ttfts = [t * 1000 for _s, t, e in inside if not e and t is not None]
    value = percentile(ttfts, 50)
    outcome.ttft_p50_ms = round(value) if value is not None else None
    if outcome.kind == "fault" and outcome.bound is not None:
        outcome.bound = max_concurrency + rate * HEALTH_WINDOW


def table(outcomes: list[Outcome]) -> str:
    lines = ["| operation | kind | requests during it | failed | bound | recovered after | TTFT p50 | verdict |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for o in outcomes:
        recovered = f"{o.recovered_at - o.start:.0f} s" if o.recovered_at is not None else "no"
        bound = "none" if o.bound is None else f"{o.bound:g}"
        ttft = f"{o.ttft_p50_ms} ms" if o.ttft_p50_ms is not None else "n/a"
        lines.append(f"| {o.name} | {o.kind} | {o.sent} | {o.failed} | {bound} | {recovered} | {ttft} | "
                     f"{o.verdict()} |")
    return "\n".join(lines)


def health_table(outcomes: list[Outcome], timeout_s: float) -> str:
    lines = [f"| operation | instance | /health probes | p50 | p99 | max | over the routers' {timeout_s:g} s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for o in outcomes:
        for name, (count, p50, p99, most, over) in o.health.items():
            lines.append(f"| {o.name} | {name} | {count} | {p50} ms | {p99} ms | {most} ms | {over} |")
    return "\n".join(lines)


def router_health_timeout() -> float:
    """The routers' --health-check-timeout-secs, from their unit on the router host."""
    unit = exec_in(ROUTER_HOST, "cat", "/etc/systemd/system/vllm-router@.service")
    found = re.search(r"--health-check-timeout-secs[ =](\d+)", unit)
    return float(found.group(1)) if found else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--only", default=",".join(OPERATIONS), help="comma-separated operations, in this order")
    parser.add_argument("--rate", type=float, default=0.5, help="requests/s through the front")
    parser.add_argument("--block", type=float, default=30.0, help="seconds the KV path is blocked")
    parser.add_argument("--recovery", type=float, default=300.0, help="seconds an operation may take to recover")
    parser.add_argument("--keep", action="store_true", help="leave the second instance running at the end")
    parser.add_argument("--pool", choices=("decode", "prefill"), default="decode",
                        help="the pool that gets a second instance (default decode)")
    parser.add_argument("--json", help="write the outcomes here too")
    parser.add_argument("--probe-interval", type=float, default=1.0, help="seconds between two /health probes")
    parser.add_argument("--decode-1-cpus", default=DECODE_INSTANCES[1]["cpus"],
                        help='the cores of decode-1 (default: decode-0\'s; "0" is the prefill instance\'s)')
    args = parser.parse_args(argv)
    chosen = [name for name in args.only.split(",") if name]
    unknown = [name for name in chosen if name not in OPERATIONS]
    if unknown:
        parser.error(f"unknown operations {unknown}; choose from {', '.join(OPERATIONS)}")
    require_sandbox()
    url = front_url()
    logs = Path(tempfile.mkdtemp(prefix="inferops-chaos-"))
    if args.pool == "prefill":
        extra = write_host_inventory(PREFILL_HOST, PREFILL_INSTANCES)
        prefills, decodes = PREFILL_INSTANCES, DECODE_INSTANCES[:1]
    else:
        extra = write_inventory(decode_1_cpus=args.decode_1_cpus)
        prefills, decodes = PREFILL_INSTANCES[:1], DECODE_INSTANCES
    print(f"logs in {logs}", flush=True)
    prefill, decode = container_ip(PREFILL_HOST), container_ip(DECODE_HOST)
    health_timeout = router_health_timeout()
    probe = HealthProbe({**{i["name"]: f"http://{prefill}:{i['port']}/health" for i in prefills},
                         **{i["name"]: f"http://{decode}:{i['port']}/health" for i in decodes}},
                        args.probe_interval)
    load = FrontLoad(url, MODEL, secret("client_api_key"), rate=args.rate, timeout=120)
    chaos = Chaos(args, load, url, extra, logs)
    outcomes: list[Outcome] = []
    failure = ""
    load.start()

    def operation(name: str, kind: str, action, bound: float | None = 0, note: str = "") -> bool:
        outcome = Outcome(name, kind, time.perf_counter(), bound=bound, note=note)
        print(f"== {name} ({kind})", flush=True)
        try:
            action()
        except (RuntimeError, subprocess.SubprocessError) as exc:
            # A failed operation still gets its row: what the load and /health saw until then.
            outcome.end = time.perf_counter()
            outcome.note = f"failed: {str(exc)[-300:]}"
            judge(outcome, load.snapshot(), args.rate, load.max_concurrency)
            outcome.health = probe.summary(outcome.start, outcome.end, health_timeout)
            outcomes.append(outcome)
            raise
        outcome.end = time.perf_counter()
        outcome.recovered_at = wait_ok(url, args.recovery)
        time.sleep(SETTLE)
        judge(outcome, load.snapshot(), args.rate, load.max_concurrency)
        outcome.health = probe.summary(outcome.start, outcome.recovered_at or outcome.end, health_timeout)
        outcomes.append(outcome)
        print(table([outcome]).splitlines()[-1], flush=True)
        return outcome.recovered_at is not None

    try:
        if not operation(f"scale-out to 2 {args.pool} instances (setup)", "planned",
                         lambda: chaos.deploy("scale-out")):
            raise RuntimeError("the front did not come back after the scale-out")
        actions = {"nginx-reload": chaos.nginx_reload, "replica-kill": chaos.replica_kill,
                   "client-key": chaos.client_key, "instance-key": chaos.instance_key,
                   "decode-roll": lambda: chaos.roll("decode"), "prefill-roll": lambda: chaos.roll("prefill"),
                   "decode-kill": lambda: chaos.kill(DECODE_HOST, "decode-0", 8200),
                   "prefill-kill": lambda: chaos.kill(PREFILL_HOST, "prefill-0", 8100),
                   "kv-block": chaos.kv_block, "prefill-restart": chaos.prefill_restart}
        for name in chosen:
            bound = None if name in OUTAGES[args.pool] else 0
            if not operation(name, "fault" if name in FAULTS else "planned", actions[name], bound=bound):
                raise RuntimeError(f"{name}: the front did not answer ok within {args.recovery:.0f} s")
    except (RuntimeError, subprocess.SubprocessError) as exc:
        failure = str(exc)
        print(f"stopped: {failure}", file=sys.stderr, flush=True)
    finally:
        if not args.keep:
            try:
                operation(f"scale-in to 1 {args.pool} instance (teardown)", "planned",
                          lambda: chaos.deploy("scale-in", pool_of_two=False))
            except (RuntimeError, subprocess.SubprocessError) as exc:
                failure = failure or f"scale-in: {exc}"
        result = load.stop()
        probe.stop()
    # Judged again on the whole load: a request still in flight when its operation was first judged (a stalled
    # handoff runs until its timeout) counts now.
    for outcome in outcomes:
        judge(outcome, result, args.rate, load.max_concurrency)
    print()
    machine = machine_description(os.cpu_count(), Path("/proc/meminfo").read_text(),
                                  Path("/etc/os-release").read_text())
    print(f"# chaos on the sandbox, {datetime.date.today()}, rate {args.rate} req/s, {machine}")
    print(table(outcomes))
    print()
    print(health_table(outcomes, health_timeout))
    for o in outcomes:
        if o.errors:
            print(f"  {o.name}: {o.errors}")

    def during_one(start: float) -> bool:
        return any(o.start <= start <= (o.recovered_at or o.end) + SETTLE for o in outcomes)

    outside = [r for r in result.requests if r[2] and not during_one(r[0])]
    print(f"whole load: {result.completed} completed, {result.failed} failed, {len(outside)} of them outside the "
          f"operations")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(o) for o in outcomes], indent=2))
    return 1 if failure else 0


if __name__ == "__main__":
    sys.exit(main())
