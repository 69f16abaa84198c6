"""Direct PD handoffs on the sandbox, without vllm-router: the prefill request (max_tokens=1 with
kv_transfer_params.do_remote_decode) and then the decode request with what prefill returned, one at a time
and with N concurrent clients. Prints the prefill and decode request times (p50) per concurrency.

    python3 benchmarks/pd_handoff_concurrency.py [--concurrency 1 3] [--seconds 20]

Needs the sandbox of scripts/sandbox/up.sh. The instances' firewall admits the router host, so the probe runs
there (copied into inferops-router-1, run with the router venv's Python); the instance key comes from the
sandbox's secrets directory and is passed on stdin, never on a command line. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

PREFILL, DECODE = "http://10.89.250.11:8100", "http://10.89.250.12:8200"
MODEL = "smollm2-135m-instruct"
ROUTER = "inferops-router-1"
PYTHON = "/opt/vllm-router/venv/bin/python"


def _post(url: str, key: str, body: dict) -> tuple[dict, float]:
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Authorization": "Bearer " + key, "Content-Type": "application/json"})
    start = time.monotonic()
    with urllib.request.urlopen(req, timeout=120) as resp:
        out = json.loads(resp.read())
    return out, time.monotonic() - start


def probe(key: str, clients: int, seconds: float, mode: str = "handoff") -> dict:
    """Runs inside the router container. mode: handoff (prefill, then decode reads the KV), noread (prefill with
    do_remote_decode, decode never reads: the blocks wait on prefill for the abort timeout), plain (the same
    max_tokens=1 request with no kv_transfer_params: prefill as a plain instance)."""
    times: list[tuple[float, float]] = []

    def client(number: int) -> None:
        end, i = time.monotonic() + seconds, 0
        while time.monotonic() < end:
            i += 1
            prompt = f"client {number} request {i} {time.time_ns()} " + "tell me about dragons " * 20
            params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                      "remote_block_ids": None, "remote_host": None, "remote_port": None}
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
            if mode != "plain":
                body["kv_transfer_params"] = params
            pre, t_pre = _post(PREFILL, key, body)
            if mode != "handoff":
                times.append((t_pre, 0.0))
                continue
            _dec, t_dec = _post(DECODE, key, {"model": MODEL, "prompt": prompt, "max_tokens": 16, "ignore_eos": True,
                                              "kv_transfer_params": pre.get("kv_transfer_params")})
            times.append((t_pre, t_dec))

    threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pre = sorted(t[0] for t in times)
    dec = sorted(t[1] for t in times)
    return {"mode": mode, "clients": clients, "handoffs": len(times),
            "prefill_p50_ms": round(pre[len(pre) // 2] * 1000),
            "decode_p50_ms": round(dec[len(dec) // 2] * 1000)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--mode", choices=["handoff", "noread", "plain"], default="handoff")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        key = sys.stdin.read().strip()
        for clients in args.concurrency:
            print(json.dumps(probe(key, clients, args.seconds, args.mode)), flush=True)
        return 0
    with open(os.path.join(os.environ["INFEROPS_SECRETS_DIR"], "instance_api_key")) as f:
        key = f.read().split()[0]
    subprocess.run(["podman", "cp", os.path.abspath(__file__), f"{ROUTER}:/tmp/pd_handoff_concurrency.py"], check=True)
    run = subprocess.run(["podman", "exec", "-i", ROUTER, PYTHON, "/tmp/pd_handoff_concurrency.py", "--inside",
                          "--seconds", str(args.seconds), "--mode", args.mode,
                          "--concurrency", *map(str, args.concurrency)],
                         input=key, capture_output=True, text=True, check=True)
    print(f"machine: {os.cpu_count()} cores; sandbox {PREFILL} -> {DECODE}, 16 output tokens, ~100-token prompts")
    for line in run.stdout.splitlines():
        r = json.loads(line)
        print(f"{r['mode']}: {r['clients']} client(s): {r['handoffs']} handoffs in {args.seconds:g} s; "
              "prefill request p50 "
              f"{r['prefill_p50_ms']} ms, decode request p50 {r['decode_p50_ms']} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
