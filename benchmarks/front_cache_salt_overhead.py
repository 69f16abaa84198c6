# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What vllm_router_front_cache_salt_per_key (tenant isolation of the prefix cache, issue #25) costs a
request the front serves locally, measured the way benchmarks/front_fallback_overhead.py measures the
fallback's cost, with its machinery (imported from it):

    python3 benchmarks/front_cache_salt_overhead.py                       # 20 rounds x 300 requests, ~2-3 min
    python3 benchmarks/front_cache_salt_overhead.py --rounds 10 --requests 200 --json salt.json

  1. renders the vllm_router front twice with the role (tests/gateway/render.yml on tests/preflight/good, no
     host contacted), without fallbacks and with the default vllm_router_front_hide_internals (njs loaded in
     both, as production has it): "off" with vllm_router_front_cache_salt_per_key false, "salt" with true;
     rate limits out of reach in both;
  2. starts a Debian 12 container (--cpus 1) with nginx-light and libnginx-mod-http-js, sets the gateway test
     up there (tests/gateway/setup_in_container.sh: fake vllm-router replicas fake_local.py, which log the
     cache_salt each body reached them with), then runs this file inside it: a Python client on loopback,
     one keep-alive connection per cell, POST /v1/chat/completions with the rendered client key, a small
     body and one of --large-kib KiB, both configurations in alternating order each round; a switch installs
     the other rendered site and waits until the fake upstream sees (salt) or does not see (off) a
     cache_salt;
  3. checks, on the "salt" configuration, that every body reached the upstream with the key's salt and that
     a client's own cache_salt only follows it (the isolation itself: that a salt keeps one key's prefixes from
     another's on real vLLM is molecule/default/tests/test_cache_salt.py's job);
  4. removes the container (unless --keep).

Figures per configuration and body: median and p90 of the request time seen by the client, the difference of
the medians (µs and % of "off"), and the median of the per-round paired differences with its interquartile
range. It asserts nothing about the figures: exit status 1 only when a step could not run or the salt
check failed. On a 2-core machine the figures move with whatever else runs.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import front_fallback_overhead as ffo  # noqa: E402  (beside this file, here and in the container)

CONFIGS = ("off", "salt")
BODIES = ffo.BODIES
GW = ffo.GW
RENDERED = {"off": f"{GW}/rendered_off", "salt": f"{GW}/rendered_salt"}
LOCAL_LOG = "/tmp/gw/local_requests.log"
DEFAULT_NAME = "inferops-cache-salt-bench"
SALT_ON = {"vllm_router_front_cache_salt_per_key": True}
SALT_OFF = {"vllm_router_front_cache_salt_per_key": False}


# ---------------------------------------------------------------------------------------------
# Inside the container (this file, run with --inside).


def _last_salt() -> object:
    with open(LOCAL_LOG, encoding="utf-8") as f:
        last = f.read().rstrip("\n").rsplit("\n", 1)[-1]
    return json.loads(last).get("cache_salt")


def _post(key: str, body: bytes) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", ffo.FRONT_PORT, timeout=10)
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers=ffo._headers(key))
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def switch(config: str, key: str) -> None:
    """Installs the rendered site of `config`, reloads nginx, waits until the upstream sees its bodies."""
    r = RENDERED[config]
    ffo._run("install", "-m", "0644", f"{r}/inferops-vllm.conf", "/etc/nginx/sites-available/inferops-vllm.conf")
    ffo._run("install", "-m", "0600", f"{r}/inferops-vllm-keys.map", f"{r}/inferops-vllm-proxy.conf", "/etc/nginx/")
    ffo._run("install", "-m", "0644", f"{r}/inferops-vllm-fallback.js", "/etc/nginx/njs/")
    if not os.path.lexists(ffo.NJS_LINK):
        os.symlink(ffo.NJS_CONF, ffo.NJS_LINK)
    ffo._run("nginx", "-t", "-q")
    ffo._run("nginx", "-s", "reload")
    probe = ffo._body("small", 0)
    deadline = time.monotonic() + 20
    while True:
        status = _post(key, probe)
        salt = _last_salt() if status == 200 else "?"
        if status == 200 and (salt is not None) == (config == "salt"):
            return
        if time.monotonic() > deadline:
            raise ffo.StepError(f"after the reload to {config!r}: status {status}, upstream cache_salt {salt!r}")
        time.sleep(0.1)


def salt_check(key: str) -> dict:
    """On "salt": the upstream gets the key's salt; a client's own only follows it (key's salt, "-", 32 hex)."""
    assert _post(key, ffo._body("small", 0)) == 200
    own = _last_salt()
    body = json.loads(ffo._body("small", 0))
    body["cache_salt"] = "chosen-by-the-client"
    status = _post(key, json.dumps(body).encode())
    replaced = _last_salt()
    return {"key_salt": own, "client_salt_replaced": status == 200 and own is not None and own.startswith("inferops-k-")
            and isinstance(replaced, str) and replaced.startswith(f"{own}-") and len(replaced) == len(own) + 33}


def inside(args: argparse.Namespace) -> int:
    key = sys.stdin.read().strip()
    bodies = {kind: ffo._body(kind, args.large_kib) for kind in BODIES}
    rounds = []
    current = "salt"
    switch(current, key)
    check = salt_check(key)
    for number in range(args.rounds):
        order = CONFIGS if number % 2 == 0 else CONFIGS[::-1]
        cells = {}
        for config in order:
            if config != current:
                switch(config, key)
                current = config
            for kind in (BODIES if number % 2 == 0 else BODIES[::-1]):
                # measure_cell's "none" expects no X-Inferops-Served-By: right for both (no fallbacks).
                cells[f"{config}/{kind}"] = ffo.measure_cell("none", key, bodies[kind], args.warmup, args.requests)
        rounds.append(cells)
        medians = "  ".join(f"{name} {statistics.median(c['us']) / 1000:.3f}" if c["us"] else f"{name} -"
                            for name, c in sorted(cells.items()))
        print(f"round {number + 1}/{args.rounds}: median ms  {medians}", file=sys.stderr, flush=True)
    print(json.dumps({"rounds": rounds, "body_bytes": {k: len(v) for k, v in bodies.items()}, "check": check}))
    return 0


# ---------------------------------------------------------------------------------------------
# On the host.


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
                           "p90_ms": round(ffo._percentile(values, 0.9) / 1000, 4) if values else None}
    for kind in BODIES:
        base, salt = cells[f"off/{kind}"], cells[f"salt/{kind}"]
        if base["median_ms"] is None or salt["median_ms"] is None:
            deltas[kind] = None
            continue
        diff_us = (salt["median_ms"] - base["median_ms"]) * 1000
        paired = [statistics.median(r[f"salt/{kind}"]["us"]) - statistics.median(r[f"off/{kind}"]["us"])
                  for r in counted if r[f"salt/{kind}"]["us"] and r[f"off/{kind}"]["us"]]
        quartiles = statistics.quantiles(paired, n=4) if len(paired) >= 2 else [paired[0]] * 3
        deltas[kind] = {
            "median_delta_us": round(diff_us, 1),
            "median_delta_pct": round(100 * diff_us / (base["median_ms"] * 1000), 2),
            "paired_delta_us": round(statistics.median(paired), 1),
            "paired_delta_pct": round(100 * statistics.median(paired) / (base["median_ms"] * 1000), 2),
            "paired_delta_iqr_us": [round(quartiles[0], 1), round(quartiles[2], 1)],
        }
    return {"cells": cells, "deltas": deltas}


def report(summary: dict, settings: dict, check: dict) -> None:
    cells, deltas = summary["cells"], summary["deltas"]
    print()
    print("| front | body | requests | median | p90 | vs off (medians) | paired per round (IQR) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for kind in BODIES:
        size = settings["body_bytes"][kind]
        label = f"{size} B" if kind == "small" else f"{size // 1024} KiB"
        for config in CONFIGS:
            c = cells[f"{config}/{kind}"]
            med = f"{c['median_ms']:.3f} ms" if c["median_ms"] is not None else "-"
            p90 = f"{c['p90_ms']:.3f} ms" if c["p90_ms"] is not None else "-"
            d = deltas[kind] if config == "salt" else None
            vs = f"{d['median_delta_pct']:+.1f} % ({d['median_delta_us']:+.0f} µs)" if d else "—"
            paired = (f"{d['paired_delta_pct']:+.1f} % ({d['paired_delta_us']:+.0f} µs; "
                      f"{d['paired_delta_iqr_us'][0]:+.0f}..{d['paired_delta_iqr_us'][1]:+.0f})") if d else "—"
            name = "cache_salt_per_key: false" if config == "off" else "cache_salt_per_key: true"
            print(f"| {name} | {label} | {c['requests']} | {med} | {p90} | {vs} | {paired} |")
    for name, c in cells.items():
        if c["left_out"]:
            print(f"{name}: left out (not 200): {c['left_out']}")
    print(f"\nsalt check: upstream got {check['key_salt']!r} for the key; a client's own cache_salt only after "
          f"the key's: {'yes' if check['client_salt_replaced'] else 'NO'}")
    print(f"{settings['rounds']} rounds x {settings['requests']} requests per cell after {settings['warmup']} "
          f"unmeasured, first {settings['skip_rounds']} round(s) not counted; {settings['versions']}; "
          f"container --cpus 1, client on loopback (one keep-alive connection per cell)")
    print(f"machine: {settings['machine']}; {settings['date']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=ffo._positive_int, default=20, metavar="N",
                        help="rounds, each measuring both configurations and both bodies (default: 20)")
    parser.add_argument("--requests", type=ffo._positive_int, default=300, metavar="N",
                        help="measured requests per configuration, body and round (default: 300)")
    parser.add_argument("--warmup", type=ffo._non_negative_int, default=30, metavar="N",
                        help="unmeasured requests before each cell's measured ones (default: 30)")
    parser.add_argument("--skip-rounds", type=ffo._non_negative_int, default=1, metavar="N",
                        help="first rounds not counted (default: 1)")
    parser.add_argument("--large-kib", type=ffo._positive_int, default=64, metavar="K",
                        help="size of the large request body in KiB (default: 64)")
    parser.add_argument("--name", default=DEFAULT_NAME, help=f"container name (default: {DEFAULT_NAME})")
    parser.add_argument("--image", default=ffo.DEFAULT_IMAGE, help=f"base image (default: {ffo.DEFAULT_IMAGE})")
    parser.add_argument("--keep", action="store_true", help="leave the container running at the end")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the figures to FILE as JSON")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside:
        return inside(args)
    if args.skip_rounds >= args.rounds:
        parser.error("--skip-rounds must be less than --rounds")

    started = time.monotonic()
    settings = {"date": datetime.date.today().isoformat(), "machine": ffo.machine_description(),
                "rounds": args.rounds, "requests": args.requests, "warmup": args.warmup,
                "skip_rounds": args.skip_rounds, "image": args.image}
    container_started = False
    try:
        with tempfile.TemporaryDirectory(prefix="front-cache-salt-bench-") as tmp:
            work = Path(tmp)
            ffo._tools_path()
            os.environ.setdefault("ANSIBLE_COLLECTIONS_PATH", str(ffo.REPO / ".ansible" / "collections"))
            gateway_vars = json.loads((ffo.GATEWAY / "vars.json").read_text(encoding="utf-8"))
            plain = {k: v for k, v in gateway_vars.items()
                     if not k.startswith("vllm_router_front_fallback") and k != "vllm_router_front_cache_salt_per_key"}
            print("== render the front with the role: the gateway's (setup), salt off, salt on", file=sys.stderr,
                  flush=True)
            with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
                jobs = {"gateway": pool.submit(ffo.render, work / "gateway", {**gateway_vars, **ffo.NO_LIMITS}),
                        "off": pool.submit(ffo.render, work / "off", {**plain, **ffo.NO_LIMITS, **SALT_OFF}),
                        "salt": pool.submit(ffo.render, work / "salt", {**plain, **ffo.NO_LIMITS, **SALT_ON})}
                out = {name: job.result() for name, job in jobs.items()}
            key = ffo.client_key((out["salt"] / "inferops-vllm-keys.map").read_text(encoding="utf-8"))
            (work / "cloud_keys").write_text(
                " ".join(fb["api_key"] for fb in gateway_vars["vllm_router_front_fallbacks"]) + "\n",
                encoding="utf-8")
            (work / "validate.sh").write_text(ffo.role_validate_command(), encoding="utf-8")
            files = {"rendered": out["gateway"], "rendered_off": out["off"], "rendered_salt": out["salt"],
                     "cloud_keys": work / "cloud_keys", "validate.sh": work / "validate.sh",
                     "front_fallback_overhead.py": Path(ffo.__file__).resolve(),
                     "front_cache_salt_overhead.py": Path(__file__).resolve()}
            for name in ("setup_in_container.sh", "fake_local.py", "fake_cloud.py"):
                files[name] = ffo.GATEWAY / name
            print(f"== container {args.name} from {args.image}", file=sys.stderr, flush=True)
            container_started = True
            settings["versions"] = ffo.prepare_container(args.name, args.image, files)
            print(f"== measuring: {args.rounds} rounds x {args.requests} requests x 2 configurations x 2 bodies",
                  file=sys.stderr, flush=True)
            raw = json.loads(ffo.podman(
                "exec", "-i", args.name, "python3", f"{GW}/front_cache_salt_overhead.py", "--inside",
                "--rounds", str(args.rounds), "--requests", str(args.requests), "--warmup", str(args.warmup),
                "--large-kib", str(args.large_kib), stdin=key, stream_stderr=True))
    except (ffo.StepError, OSError, subprocess.SubprocessError, json.JSONDecodeError, KeyError) as exc:
        print(f"front_cache_salt_overhead: could not run: {exc}", file=sys.stderr)
        return 1
    finally:
        if container_started and not args.keep:
            subprocess.run(["podman", "rm", "-f", "-t", "0", args.name], capture_output=True, check=False)
    settings["body_bytes"] = raw["body_bytes"]
    settings["seconds"] = round(time.monotonic() - started, 1)
    summary = summarize(raw["rounds"], args.skip_rounds)
    report(summary, settings, raw["check"])
    print(f"run time {settings['seconds']:.0f} s" + (f"; container {args.name} kept" if args.keep else ""))
    if args.json:
        args.json.write_text(json.dumps({**settings, **summary, "check": raw["check"], "rounds_us": raw["rounds"]},
                                        indent=1) + "\n", encoding="utf-8")
        print(f"figures written to {args.json}")
    return 0 if raw["check"]["client_salt_replaced"] else 1


if __name__ == "__main__":
    sys.exit(main())
