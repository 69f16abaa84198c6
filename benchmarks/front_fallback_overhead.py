# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What configuring fallback endpoints costs a request the front serves locally (issue #13's target:
added latency of the local path with the fallback configured <= 5 % of a direct front request).

    python3 benchmarks/front_fallback_overhead.py                          # 40 rounds x 500 requests, ~2-4 min
    python3 benchmarks/front_fallback_overhead.py --rounds 20 --requests 200 --json overhead.json
    python3 benchmarks/front_fallback_overhead.py --keep                   # leave the container running

A real vLLM completion is far too noisy for a microsecond effect, so this measures the front itself in
front of a fake local upstream, as the #13 research did (docs/front-fallback.md, "The measurements"):

  1. renders the vllm_router front twice with the role (tests/gateway/render.yml on tests/preflight/good,
     ansible-playbook, no host contacted): "fallbacks" with tests/gateway/vars.json (two endpoints), and
     "none" with the same variables minus every vllm_router_front_fallback* one. Both get a rate limit and
     burst of 1000000 per second, or the front's own 429 (which the fallback config would send to the
     cloud) would be measured instead of the local path;
  2. starts a Debian 12 container (--name, default inferops-fallback-bench, --cpus 1, like
     tests/gateway/run.sh), installs nginx-light, libnginx-mod-http-js and dnsmasq-base there, installs the
     "fallbacks" site with tests/gateway/setup_in_container.sh (fake router replicas fake_local.py on the
     rendered upstream ports, fake clouds, nginx), then runs this file inside the container: a Python client
     on loopback with one persistent HTTP/1.1 connection per cell sends POST /v1/chat/completions with the
     rendered client key, --requests per cell after --warmup unmeasured ones, for both configurations and
     two bodies (a small chat request and one of --large-kib KiB). Each round measures both configurations,
     in alternating order; a switch installs the other rendered site, proxy settings and key map, links or
     unlinks njs in modules-enabled (production installs njs only with fallbacks), runs `nginx -s reload`
     and waits until a new connection gets the new configuration's answer (X-Inferops-Served-By: local
     with fallbacks, no such header without);
  3. removes the container (unless --keep).

Figures per configuration and body: median and p90 of the request time seen by the client (ms), over all
rounds but the first (--skip-rounds); the difference of the medians with fallbacks vs without, in µs and
in % of the "none" median; and the median over rounds of the per-round difference of the medians (paired,
less sensitive to drift of the machine), with its interquartile range across rounds. Requests that got
anything but 200 (or, with fallbacks, an answer not served locally) are counted and left out.

Needs podman, the local base image (--image, default ${INFEROPS_BASE_IMAGE} or
localhost/inferops-vllm-base:debian12-systemd-v2) and the Debian mirrors from inside the container (the
first time). The tools venv of scripts/sandbox/tools.sh provides ansible-playbook. It asserts nothing: exit
status 1 only when a step could not run. On a 2-core machine the figures move with whatever else runs;
the container has one core for the client, nginx and the fake upstream together.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import http.client
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GATEWAY = REPO / "tests" / "gateway"
INVENTORY = REPO / "tests" / "preflight" / "good"
DEFAULT_IMAGE = os.environ.get("INFEROPS_BASE_IMAGE") or "localhost/inferops-vllm-base:debian12-systemd-v2"
DEFAULT_NAME = "inferops-fallback-bench"
PACKAGES = "nginx-light libnginx-mod-http-js python3 openssl curl dnsmasq-base"
CONFIGS = ("none", "fallbacks")
BODIES = ("small", "large")
MODEL = "smollm2-135m-instruct"  # tests/preflight/good's served model name
# Limits high enough never to be reached: over them the front answers 429 (or, with fallbacks, the cloud).
NO_LIMITS = {"vllm_router_front_rate_limit": 1000000, "vllm_router_front_rate_burst": 1000000,
             # tests/gateway/vars.json turns it on for the gateway tests; it is measured on its own
             # (benchmarks/front_cache_salt_overhead.py).
             "vllm_router_front_cache_salt_per_key": False}
# Inside the container.
GW = "/gw"
RENDERED = {"fallbacks": f"{GW}/rendered", "none": f"{GW}/rendered_none"}
FRONT_PORT = 8000
NJS_LINK = "/etc/nginx/modules-enabled/50-mod-http-js.conf"
NJS_CONF = "/usr/share/nginx/modules-available/mod-http-js.conf"


class StepError(RuntimeError):
    """A step of the benchmark could not run."""


# ---------------------------------------------------------------------------------------------
# Inside the container (this file, run with --inside).


def _body(kind: str, large_kib: int) -> bytes:
    def encode(content: str) -> bytes:
        return json.dumps({"model": MODEL, "stream": False,
                           "messages": [{"role": "user", "content": content}]}).encode()

    if kind == "small":
        return encode("hi")
    size = large_kib * 1024
    return encode("x" * max(0, size - len(encode(""))))


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode:
        raise StepError(f"{' '.join(argv)}: exit {done.returncode}: {(done.stdout + done.stderr).strip()[-500:]}")


def _served_locally_header(key: str, body: bytes) -> str | None:
    conn = http.client.HTTPConnection("127.0.0.1", FRONT_PORT, timeout=10)
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers=_headers(key))
        resp = conn.getresponse()
        resp.read()
        if resp.status != 200:
            raise StepError(f"front answered {resp.status}")
        return resp.getheader("X-Inferops-Served-By")
    finally:
        conn.close()


def _headers(key: str) -> dict:
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


def switch(config: str, key: str) -> None:
    """Installs the rendered site of `config` where the role puts it, reloads nginx, waits for it."""
    r = RENDERED[config]
    _run("install", "-m", "0644", f"{r}/inferops-vllm.conf", "/etc/nginx/sites-available/inferops-vllm.conf")
    _run("install", "-m", "0600", f"{r}/inferops-vllm-keys.map", f"{r}/inferops-vllm-proxy.conf", "/etc/nginx/")
    _run("install", "-m", "0644", f"{r}/inferops-vllm-fallback-proxy.conf", "/etc/nginx/")
    if config == "fallbacks":
        if not os.path.lexists(NJS_LINK):
            os.symlink(NJS_CONF, NJS_LINK)
    elif os.path.lexists(NJS_LINK):
        os.unlink(NJS_LINK)
    _run("nginx", "-t", "-q")
    _run("nginx", "-s", "reload")
    want = "local" if config == "fallbacks" else None
    probe = _body("small", 0)
    deadline = time.monotonic() + 20
    while True:
        got = _served_locally_header(key, probe)
        if got == want:
            return
        if time.monotonic() > deadline:
            raise StepError(f"after the reload to {config!r}, X-Inferops-Served-By is still {got!r}")
        time.sleep(0.1)


def measure_cell(config: str, key: str, body: bytes, warmup: int, requests: int) -> dict:
    """One persistent connection: warmup unmeasured requests, then `requests` timed ones (µs)."""
    conn = http.client.HTTPConnection("127.0.0.1", FRONT_PORT, timeout=30)
    headers = _headers(key)
    times, bad = [], {}
    clock = time.perf_counter_ns
    try:
        for i in range(warmup + requests):
            start = clock()
            conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
            resp = conn.getresponse()
            resp.read()
            elapsed = clock() - start
            served = resp.getheader("X-Inferops-Served-By")
            ok = resp.status == 200 and (served == "local" if config == "fallbacks" else served is None)
            if i < warmup:
                continue
            if ok:
                times.append(round(elapsed / 1000, 1))
            else:
                what = f"{resp.status} served-by {served}"
                bad[what] = bad.get(what, 0) + 1
    finally:
        conn.close()
    return {"us": times, "bad": bad}


def inside(args: argparse.Namespace) -> int:
    key = sys.stdin.read().strip()
    bodies = {kind: _body(kind, args.large_kib) for kind in BODIES}
    rounds = []
    current = "fallbacks"  # what setup_in_container.sh started with
    switch(current, key)  # the njs link as production has it, and a check that the key works
    for number in range(args.rounds):
        order = CONFIGS if number % 2 == 0 else CONFIGS[::-1]
        cells = {}
        for config in order:
            if config != current:
                switch(config, key)
                current = config
            for kind in (BODIES if number % 2 == 0 else BODIES[::-1]):
                cells[f"{config}/{kind}"] = measure_cell(config, key, bodies[kind], args.warmup, args.requests)
        rounds.append(cells)
        medians = "  ".join(f"{name} {statistics.median(c['us']) / 1000:.3f}" if c["us"] else f"{name} -"
                            for name, c in sorted(cells.items()))
        print(f"round {number + 1}/{args.rounds}: median ms  {medians}", file=sys.stderr, flush=True)
    switch("fallbacks", key)
    print(json.dumps({"rounds": rounds, "body_bytes": {k: len(v) for k, v in bodies.items()}}))
    return 0


# ---------------------------------------------------------------------------------------------
# On the host.


def _tools_path() -> None:
    """The tools venv first on PATH, as tests/gateway/run.sh does (ansible-playbook, its Python)."""
    if shutil.which("ansible-playbook"):
        return
    done = subprocess.run(["bash", str(REPO / "scripts" / "sandbox" / "tools.sh")], capture_output=True,
                          text=True, check=False)
    if done.returncode or not done.stdout.strip():
        raise StepError(f"scripts/sandbox/tools.sh failed: {done.stderr.strip()[-500:]}")
    os.environ["PATH"] = done.stdout.strip().splitlines()[-1] + os.pathsep + os.environ["PATH"]


def render(out: Path, extra: dict) -> Path:
    """The front as the role renders it for tests/preflight/good's router, into out/router-1."""
    python = shutil.which("python3") or sys.executable
    done = subprocess.run(
        ["ansible-playbook", "-i", str(INVENTORY), str(GATEWAY / "render.yml"),
         "-e", json.dumps({"out_dir": str(out), "ansible_python_interpreter": python, **extra})],
        cwd=REPO, capture_output=True, text=True, check=False, timeout=600)
    if done.returncode:
        raise StepError(f"render.yml ({out.name}): exit {done.returncode}: {(done.stdout + done.stderr)[-1500:]}")
    return out / "router-1"


def client_key(keys_map: str) -> str:
    """The first client key of a rendered inferops-vllm-keys.map ("~^Bearer KEY$" "k-...";)."""
    match = re.search(r'^"~\^Bearer (.+)\$"\s', keys_map, re.MULTILINE)
    if not match:
        raise StepError("no client key in the rendered key map")
    return re.sub(r"\[(.)\]", r"\1", match[1])  # preflight puts . and + in brackets


def role_validate_command() -> str:
    """The role's validate of "Configure the authenticating front", as tests/gateway/run.sh extracts it."""
    script = ("import sys, yaml\n"
              "(t,) = [t for t in yaml.safe_load(open(sys.argv[1])) "
              "if t.get('name') == 'Configure the authenticating front']\n"
              "print(t['ansible.builtin.template']['validate']"
              ".replace('%s', '/etc/nginx/sites-available/inferops-vllm.conf'))\n")
    python = shutil.which("python3") or sys.executable
    done = subprocess.run([python, "-c", script, str(REPO / "roles" / "vllm_router" / "tasks" / "configure.yml")],
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise StepError(f"reading the role's validate: {done.stderr.strip()[-500:]}")
    return done.stdout


def podman(*argv: str, stdin: str | None = None, check: bool = True, stream_stderr: bool = False) -> str:
    done = subprocess.run(["podman", *argv], input=stdin, stdout=subprocess.PIPE,
                          stderr=None if stream_stderr else subprocess.PIPE, text=True, check=False)
    if check and done.returncode:
        raise StepError(f"podman {' '.join(argv[:3])}...: exit {done.returncode}: {(done.stderr or '').strip()[-800:]}")
    return done.stdout


def prepare_container(name: str, image: str, files: dict[str, Path]) -> str:
    """Starts (or reuses) the container, installs the packages, copies the files, runs the gateway setup."""
    if subprocess.run(["podman", "container", "exists", name], check=False).returncode != 0:
        podman("run", "-d", "--name", name, "--cpus", "1", image, "sleep", "infinity")
    have = subprocess.run(["podman", "exec", name, "test", "-e", "/usr/lib/nginx/modules/ngx_http_js_module.so"],
                          check=False).returncode == 0
    if not have:
        print(f"== apt-get install {PACKAGES} in {name}", file=sys.stderr, flush=True)
        podman("exec", name, "bash", "-c", "apt-get update -qq && DEBIAN_FRONTEND=noninteractive "
               f"apt-get install -y -qq {PACKAGES} >/dev/null")
    podman("exec", name, "bash", "-c", f"rm -rf {GW} && mkdir -p {GW}")
    for dest, src in files.items():
        podman("cp", str(src), f"{name}:{GW}/{dest}")
    print("== setup_in_container.sh (fallbacks site, fake upstreams, nginx)", file=sys.stderr, flush=True)
    podman("exec", name, "bash", f"{GW}/setup_in_container.sh")
    return podman("exec", name, "bash", "-c",
                  "nginx -v 2>&1 | sed 's/^nginx version: //'; dpkg-query -W -f='njs ${Version}' "
                  "libnginx-mod-http-js").replace("\n", ", ").strip(", ")


def _percentile(sorted_values: list[float], fraction: float) -> float:
    """Nearest-rank percentile of a sorted list."""
    index = max(0, min(len(sorted_values) - 1, int(round(fraction * len(sorted_values) + 0.5)) - 1))
    return sorted_values[index]


def summarize(rounds: list[dict], skip: int) -> dict:
    counted = rounds[skip:] or rounds
    cells, deltas = {}, {}
    for config in CONFIGS:
        for kind in BODIES:
            name = f"{config}/{kind}"
            values = sorted(v for r in counted for v in r[name]["us"])
            bad: dict[str, int] = {}
            for r in counted:
                for what, n in r[name]["bad"].items():
                    bad[what] = bad.get(what, 0) + n
            cells[name] = {"requests": len(values), "left_out": bad,
                           "median_ms": round(statistics.median(values) / 1000, 4) if values else None,
                           "p90_ms": round(_percentile(values, 0.9) / 1000, 4) if values else None}
    for kind in BODIES:
        base, with_fb = cells[f"none/{kind}"], cells[f"fallbacks/{kind}"]
        if base["median_ms"] is None or with_fb["median_ms"] is None:
            deltas[kind] = None
            continue
        diff_us = (with_fb["median_ms"] - base["median_ms"]) * 1000
        paired = [statistics.median(r[f"fallbacks/{kind}"]["us"]) - statistics.median(r[f"none/{kind}"]["us"])
                  for r in counted if r[f"fallbacks/{kind}"]["us"] and r[f"none/{kind}"]["us"]]
        quartiles = statistics.quantiles(paired, n=4) if len(paired) >= 2 else [paired[0], paired[0], paired[0]]
        deltas[kind] = {
            "median_delta_us": round(diff_us, 1),
            "median_delta_pct": round(100 * diff_us / (base["median_ms"] * 1000), 2),
            "p90_delta_us": round((with_fb["p90_ms"] - base["p90_ms"]) * 1000, 1),
            "paired_delta_us": round(statistics.median(paired), 1),
            "paired_delta_pct": round(100 * statistics.median(paired) / (base["median_ms"] * 1000), 2),
            "paired_delta_iqr_us": [round(quartiles[0], 1), round(quartiles[2], 1)],
        }
    return {"cells": cells, "deltas": deltas}


def machine_description() -> str:
    """E.g. '2 cores, 23 GiB RAM, Debian 12' (as benchmarks/sandbox_costs.py prints it)."""
    def read(path: str) -> str:
        try:
            return Path(path).read_text(encoding="utf-8")
        except OSError:
            return ""

    parts = [f"{os.cpu_count() or '?'} cores"]
    mem = re.search(r"^MemTotal:\s+(\d+)\s*kB", read("/proc/meminfo"), re.MULTILINE)
    parts.append(f"{int(mem[1]) // 1048576} GiB RAM" if mem else "? GiB RAM")
    fields = {k: quoted or bare for k, quoted, bare in
              re.findall(r'^(\w+)=(?:"([^"]*)"|(.*))$', read("/etc/os-release"), re.MULTILINE)}
    name = re.sub(r"\s+(GNU/)?Linux$", "", fields.get("NAME", "").strip()) or "unknown OS"
    parts.append(f"{name} {fields['VERSION_ID']}" if fields.get("VERSION_ID") else name)
    return ", ".join(parts)


def report(summary: dict, settings: dict) -> None:
    cells, deltas = summary["cells"], summary["deltas"]
    print()
    print("| front | body | requests | median | p90 | vs none (medians) | paired per round (IQR) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for kind in BODIES:
        size = settings["body_bytes"][kind]
        label = "small" if kind == "small" else f"{size // 1024} KiB"
        for config in CONFIGS:
            c = cells[f"{config}/{kind}"]
            med = f"{c['median_ms']:.3f} ms" if c["median_ms"] is not None else "-"
            p90 = f"{c['p90_ms']:.3f} ms" if c["p90_ms"] is not None else "-"
            d = deltas[kind] if config == "fallbacks" else None
            vs = f"{d['median_delta_pct']:+.1f} % ({d['median_delta_us']:+.0f} µs)" if d else "—"
            paired = (f"{d['paired_delta_pct']:+.1f} % ({d['paired_delta_us']:+.0f} µs; "
                      f"{d['paired_delta_iqr_us'][0]:+.0f}..{d['paired_delta_iqr_us'][1]:+.0f})") if d else "—"
            name = "no fallbacks (today's front)" if config == "none" else "fallbacks configured, served locally"
            print(f"| {name} | {label} | {c['requests']} | {med} | {p90} | {vs} | {paired} |")
    for name, c in cells.items():
        if c["left_out"]:
            print(f"{name}: left out (not 200 / not served locally): {c['left_out']}")
    print(f"\n{settings['rounds']} rounds x {settings['requests']} requests per cell after {settings['warmup']} "
          f"unmeasured, first {settings['skip_rounds']} round(s) not counted; {settings['versions']}; "
          f"container --cpus 1, client on loopback (one keep-alive connection per cell)")
    print(f"machine: {settings['machine']}; {settings['date']}; target: added latency <= 5 % (issue #13)")


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must not be negative")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=_positive_int, default=40, metavar="N",
                        help="rounds, each measuring both configurations and both bodies (default: 40)")
    parser.add_argument("--requests", type=_positive_int, default=500, metavar="N",
                        help="measured requests per configuration, body and round (default: 500)")
    parser.add_argument("--warmup", type=_non_negative_int, default=50, metavar="N",
                        help="unmeasured requests before each cell's measured ones (default: 50)")
    parser.add_argument("--skip-rounds", type=_non_negative_int, default=1, metavar="N",
                        help="first rounds not counted (default: 1)")
    parser.add_argument("--large-kib", type=_positive_int, default=64, metavar="K",
                        help="size of the large request body in KiB (default: 64)")
    parser.add_argument("--name", default=DEFAULT_NAME, help=f"container name (default: {DEFAULT_NAME})")
    parser.add_argument("--image", default=DEFAULT_IMAGE, help=f"base image (default: {DEFAULT_IMAGE})")
    parser.add_argument("--keep", action="store_true", help="leave the container running at the end")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the figures to FILE as JSON")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside:
        return inside(args)
    if args.skip_rounds >= args.rounds:
        parser.error("--skip-rounds must be less than --rounds")

    started = time.monotonic()
    settings = {"date": datetime.date.today().isoformat(), "machine": machine_description(), "rounds": args.rounds,
                "requests": args.requests, "warmup": args.warmup, "skip_rounds": args.skip_rounds,
                "image": args.image}
    container_started = False
    try:
        with tempfile.TemporaryDirectory(prefix="front-fallback-bench-") as tmp:
            work = Path(tmp)
            _tools_path()
            os.environ.setdefault("ANSIBLE_COLLECTIONS_PATH", str(REPO / ".ansible" / "collections"))
            fallbacks_vars = json.loads((GATEWAY / "vars.json").read_text(encoding="utf-8"))
            none_vars = {k: v for k, v in fallbacks_vars.items() if not k.startswith("vllm_router_front_fallback")}
            print("== render the front with the role, with and without fallbacks", file=sys.stderr, flush=True)
            with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
                jobs = {"fallbacks": pool.submit(render, work / "fallbacks", {**fallbacks_vars, **NO_LIMITS}),
                        "none": pool.submit(render, work / "none", {**none_vars, **NO_LIMITS})}
                out = {name: job.result() for name, job in jobs.items()}
            key = client_key((out["fallbacks"] / "inferops-vllm-keys.map").read_text(encoding="utf-8"))
            (work / "cloud_keys").write_text(
                " ".join(fb["api_key"] for fb in fallbacks_vars["vllm_router_front_fallbacks"]) + "\n",
                encoding="utf-8")
            (work / "validate.sh").write_text(role_validate_command(), encoding="utf-8")
            files = {"rendered": out["fallbacks"], "rendered_none": out["none"], "cloud_keys": work / "cloud_keys",
                     "validate.sh": work / "validate.sh", "front_fallback_overhead.py": Path(__file__).resolve()}
            for name in ("setup_in_container.sh", "fake_local.py", "fake_cloud.py"):
                files[name] = GATEWAY / name
            print(f"== container {args.name} from {args.image}", file=sys.stderr, flush=True)
            container_started = True
            settings["versions"] = prepare_container(args.name, args.image, files)
            print(f"== measuring: {args.rounds} rounds x {args.requests} requests x 2 configurations x 2 bodies",
                  file=sys.stderr, flush=True)
            raw = json.loads(podman(
                "exec", "-i", args.name, "python3", f"{GW}/front_fallback_overhead.py", "--inside",
                "--rounds", str(args.rounds), "--requests", str(args.requests), "--warmup", str(args.warmup),
                "--large-kib", str(args.large_kib), stdin=key, stream_stderr=True))
    except (StepError, OSError, subprocess.SubprocessError, json.JSONDecodeError, KeyError) as exc:
        print(f"front_fallback_overhead: could not run: {exc}", file=sys.stderr)
        return 1
    finally:
        if container_started and not args.keep:
            subprocess.run(["podman", "rm", "-f", "-t", "0", args.name], capture_output=True, check=False)
    settings["body_bytes"] = raw["body_bytes"]
    settings["seconds"] = round(time.monotonic() - started, 1)
    summary = summarize(raw["rounds"], args.skip_rounds)
    report(summary, settings)
    print(f"run time {settings['seconds']:.0f} s" + (f"; container {args.name} kept" if args.keep else ""))
    if args.json:
        args.json.write_text(json.dumps({**settings, **summary, "rounds_us": raw["rounds"]}, indent=1) + "\n",
                             encoding="utf-8")
        print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
