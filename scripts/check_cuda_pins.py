# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Check that vllm_install's `cuda` variant is a coherent set, without downloading the GPU wheels.

Reads the pins from roles/vllm_install (defaults/main.yml: vllm_install_version, vllm_install_nixl_version;
vars/main.yml: the cuda packages installed with their dependencies, and the NIXL packages installed
without), then for each supported host OS and architecture asks pip, against the real index, to resolve
exactly what the role installs there: `pip install --dry-run --ignore-installed --report` with that OS's
Python version and manylinux tags (glibc), binary wheels only. pip reads each wheel's metadata with HTTP
range requests (`--use-feature=fast-deps`: the index here serves no PEP 658 metadata files), so the GPU
wheels (vllm ~330 MB, torch ~900 MB, the CUDA libraries) are never downloaded; the bytes that did cross
the network are counted and printed.

Then it checks what pip cannot: NIXL's meta package `nixl` imports the build of torch's CUDA major
(nixl_cu12 or nixl_cu13) and fails without it, so the CUDA major that torch's requirements bring
(cuda-toolkit, nvidia-*-cuNN) must be the one of the nixl-cuNN the role pins, and each NIXL build's own
requirements must be in the resolved set.

    bash scripts/check_cuda_pins.sh                          # every OS and architecture (a few minutes)
    bash scripts/check_cuda_pins.sh --os debian12 --arch x86_64                  # one (about a minute)
    bash scripts/check_cuda_pins.sh --index-url https://pypi.internal.example/simple   # a mirror, not PyPI

Exit status: 0 coherent everywhere; 1 a pin does not exist, does not resolve or is incoherent (each named
with the OS, Python, architecture, package and index); 2 the index could not be reached.
It needs network access to the index; scripts/test.sh does not run it (its lint stage stays offline).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jinja2
import yaml

REPO = Path(__file__).resolve().parents[1]
ROLE = REPO / "roles" / "vllm_install"
# The hosts vllm_install supports (its meta/main.yml), with their python3 and glibc.
TARGETS = {
    "debian12": ("3.11", (2, 36)),
    "debian13": ("3.13", (2, 41)),
    "ubuntu2204": ("3.10", (2, 35)),
    "ubuntu2404": ("3.12", (2, 39)),
}
ARCHES = ("x86_64", "aarch64")


def role_pins(variant: str = "cuda") -> tuple[list[str], list[str]]:
    """(packages with dependencies, packages without) that vllm_install installs for the variant."""
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    variables = yaml.safe_load((ROLE / "vars" / "main.yml").read_text())
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    context = {k: v for k, v in defaults.items() if isinstance(v, str) and "{{" not in v}
    context["vllm_install_variant"] = variant

    def render(items: list[str]) -> list[str]:
        return [env.from_string(item).render(context) for item in items]

    packages, nixl = variables["_vllm_install_packages"], variables["_vllm_install_nixl_packages"]
    return render(packages[variant]), render(nixl[variant])


def platforms(arch: str, glibc: tuple[int, int]) -> list[str]:
    """The platform tags pip accepts on a Linux host of that architecture and glibc, newest first."""
    tags = [f"manylinux_{glibc[0]}_{minor}_{arch}" for minor in range(glibc[1], 4, -1)]
    legacy = {"manylinux2014": (2, 17), "manylinux2010": (2, 12), "manylinux1": (2, 5)}
    tags += [f"{name}_{arch}" for name, (_major, minor) in legacy.items()
             if minor <= glibc[1] and (arch == "x86_64" or name == "manylinux2014")]
    return tags + [f"linux_{arch}"]


class CountingProxy:
    """An HTTP CONNECT proxy on loopback that counts the bytes it relays (what pip downloaded)."""

    def __init__(self) -> None:
        self.received = 0
        self.lock = threading.Lock()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            client, _address = self.sock.accept()
            threading.Thread(target=self._tunnel, args=(client,), daemon=True).start()

    def _tunnel(self, client: socket.socket) -> None:
        try:
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = client.recv(4096)
                if not chunk:
                    return
                head += chunk
            m = re.match(rb"CONNECT ([^:\s]+):(\d+) ", head)
            if not m:
                client.sendall(b"HTTP/1.1 405 only CONNECT\r\n\r\n")
                return
            upstream = socket.create_connection((m.group(1).decode(), int(m.group(2))), timeout=30)
            client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            pair = {client: upstream, upstream: client}
            while True:
                ready, _writable, _failed = select.select(list(pair), [], [], 60)
                if not ready:
                    return
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    if s is upstream:
                        with self.lock:
                            self.received += len(data)
                    pair[s].sendall(data)
        except OSError:
            return
        finally:
            client.close()


def pip_report(args: argparse.Namespace, requirements: list[str], python: str, arch: str,
               glibc: tuple[int, int], no_deps: bool, proxy: str | None) -> tuple[dict | None, str]:
    """pip's installation report of a dry run (or None) and pip's error lines."""
    abi = "cp" + python.replace(".", "")
    with tempfile.TemporaryDirectory(prefix="inferops-cuda-pins.") as tmp:
        report = Path(tmp) / "report.json"
        argv = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                "--no-input", "--disable-pip-version-check", "--no-cache-dir", "--report", str(report),
                "--index-url", args.index_url, "--only-binary=:all:", "--python-version", python,
                "--implementation", "cp", "--abi", abi, "--abi", "abi3", "--abi", "none",
                "--use-feature=fast-deps", "--timeout", "30"]
        for url in args.extra_index_url:
            argv += ["--extra-index-url", url]
        for tag in platforms(arch, glibc):
            argv += ["--platform", tag]
        if no_deps:
            argv.append("--no-deps")
        if proxy:
            argv += ["--proxy", proxy]
        # Only the index and the pins decide: no pip configuration file or PIP_* variable of this machine.
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
        env["PIP_CONFIG_FILE"] = os.devnull
        run = subprocess.run(argv + requirements, capture_output=True, text=True, env=env, check=False)
        errors = [line for line in (run.stdout + run.stderr).splitlines()
                  if line.startswith("ERROR") or "Could not fetch URL" in line]
        if run.returncode != 0 or not report.is_file():
            return None, "\n".join(errors) or run.stderr.strip()[-2000:]
        return json.loads(report.read_text()), ""


def torch_cuda_major(report: dict) -> int | None:
    """The CUDA major version torch is built for (torch.version.cuda, which NIXL's meta package reads), from
    the CUDA runtime torch requires: cuda-toolkit==N.x (CUDA 13 wheels) or nvidia-cuda-runtime-cuN (CUDA 12)."""
    for item in report["install"]:
        if normalise(item["metadata"]["name"]) != "torch":
            continue
        for requirement in item["metadata"].get("requires_dist") or []:
            m = (re.match(r"cuda-toolkit\b[^=;]*==\s*(\d+)\.", requirement)
                 or re.match(r"nvidia-cuda-runtime-cu(\d+)\b", requirement)
                 or re.match(r"nvidia-cuda-runtime\b[^=;]*==\s*(\d+)\.", requirement))
            if m:
                return int(m.group(1))
    return None


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def check_target(args, os_name: str, arch: str, with_deps: list[str], without: list[str], proxy: str | None):
    python, glibc = TARGETS[os_name]
    where = f"{os_name} (Python {python}, {arch}, glibc {glibc[0]}.{glibc[1]})"
    started = time.monotonic()
    problems = []
    report, error = pip_report(args, with_deps, python, arch, glibc, False, proxy)
    installed: dict[str, str] = {}
    if report is None:
        problems.append(f"{where}: {' '.join(with_deps)} does not resolve on {args.index_url}:\n    "
                        + error.replace("\n", "\n    "))
    else:
        installed = {normalise(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}
    nodeps_report, error = pip_report(args, without, python, arch, glibc, True, proxy)
    nodeps: dict[str, dict] = {}
    if nodeps_report is None:
        problems.append(f"{where}: {' '.join(without)} (installed without dependencies) not on {args.index_url}:\n"
                        "    " + error.replace("\n", "\n    "))
    else:
        nodeps = {normalise(i["metadata"]["name"]): i["metadata"] for i in nodeps_report["install"]}
    major = torch_cuda_major(report) if report else None
    if installed and nodeps:
        builds = sorted(n for n in nodeps if re.fullmatch(r"nixl-cu\d+", n))
        if major is None:
            problems.append(f"{where}: torch {installed.get('torch', '(not resolved)')} requires no CUDA runtime "
                            "(cuda-toolkit or nvidia-cuda-runtime): not a CUDA build, so the cuda variant has no GPU "
                            "torch.")
        elif f"nixl-cu{major}" not in builds:
            problems.append(f"{where}: torch {installed.get('torch')} is built for CUDA {major} (its CUDA runtime "
                            f"requirement), so NIXL's meta package imports nixl_cu{major}, but the role installs "
                            f"{', '.join(builds) or 'no NIXL build'}: `import nixl` fails (\"detected CUDA {major} but "
                            f"nixl-cu{major} is not installed\"). Fix: _vllm_install_nixl_packages.cuda in "
                            "roles/vllm_install/vars/main.yml.")
        for name, meta in nodeps.items():
            for requirement in meta.get("requires_dist") or []:
                dep = normalise(re.split(r"[\s<>=!~\[(;]", requirement, maxsplit=1)[0])
                # Markers and extras are not installed; the meta package's other CUDA builds are left out on purpose.
                if ";" in requirement or re.fullmatch(r"nixl-cu\d+", dep):
                    continue
                if dep not in installed and dep not in nodeps:
                    problems.append(f"{where}: {name} {meta['version']} requires {requirement}, which the resolved "
                                    "set does not have (it is installed without dependencies).")
    nixl = ", ".join(f"{n} {m['version']}" for n, m in sorted(nodeps.items())) or "?"
    summary = (f"{where}: {len(installed)} packages resolved (vllm {installed.get('vllm', '?')}, torch "
               f"{installed.get('torch', '?')} for CUDA {major or '?'}), NIXL {nixl} "
               f"in {time.monotonic() - started:.0f} s")
    return summary, problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--os", action="append", choices=sorted(TARGETS), help="host OS (default: all supported)")
    parser.add_argument("--arch", action="append", choices=ARCHES, help="architecture (default: both)")
    parser.add_argument("--index-url", default="https://pypi.org/simple",
                        help="the index the hosts install from (vllm_install_index_url; default PyPI)")
    parser.add_argument("--extra-index-url", action="append", default=[],
                        help="vllm_install_extra_index_urls (repeatable)")
    parser.add_argument("--jobs", type=int, default=4, help="resolutions run at once (default 4)")
    args = parser.parse_args()
    with_deps, without = role_pins("cuda")
    print(f"vllm_install cuda variant: {' '.join(with_deps)} (with dependencies) and {' '.join(without)} "
          f"(without), against {args.index_url}", flush=True)
    try:
        urllib.request.urlopen(args.index_url.rstrip("/") + "/" + normalise(with_deps[0].split("==")[0]) + "/",
                               timeout=10).read(1)
    except OSError as exc:
        print(f"UNREACHABLE: {args.index_url}: {exc}", file=sys.stderr)
        return 2
    proxy = None if any(k.lower() in ("https_proxy", "all_proxy") for k in os.environ) else CountingProxy()
    targets = [(o, a) for o in (args.os or sorted(TARGETS)) for a in (args.arch or ARCHES)]
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(lambda t: check_target(args, t[0], t[1], with_deps, without,
                                                       proxy.url if proxy else None), targets))
    problems = []
    for summary, target_problems in results:
        print(("FAIL " if target_problems else "ok   ") + summary)
        problems += target_problems
    downloaded = f", {proxy.received / 1e6:.1f} MB downloaded" if proxy else ""
    print(f"{len(targets)} resolution(s) in {time.monotonic() - started:.0f} s{downloaded}")
    for problem in problems:
        print("PROBLEM " + problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
