# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Measure what the local sandbox of scripts/sandbox/up.sh costs, and print the figures.

    python3 benchmarks/sandbox_costs.py                      # idle, noop, deploy, latency (the sandbox must be up)
    python3 benchmarks/sandbox_costs.py --only idle,latency  # some of them
    python3 benchmarks/sandbox_costs.py --only up            # down.sh + up.sh: DESTROYS the sandbox first
    python3 benchmarks/sandbox_costs.py --json costs.json    # also write the figures as JSON

Figures (run on the Podman host, as the user that ran up.sh):

  idle     CPU of each idle vLLM instance in % of one core: utime+stime (/proc/PID/stat fields 14
           and 15, which cover all threads) of every process in the instance's unit cgroup, at the
           start and the end of one window (--idle-seconds) shared by both instances.
  noop     wall time of a second `bash scripts/sandbox/up.sh` (nothing to change), whether its
           PLAY RECAP shows changed=0 on every host, and its three most expensive tasks
           (ansible.posix.profile_tasks).
  deploy   the same for `ansible-playbook playbooks/deploy_pd.yml -i inventories/sandbox` alone, the
           re-run a user makes (issue #26's no-op figure).
           Both also print the CPU the run kept busy: the whole machine's (/proc/stat, every core: the
           controller, the hosts' module runs, the idle instances) and the run's own process tree
           (ansible-playbook, its workers and ssh clients: getrusage of the waited-for children). The
           machine's busy core-seconds over the number of cores is the least wall time any overlap of
           the run's plays could reach on this machine ("floor").
  latency  median/min/max of --requests short completions sent straight to the prefill instance
           ("direct", instance key) and through the front on the router ("front", client key:
           nginx, vllm-router, prefill, NIXL, decode), alternating, and their ratio front/direct.
  up       opt-in: down.sh, then up.sh timed from no hosts to the end of the run, and whether the
           proof printed its success marker.
  roll     opt-in (it changes the deployment, then changes it back): under a steady load (0.5
           requests/s of 8-token completions through the front, benchmarks/bench_load.py FrontLoad),
           deploy_pd.yml adds decode-1 (a decode pool of two, so that decode-0's roll is no outage;
           not timed), changes one setting of decode-0 (its shutdown_timeout + 5), puts it back, and
           removes decode-1 (not timed), each through a second inventory: the change's and the way
           back's wall time, whether each rolled decode-0, and the requests that failed during it
           (issue #26's one-setting figure).

It prints figures and the targets they are compared with in benchmarks/RESULTS.md; it asserts
nothing (exit status 1 only when a figure could not be measured at all). On a 2-core machine the
figures move with whatever else runs: measure on an otherwise quiet machine.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
PROMPT = "The capital of France is"
MAX_TOKENS = 8
PREFILL_HOST, DECODE_HOST, ROUTER_HOST = "inferops-prefill-1", "inferops-decode-1", "inferops-router-1"
# (container, instance, API port), as in inventories/sandbox/group_vars/{prefill,decode}.yml.
INSTANCES = ((PREFILL_HOST, "prefill-0", 8100), (DECODE_HOST, "decode-0", 8200))
FRONT_PORT = 8000
# What roles/vllm_verify/templates/summary.j2 prints when the proof succeeded ("NOT proven" otherwise).
PROOF_MARKER = "KV handoff PROVEN"
PROFILE_CALLBACK = "ansible.posix.profile_tasks"
MEASUREMENTS = ("idle", "noop", "deploy", "latency", "up", "roll")
DEFAULT_ONLY = "idle,noop,deploy,latency"
# Run order when several are selected: up first (it rebuilds the sandbox the others measure).
RUN_ORDER = ("up", "idle", "latency", "noop", "deploy", "roll")
FIGURES = {
    "idle": "idle CPU",
    "noop": "no-op re-run of up.sh",
    "deploy": "no-op deploy_pd.yml",
    "latency": "front/direct completion latency",
    "up": "up.sh, warm cache, no hosts to PROVEN",
    "roll": "one setting of decode-0 changed under load, deploy_pd.yml (change, back)",
}
TARGETS = {
    "idle": "<= 10 % of one core",
    "noop": "<= 60 s",
    "deploy": "<= 30 s (issue #26)",
    "latency": "<= 1.2x",
    "up": "none (reported)",
    "roll": "<= 180 s each, 0 failed (issue #26)",
}

# Inside a container: the processes of a unit's cgroup, then their /proc/PID/stat lines. cgroup v1
# keeps systemd's tree under /sys/fs/cgroup/systemd, v2 directly under /sys/fs/cgroup.
_CGROUP_STAT_SCRIPT = r"""
cg="$1"
for f in "/sys/fs/cgroup/systemd$cg/cgroup.procs" "/sys/fs/cgroup$cg/cgroup.procs"; do
  if [ -r "$f" ]; then
    echo "cgroup.procs $f"
    for pid in $(cat "$f"); do cat "/proc/$pid/stat" 2>/dev/null || true; done
    exit 0
  fi
done
echo "no cgroup.procs for $cg under /sys/fs/cgroup/systemd or /sys/fs/cgroup" >&2
exit 3
"""

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# profile_tasks' summary: "<name> ---...--- 16.25s" (name padded with '-' to the terminal width,
# the time right-aligned in 9 columns, so a long name or a long time can leave no dashes at all).
_PROFILE_LINE = re.compile(r"^(?P<name>\S.*?) (?:-+ | )(?P<seconds>\d+\.\d{2})s$")
# profile_tasks' timestamp lines end with "(<previous task>)   <elapsed since the start> ****".
_PROFILE_ELAPSED = re.compile(r"\((\d+):(\d{2}):(\d{2})\.(\d{3})\)\s+(\d+):(\d{2}):(\d{2})\.(\d{3})\s*\**\s*$")
_RECAP_HOST = re.compile(r"^(?P<host>\S+)\s*:\s*(?P<counts>(?:\w+=\d+\s*)+)$")


# ---------------------------------------------------------------------------------------------
# Pure helpers (no I/O): parsing and formatting.


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def parse_proc_stat(line: str) -> dict:
    """One /proc/PID/stat line -> pid, comm, utime and stime (clock ticks, all threads), starttime.

    The command name (field 2) is in parentheses and may itself hold spaces and parentheses, so the
    fields are counted from the last ')'.
    """
    head, sep, tail = line.strip().rpartition(")")
    if not sep or "(" not in head:
        raise ValueError(f"not a /proc/PID/stat line: {line!r}")
    pid, comm = head.split("(", 1)
    rest = tail.split()  # rest[0] is field 3 (state): field n is rest[n - 3]
    if len(rest) < 20:
        raise ValueError(f"/proc/PID/stat line too short: {line!r}")
    return {"pid": int(pid), "comm": comm, "utime": int(rest[11]), "stime": int(rest[12]),
            "starttime": int(rest[19])}


def parse_cgroup_sample(text: str) -> tuple[str, dict[tuple[int, int], dict]]:
    """Output of _CGROUP_STAT_SCRIPT -> (cgroup.procs path, {(pid, starttime): parsed stat})."""
    path, procs = "", {}
    for line in text.splitlines():
        if line.startswith("cgroup.procs "):
            path = line.split(" ", 1)[1].strip()
        elif line.strip():
            stat = parse_proc_stat(line)
            procs[(stat["pid"], stat["starttime"])] = stat
    return path, procs


def cpu_ticks_between(start: dict[tuple[int, int], dict], end: dict[tuple[int, int], dict]) -> tuple[int, int, int]:
    """CPU ticks spent between two samples -> (ticks, processes that appeared, processes that exited).

    Processes are keyed by (pid, starttime), so a reused pid is a new process; one that started in
    the window counts whole, one that exited in the window is lost (the figure is then a lower bound).
    """
    ticks = 0
    for key, stat in end.items():
        before = start.get(key)
        ticks += stat["utime"] + stat["stime"] - ((before["utime"] + before["stime"]) if before else 0)
    appeared = sum(1 for key in end if key not in start)
    exited = sum(1 for key in start if key not in end)
    return ticks, appeared, exited


def parse_machine_stat(text: str) -> tuple[int, int]:
    """/proc/stat -> (busy, all) clock ticks of all cores together since boot, from its "cpu " line: busy is
    user, nice, system, irq, softirq and steal (guest time is inside user); idle and iowait are not busy."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            values = [int(v) for v in fields[1:9]] + [0] * max(0, 8 - len(fields[1:9]))
            user, nice, system, idle, iowait, irq, softirq, steal = values[:8]
            busy = user + nice + system + irq + softirq + steal
            return busy, busy + idle + iowait
    raise ValueError("no 'cpu ' line in /proc/stat")


def cpu_floor(busy_core_seconds: float, cores: int) -> float:
    """The least wall time a run that kept the machine busy ``busy_core_seconds`` could take on ``cores`` cores,
    however its work were spread over them."""
    return busy_core_seconds / max(1, cores)


def cpu_percent(ticks: int, clk_tck: int, seconds: float) -> float:
    """Ticks over a window in % of one core."""
    return 100.0 * ticks / (clk_tck * seconds)


def parse_control_group(text: str) -> str:
    """`systemctl show -p ControlGroup UNIT` output (with or without --value) -> the cgroup path."""
    value = text.strip().splitlines()[-1].strip() if text.strip() else ""
    if value.startswith("ControlGroup="):
        value = value.split("=", 1)[1]
    return value


def parse_profile_tasks(text: str, limit: int = 3) -> list[tuple[str, float]]:
    """The most expensive tasks from profile_tasks' summary: [(task name, seconds)], longest first.

    Only the lines after the summary's '=====' rule are read (earlier task output could look alike);
    without the rule, the whole text.
    """
    lines = [strip_ansi(line).rstrip() for line in text.splitlines()]
    rules = [i for i, line in enumerate(lines) if len(line) >= 20 and set(line.strip()) == {"="}]
    body = lines[rules[-1] + 1:] if rules else lines
    tasks = []
    for line in body:
        match = _PROFILE_LINE.match(line)
        if match:
            tasks.append((match["name"].rstrip(" -"), float(match["seconds"])))
    tasks.sort(key=lambda item: item[1], reverse=True)
    return tasks[:limit]


def parse_profile_elapsed(text: str) -> float | None:
    """The playbook's own duration: the elapsed time on profile_tasks' last timestamp line."""
    last = None
    for line in strip_ansi(text).splitlines():
        match = _PROFILE_ELAPSED.search(line)
        if match:
            h, m, s, ms = (int(g) for g in match.groups()[4:])
            last = h * 3600 + m * 60 + s + ms / 1000
    return last


def parse_play_recap(text: str) -> dict[str, dict[str, int]]:
    """The last PLAY RECAP -> {host: {"ok": .., "changed": .., "failed": .., ...}}."""
    lines = [strip_ansi(line).rstrip() for line in text.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith("PLAY RECAP")]
    if not starts:
        return {}
    recap: dict[str, dict[str, int]] = {}
    for line in lines[starts[-1] + 1:]:
        match = _RECAP_HOST.match(line.strip())
        if not match:
            if recap:
                break
            continue
        recap[match["host"]] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", match["counts"])}
    return recap


def machine_description(cpu_count: int | None, meminfo: str, os_release: str) -> str:
    """E.g. '2 cores, 23 GiB RAM, Debian 12', from os.cpu_count(), /proc/meminfo, /etc/os-release."""
    parts = [f"{cpu_count or '?'} cores"]
    mem = re.search(r"^MemTotal:\s+(\d+)\s*kB", meminfo, re.MULTILINE)
    parts.append(f"{int(mem[1]) // 1048576} GiB RAM" if mem else "? GiB RAM")
    fields = {key: quoted or bare for key, quoted, bare in
              re.findall(r'^(\w+)=(?:"([^"]*)"|(.*))$', os_release, re.MULTILINE)}
    name = re.sub(r"\s+(GNU/)?Linux$", "", fields.get("NAME", "").strip()) or "unknown OS"
    parts.append(f"{name} {fields['VERSION_ID']}" if fields.get("VERSION_ID") else name)
    return ", ".join(parts)


def markdown_row(*cells: str) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def summarize(seconds: list[float]) -> dict:
    if not seconds:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(seconds), "min": min(seconds), "max": max(seconds)}


# ---------------------------------------------------------------------------------------------
# Sandbox access.


def secrets_dir() -> Path:
    """Where the sandbox inventory's password lookups keep the keys (scripts/sandbox/lib.sh)."""
    if os.environ.get("INFEROPS_SECRETS_DIR"):
        return Path(os.environ["INFEROPS_SECRETS_DIR"])
    cache = os.environ.get("INFEROPS_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "inferops-vllm")
    return Path(cache) / "sandbox-secrets"


def secret(name: str) -> str:
    words = (secrets_dir() / name).read_text(encoding="utf-8").split()
    if not words:
        raise RuntimeError(f"{secrets_dir() / name} is empty")
    return words[0]


def podman(*args: str, timeout: float = 60) -> str:
    run = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, check=False)
    if run.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args[:3])} ...: exit {run.returncode}: {run.stderr.strip()[-500:]}")
    return run.stdout


def container_ip(name: str) -> str:
    ip = podman("inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", name).strip()
    if not ip:
        raise RuntimeError(f"container {name} has no IP address")
    return ip


def require_sandbox() -> None:
    """The three hosts must be running (else the figure would measure up.sh building them)."""
    for name in (PREFILL_HOST, DECODE_HOST, ROUTER_HOST):
        try:
            running = podman("inspect", "-f", "{{.State.Running}}", name).strip()
        except RuntimeError as exc:
            raise RuntimeError(f"sandbox host {name} does not exist: run `bash scripts/sandbox/up.sh` first") from exc
        if running != "true":
            raise RuntimeError(f"sandbox host {name} is not running: run `bash scripts/sandbox/up.sh` first")


def _sample_cgroup(container: str, cgroup: str) -> tuple[float, float, str]:
    started = time.monotonic()
    out = podman("exec", container, "sh", "-c", _CGROUP_STAT_SCRIPT, "sh", cgroup)
    return started, time.monotonic(), out


def _sample_all(targets: list[tuple[str, str]]) -> list[tuple[float, str]]:
    """One podman exec per instance, all at once -> [(moment of the sample, output)] in order."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(targets)) as pool:
        results = list(pool.map(lambda t: _sample_cgroup(*t), targets))
    return [((started + ended) / 2, out) for started, ended, out in results]


# ---------------------------------------------------------------------------------------------
# The measurements. Each returns a list of figures: {"figure", "value", "target", "details"}.


def measure_idle(args) -> list[dict]:
    require_sandbox()
    clk_tck = os.sysconf("SC_CLK_TCK")  # USER_HZ: the kernel's, the same inside the containers
    targets = []
    for container, instance, _port in INSTANCES:
        unit = f"vllm@{instance}.service"
        cgroup = parse_control_group(podman("exec", container, "systemctl", "show", "-p", "ControlGroup", unit))
        if not cgroup:
            raise RuntimeError(f"{unit} on {container} has no control group (not running?)")
        targets.append((container, instance, cgroup))
    print(f"idle: sampling {len(targets)} instances over {args.idle_seconds:g} s ...", flush=True)
    sampled = [(container, cgroup) for container, _instance, cgroup in targets]
    first = _sample_all(sampled)
    time.sleep(max(0.0, args.idle_seconds - (time.monotonic() - min(moment for moment, _out in first))))
    second = _sample_all(sampled)

    figures = []
    for (container, instance, cgroup), (t0, out0), (t1, out1) in zip(targets, first, second, strict=True):
        path, start = parse_cgroup_sample(out0)
        end = parse_cgroup_sample(out1)[1]
        if not start or not end:
            raise RuntimeError(f"no process in the cgroup of vllm@{instance} on {container} ({path or cgroup})")
        seconds = t1 - t0
        ticks, appeared, exited = cpu_ticks_between(start, end)
        percent = cpu_percent(ticks, clk_tck, seconds)
        note = f", {appeared} started and {exited} exited in the window (lower bound)" if exited else (
            f", {appeared} started in the window" if appeared else "")
        print(f"  vllm@{instance} ({container}): {percent:.1f} % of one core over {seconds:.1f} s, "
              f"{ticks} ticks at {clk_tck}/s, {len(end)} processes{note}  [{path}]")
        figures.append({
            "figure": f"{FIGURES['idle']}, vllm@{instance}",
            "value": f"{percent:.1f} % of one core ({seconds:.0f} s window)",
            "target": TARGETS["idle"],
            "details": {"instance": instance, "container": container, "cpu_percent_of_one_core": round(percent, 2),
                        "window_seconds": round(seconds, 3), "ticks": ticks, "clk_tck": clk_tck,
                        "processes": len(end), "appeared": appeared, "exited": exited, "cgroup_procs": path},
        })
    return figures


def _post_completion(opener, url: str, key: str, timeout: float) -> tuple[float, str]:
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}).encode()
    request = urllib.request.Request(url, data=body, method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    started = time.perf_counter()
    with opener.open(request, timeout=timeout) as response:
        payload = json.loads(response.read())
    elapsed = time.perf_counter() - started
    return elapsed, payload["choices"][0]["text"]


def measure_latency(args) -> list[dict]:
    require_sandbox()
    paths = {
        "direct": (f"http://{container_ip(PREFILL_HOST)}:{INSTANCES[0][2]}/v1/completions", secret("instance_api_key")),
        "front": (f"http://{container_ip(ROUTER_HOST)}:{FRONT_PORT}/v1/completions", secret("client_api_key")),
    }
    # The containers' addresses are local: never through an http_proxy from the environment.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    times: dict[str, list[float]] = {name: [] for name in paths}
    failed = {name: 0 for name in paths}
    answers: dict[str, str] = {}
    print(f"latency: {args.warmup} warm-up + {args.requests} requests per path, alternating "
          f"({PROMPT!r}, max_tokens {MAX_TOKENS}, temperature 0) ...", flush=True)
    for i in range(args.warmup + args.requests):
        for name, (url, key) in paths.items():
            try:
                elapsed, text = _post_completion(opener, url, key, args.timeout)
            except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError, TypeError) as exc:
                if isinstance(exc, urllib.error.HTTPError):
                    detail = f"HTTP {exc.code}"
                else:
                    detail = f"{type(exc).__name__}: {exc}"
                print(f"  {name} request {i + 1}{' (warm-up)' if i < args.warmup else ''} failed: {detail}")
                if i >= args.warmup:
                    failed[name] += 1
                continue
            answers.setdefault(name, text)
            if i >= args.warmup:
                times[name].append(elapsed)
    stats = {name: summarize(times[name]) for name in paths}
    for name, (url, _key) in paths.items():
        s = stats[name]
        shown = (f"median {s['median']:.3f} s, min {s['min']:.3f} s, max {s['max']:.3f} s" if s["median"] is not None
                 else "no successful request")
        print(f"  {name:6} {url}: {shown}, {failed[name]} failed; answer {answers.get(name, '')!r}")
    if stats["direct"]["median"] is None or stats["front"]["median"] is None:
        raise RuntimeError("no successful request on one of the paths: no ratio")
    ratio = stats["front"]["median"] / stats["direct"]["median"]
    print(f"  front/direct (medians): {ratio:.2f}x")
    total_failed = failed["direct"] + failed["front"]
    return [{
        "figure": FIGURES["latency"],
        "value": (f"{ratio:.2f}x (median {stats['front']['median']:.2f} s vs {stats['direct']['median']:.2f} s, "
                  f"{args.requests} requests each, {total_failed} failed)"),
        "target": TARGETS["latency"],
        "details": {"ratio": round(ratio, 4), "requests": args.requests, "warmup": args.warmup,
                    "failed": failed, "seconds": {k: {m: (round(v, 4) if v is not None else None) for m, v in s.items()}
                                                  for k, s in stats.items()},
                    "prompt": PROMPT, "max_tokens": MAX_TOKENS, "answers": answers},
    }]


def _run_logged(argv: list[str], log: Path, env: dict) -> tuple[float, int, str]:
    """Run a command with its output to a log file -> (wall seconds, exit status, output)."""
    with log.open("w", encoding="utf-8") as out:
        started = time.monotonic()
        run = subprocess.run(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
        elapsed = time.monotonic() - started
    return elapsed, run.returncode, log.read_text(encoding="utf-8", errors="replace")


def _up_env() -> dict:
    """up.sh's environment with profile_tasks added to the enabled callbacks (ansible-core 2.19's
    ANSIBLE_CALLBACKS_ENABLED; ansible.cfg enables none) and no colours in the log."""
    env = dict(os.environ)
    enabled = [c for c in env.get("ANSIBLE_CALLBACKS_ENABLED", "").split(",") if c.strip()]
    if PROFILE_CALLBACK not in enabled:
        enabled.append(PROFILE_CALLBACK)
    env["ANSIBLE_CALLBACKS_ENABLED"] = ",".join(enabled)
    env["ANSIBLE_NOCOLOR"] = "1"
    env.pop("ANSIBLE_FORCE_COLOR", None)
    return env


def _describe_run(output: str) -> tuple[dict, float | None, list[tuple[str, float]]]:
    recap = parse_play_recap(output)
    playbook_seconds = parse_profile_elapsed(output)
    top = parse_profile_tasks(output, 3)
    if recap:
        print("  PLAY RECAP: " + "; ".join(
            f"{host} " + " ".join(f"{k}={c.get(k, '?')}" for k in ("changed", "failed", "unreachable"))
            for host, c in recap.items()))
    else:
        print("  no PLAY RECAP in the output")
    if playbook_seconds is not None:
        print(f"  ansible-playbook itself (profile_tasks): {playbook_seconds:.1f} s")
    for name, seconds in top:
        print(f"  {seconds:8.2f} s  {name}")
    if not top:
        print(f"  no {PROFILE_CALLBACK} summary in the output")
    return recap, playbook_seconds, top


def _timed_noop(figure: str, command: list[str], log_name: str, said: str) -> list[dict]:
    """Run ``command`` on the up sandbox with nothing to change, and its figure: wall time, changed=0 on every host
    or not, its most expensive tasks."""
    require_sandbox()
    log = Path(tempfile.mkdtemp(prefix="inferops-sandbox-costs-")) / log_name
    print(f"{figure}: {said}, output in {log} ...", flush=True)
    clk_tck, cores = os.sysconf("SC_CLK_TCK"), os.cpu_count() or 1
    machine_before, children_before = parse_machine_stat(_read("/proc/stat")), os.times()
    seconds, rc, output = _run_logged(command, log, _up_env())
    machine_after, children_after = parse_machine_stat(_read("/proc/stat")), os.times()
    busy = (machine_after[0] - machine_before[0]) / clk_tck
    run_cpu = (children_after.children_user + children_after.children_system
               - children_before.children_user - children_before.children_system)
    print(f"  wall {seconds:.1f} s, exit status {rc}")
    print(f"  CPU: the machine busy {busy:.1f} core-s of {cores * seconds:.1f} ({cores} cores x the wall time), the "
          f"run's own process tree (controller, workers, ssh) {run_cpu:.1f} s; floor {cpu_floor(busy, cores):.1f} s "
          f"(no overlap of the plays ends it sooner on {cores} cores)")
    recap, playbook_seconds, top = _describe_run(output)
    changed_hosts = [host for host, c in recap.items() if c.get("changed") != 0]
    all_unchanged = bool(recap) and not changed_hosts
    print(f"  changed=0 on every host: {'yes' if all_unchanged else 'no'}"
          + (f" (changed on {', '.join(changed_hosts)})" if changed_hosts else ""))
    if all_unchanged:
        state = "changed=0 on all hosts"
    else:
        state = f"CHANGED on {', '.join(changed_hosts)}" if recap else "no PLAY RECAP"
    return [{
        "figure": FIGURES[figure],
        "value": f"{seconds:.1f} s, {state}" + (f", exit {rc}" if rc else ""),
        "target": TARGETS[figure],
        "details": {"wall_seconds": round(seconds, 2), "exit_status": rc, "playbook_seconds": playbook_seconds,
                    "machine_busy_core_seconds": round(busy, 1), "run_process_tree_cpu_seconds": round(run_cpu, 1),
                    "cpu_floor_seconds": round(cpu_floor(busy, cores), 1), "cores": cores,
                    "changed_zero_on_all_hosts": all_unchanged, "recap": recap,
                    "top_tasks": [{"task": n, "seconds": s} for n, s in top], "log": str(log)},
    }]


def measure_noop(args) -> list[dict]:
    return _timed_noop("noop", ["bash", "scripts/sandbox/up.sh"], "noop-up.log",
                       "bash scripts/sandbox/up.sh (a re-run)")


def measure_deploy(args) -> list[dict]:
    """The main job alone, as a user re-runs it: ansible-playbook playbooks/deploy_pd.yml -i inventories/sandbox
    with nothing to change (up.sh also checks the images, the wheelhouse and the hosts first)."""
    command = "source scripts/sandbox/env.sh && exec ansible-playbook playbooks/deploy_pd.yml -i inventories/sandbox"
    return _timed_noop("deploy", ["bash", "-c", command], "noop-deploy.log",
                       "ansible-playbook playbooks/deploy_pd.yml -i inventories/sandbox")


def measure_up(args) -> list[dict]:
    directory = Path(tempfile.mkdtemp(prefix="inferops-sandbox-costs-"))
    env = _up_env()
    print(f"up: bash scripts/sandbox/down.sh (removes the sandbox hosts), output in {directory} ...", flush=True)
    down_seconds, down_rc, _output = _run_logged(["bash", "scripts/sandbox/down.sh"], directory / "down.log", env)
    if down_rc != 0:
        raise RuntimeError(f"down.sh failed (exit {down_rc}), see {directory / 'down.log'}")
    print(f"  down.sh: {down_seconds:.1f} s; now bash scripts/sandbox/up.sh ...", flush=True)
    seconds, rc, output = _run_logged(["bash", "scripts/sandbox/up.sh"], directory / "up.log", env)
    proven = PROOF_MARKER in strip_ansi(output)
    print(f"  wall {seconds:.1f} s (no hosts to the end of the run), exit status {rc}, "
          f"{PROOF_MARKER!r} in the output: {'yes' if proven else 'no'}")
    recap, playbook_seconds, top = _describe_run(output)
    return [{
        "figure": FIGURES["up"],
        "value": f"{seconds:.1f} s, {'PROVEN' if proven else 'NOT proven'}" + (f", exit {rc}" if rc else ""),
        "target": TARGETS["up"],
        "details": {"wall_seconds": round(seconds, 2), "exit_status": rc, "proven": proven,
                    "marker": PROOF_MARKER, "playbook_seconds": playbook_seconds, "recap": recap,
                    "top_tasks": [{"task": n, "seconds": s} for n, s in top], "log": str(directory / "up.log")},
    }]


def measure_roll(args) -> list[dict]:
    # Only this figure needs the load generator and the decode pool of two (rolling_restart.py imports this file).
    from bench_load import FrontLoad  # pylint: disable=import-outside-toplevel
    from rolling_restart import write_inventory  # pylint: disable=import-outside-toplevel
    require_sandbox()
    toml = podman("exec", DECODE_HOST, "cat", "/etc/vllm/decode-0.toml")
    found = re.search(r"^shutdown_timeout = (\d+)$", toml, re.MULTILINE)
    if not found:
        raise RuntimeError("no shutdown_timeout in decode-0's config.toml")
    changed = int(found.group(1)) + 5
    directory = Path(tempfile.mkdtemp(prefix="inferops-sandbox-costs-"))
    inventories = {"pool": write_inventory(),
                   "change": write_inventory(decode_0_overrides={"shutdown_timeout": changed})}
    command = "source scripts/sandbox/env.sh && exec ansible-playbook playbooks/deploy_pd.yml -i inventories/sandbox"
    load = FrontLoad(f"http://{container_ip(ROUTER_HOST)}:{FRONT_PORT}", MODEL, secret("client_api_key"), rate=0.5,
                     timeout=args.timeout)
    print(f"roll: decode-1 added (not timed), decode-0's shutdown_timeout -> {changed} and back (timed), decode-1 "
          f"removed (not timed), under 0.5 requests/s, output in {directory}", flush=True)
    # decode-1 (on the decode host's core too) keeps the decode pool serving while decode-0 rolls, as a site's pool.
    steps = (("scale-out", "pool", False), ("change", "change", True), ("back", "pool", True), ("scale-in", "", False))
    runs = []
    load.start()
    try:
        for name, inventory, timed in steps:
            extra = f" -i {inventories[inventory]}" if inventory else ""
            start = time.perf_counter()
            seconds, rc, output = _run_logged(["bash", "-c", command + extra], directory / f"{name}.log", _up_env())
            rolled = "decode-0 rolled" in strip_ansi(output)
            print(f"  {name}: wall {seconds:.1f} s, exit status {rc}, decode-0 rolled: {rolled}", flush=True)
            if timed:
                runs.append((name, start, time.perf_counter(), seconds, rc, rolled))
            if rc != 0:
                raise RuntimeError(f"deploy_pd.yml ({name}) failed, exit {rc}: see {directory / name}.log")
    finally:
        result = load.stop()
    figures = []
    for name, start, end, seconds, rc, rolled in runs:
        inside = result.between(start, end)
        failed = sum(1 for r in inside if r[2])
        figures.append({
            "figure": f"{FIGURES['roll']}: {name}",
            "value": f"{seconds:.1f} s, {'rolled' if rolled else 'NOT rolled'}, {failed} of {len(inside)} requests "
                     "failed" + (f", exit {rc}" if rc else ""),
            "target": TARGETS["roll"],
            "details": {"wall_seconds": round(seconds, 2), "exit_status": rc, "rolled": rolled, "failed": failed,
                        "sent": len(inside), "log": str(directory / f"{name}.log")},
        })
    return figures


MEASURE = {"idle": measure_idle, "noop": measure_noop, "deploy": measure_deploy, "latency": measure_latency,
           "up": measure_up, "roll": measure_roll}


# ---------------------------------------------------------------------------------------------


def _selection(text: str) -> list[str]:
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [part for part in chosen if part not in MEASUREMENTS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"choose among {','.join(MEASUREMENTS)} (got {text!r})")
    return chosen


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return value


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="`up` removes the sandbox hosts (down.sh) before rebuilding them, and `roll` changes the deployment\n"
               "and back, so they run only when named in --only. Targets: "
               + "; ".join(f"{k} {v}" for k, v in TARGETS.items()) + ".",
    )
    parser.add_argument("--only", type=_selection, default=_selection(DEFAULT_ONLY), metavar="LIST",
                        help=f"comma-separated measurements among {','.join(MEASUREMENTS)} (default: {DEFAULT_ONLY})")
    parser.add_argument("--idle-seconds", type=float, default=30.0, metavar="S",
                        help="length of the idle CPU window (default: 30)")
    parser.add_argument("--requests", type=_positive_int, default=10, metavar="N",
                        help="measured completions per latency path (default: 10)")
    parser.add_argument("--warmup", type=_non_negative_int, default=1, metavar="N",
                        help="unmeasured completions per latency path first (default: 1)")
    parser.add_argument("--timeout", type=float, default=180.0, metavar="S",
                        help="seconds per completion request (default: 180)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the figures to FILE as JSON")
    args = parser.parse_args(argv)
    if args.idle_seconds <= 0:
        parser.error("--idle-seconds must be positive")

    today = datetime.date.today().isoformat()
    machine = machine_description(os.cpu_count(), _read("/proc/meminfo"), _read("/etc/os-release"))
    figures, errors = [], {}
    for name in RUN_ORDER:
        if name not in args.only:
            continue
        try:
            figures += MEASURE[name](args)
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            errors[name] = str(exc)
            print(f"{name}: not measured: {exc}", file=sys.stderr)

    print()
    print(markdown_row("date", "machine", "figure", "value", "target"))
    print(markdown_row(*["---"] * 5))
    for figure in figures:
        print(markdown_row(today, machine, figure["figure"], figure["value"], figure["target"]))
    for name, error in errors.items():
        print(markdown_row(today, machine, FIGURES[name], f"not measured: {error}", TARGETS[name]))

    if args.json:
        args.json.write_text(json.dumps({"date": today, "machine": machine, "figures": figures, "errors": errors},
                                        indent=2) + "\n", encoding="utf-8")
        print(f"\nfigures written to {args.json}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
