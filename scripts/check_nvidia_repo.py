# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Check roles/nvidia_driver's package names and cuda-keyring hashes against the repositories' own indexes.

For each repository the role can configure it reads the APT `Packages` index (nothing is installed or
downloaded besides the index) and checks, from roles/nvidia_driver/vars/main.yml and defaults/main.yml:

- NVIDIA's CUDA repository (`nvidia_driver_source: cuda_repo`), each distro/arch of
  `__nvidia_driver_cuda_distros` x `__nvidia_driver_cuda_arches`: every package name the role installs
  (pinning package for the branch, user space, persistenced, open and proprietary DKMS modules, fabric
  manager) exists; the probe package (whose version is the installed driver's) has a version on the branch;
  the `cuda-keyring_<version>_all.deb` is in the index and its SHA-256 there equals the role's pinned one
  (printed for a repository without a pinned hash, so it can be pinned).
- Debian's own contrib/non-free (`nvidia_driver_source: distribution`), for each release of
  `__nvidia_driver_debian_branches`: the package names exist in the release, its -updates or -security
  suites, and the probe package has a version on the release's branch.

    bash scripts/check_nvidia_repo.sh                       # both, at the role's default URLs
    bash scripts/check_nvidia_repo.sh --repo-url https://mirror.example/cuda/repos --branch 580
    bash scripts/check_nvidia_repo.sh --only cuda_repo      # or: --only distribution

Exit status: 0 everything found; 1 a name, branch or hash does not match (each problem printed with the
repository and the package); 3 nothing contradicted, but a repository could not be reached (said per
repository). NVIDIA's server was not reachable where this collection is tested: run it where it is, or run
the role in check mode on a real host (docs/install_paths.md).
"""

from __future__ import annotations

import argparse
import gzip
import lzma
import re
import sys
import urllib.error
import urllib.request
from pathlib import Path

import jinja2
import yaml

REPO = Path(__file__).resolve().parents[1]
ROLE = REPO / "roles" / "nvidia_driver"
DEBIAN_SUITES = {"12": "bookworm", "13": "trixie"}
DEBIAN_ARCHES = {"x86_64": "amd64", "aarch64": "arm64"}
UNREACHABLE = 3


def load_role() -> tuple[dict, dict]:
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    variables = yaml.safe_load((ROLE / "vars" / "main.yml").read_text())
    return defaults, variables


def role_packages(variables: dict, source: str, branch: str) -> dict[str, list[str]]:
    """The role's package lists for a source, with the branch rendered in."""
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    out = {}
    for group, names in variables["__nvidia_driver_packages"][source].items():
        names = [names] if isinstance(names, str) else names
        out[group] = [env.from_string(name).render(nvidia_driver_branch=branch) for name in names]
    return out


def parse_packages(text: str) -> dict[str, list[dict[str, str]]]:
    """An APT Packages index: package name -> its stanzas (Version, Filename, SHA256, ...)."""
    index: dict[str, list[dict[str, str]]] = {}
    for stanza in re.split(r"\n\s*\n", text):
        fields = dict(re.findall(r"^([A-Za-z0-9-]+):[ \t]*(.*)$", stanza, re.M))
        if "Package" in fields:
            index.setdefault(fields["Package"], []).append(fields)
    return index


def fetch_index(base: str, timeout: float) -> tuple[str | None, str]:
    """The text of base/Packages(.xz|.gz|), or None and why not."""
    reasons = []
    for name, decode in (("Packages.xz", lzma.decompress), ("Packages.gz", gzip.decompress), ("Packages", bytes)):
        url = f"{base}/{name}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - http(s) URLs only
                return decode(response.read()).decode("utf-8", "replace"), url
        except urllib.error.HTTPError as exc:
            reasons.append(f"{url}: HTTP {exc.code}")
            if exc.code != 404:
                break
        except (OSError, lzma.LZMAError, EOFError) as exc:
            reasons.append(f"{url}: {getattr(exc, 'reason', None) or exc}")
            break
    return None, "; ".join(reasons)


def on_branch(stanzas: list[dict[str, str]], branch: str) -> list[str]:
    pattern = re.compile(rf"^(\d+:)?{re.escape(branch)}\.")
    return sorted({s.get("Version", "") for s in stanzas if pattern.match(s.get("Version", ""))})


def check_cuda_repo(args, defaults: dict, variables: dict) -> tuple[list[str], list[str]]:
    problems, unreachable = [], []
    branch = args.branch or str(defaults["nvidia_driver_branch"])
    keyring = args.keyring_version or str(defaults["nvidia_driver_cuda_keyring_version"])
    pinned = variables["__nvidia_driver_cuda_keyring_sha256s"].get(keyring, {})
    packages = role_packages(variables, "cuda_repo", branch)
    names = sorted({n for group, ns in packages.items() if group != "probe" for n in ns})
    probe = packages["probe"][0]
    base_url = (args.repo_url or defaults["nvidia_driver_cuda_repo_url"]).rstrip("/")
    for os_name, releases in variables["__nvidia_driver_cuda_distros"].items():
        for release, distro in releases.items():
            for arch in dict.fromkeys(variables["__nvidia_driver_cuda_arches"].values()):
                repo = f"{distro}/{arch}"
                text, where = fetch_index(f"{base_url}/{repo}", args.timeout)
                if text is None:
                    unreachable.append(f"{base_url}/{repo} ({os_name} {release}): {where}")
                    print(f"UNREACHABLE {repo}: {where}")
                    continue
                index = parse_packages(text)
                missing = [n for n in names if n not in index]
                for name in missing:
                    problems.append(f"{repo}: the role installs {name}, which {where} does not list.")
                versions = on_branch(index.get(probe, []), branch)
                if not versions:
                    listed = sorted({s.get("Version", "") for s in index.get(probe, [])})[-3:]
                    problems.append(f"{repo}: no {probe} of branch {branch} in {where} (versions: "
                                    f"{', '.join(listed) or 'none'}).")
                deb = [s for s in index.get("cuda-keyring", []) if s.get("Version") == keyring]
                want = pinned.get(repo, "")
                listed_sha = deb[0].get("SHA256", "").lower() if deb else ""
                if not deb:
                    problems.append(f"{repo}: cuda-keyring {keyring} (cuda-keyring_{keyring}_all.deb) is not in "
                                    f"{where}.")
                elif want and listed_sha != want.lower():
                    problems.append(f"{repo}: cuda-keyring {keyring} has SHA-256 {listed_sha} in {where}, but "
                                    f"roles/nvidia_driver/vars/main.yml pins {want}: fix the pinned hash.")
                elif not want:
                    print(f"note {repo}: no pinned hash for cuda-keyring {keyring}; the index says SHA-256 "
                          f"{listed_sha} ({deb[0].get('Filename')}): pin it in __nvidia_driver_cuda_keyring_sha256s.")
                status = "ok  " if not missing and versions and deb else "FAIL"
                keyring_state = "hash matches" if deb and want and listed_sha == want.lower() else "see above"
                print(f"{status} {repo}: {len(names) - len(missing)}/{len(names)} package names, {probe} on {branch}: "
                      f"{versions[-1] if versions else 'none'}, cuda-keyring {keyring}: {keyring_state}")
    return problems, unreachable


def check_distribution(args, defaults: dict, variables: dict) -> tuple[list[str], list[str]]:
    problems, unreachable = [], []
    mirror = defaults["nvidia_driver_debian_mirror"].rstrip("/")
    security = defaults["nvidia_driver_debian_security_mirror"].rstrip("/")
    for release, branch in variables["__nvidia_driver_debian_branches"].items():
        suite = DEBIAN_SUITES[str(release)]
        packages = role_packages(variables, "distribution", str(branch))
        names = sorted({n for group, ns in packages.items() if group != "probe" for n in ns})
        probe = packages["probe"][0]
        for arch in DEBIAN_ARCHES.values():
            index: dict[str, list[dict[str, str]]] = {}
            sources = [(mirror, suite), (mirror, f"{suite}-updates"), (security, f"{suite}-security")]
            for base, dist in sources:
                for component in ("non-free", "contrib"):
                    text, where = fetch_index(f"{base}/dists/{dist}/{component}/binary-{arch}", args.timeout)
                    if text is None:
                        if "HTTP 404" not in where:
                            unreachable.append(f"{base}/dists/{dist}/{component} ({arch}): {where}")
                        continue
                    for name, stanzas in parse_packages(text).items():
                        index.setdefault(name, []).extend(stanzas)
            if not index:
                print(f"UNREACHABLE Debian {release} ({suite}) {arch}")
                continue
            missing = [n for n in names if n not in index]
            for name in missing:
                problems.append(f"Debian {release} ({suite}) {arch}: the role installs {name}, which contrib/non-free "
                                "does not list.")
            versions = on_branch(index.get(probe, []), str(branch))
            if not versions:
                problems.append(f"Debian {release} ({suite}) {arch}: no {probe} of branch {branch}.")
            print(f"{'ok  ' if not missing and versions else 'FAIL'} Debian {release} ({suite}) {arch}: "
                  f"{len(names) - len(missing)}/{len(names)} package names, {probe} on {branch}: "
                  f"{versions[-1] if versions else 'none'}")
    return problems, unreachable


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--repo-url", help="CUDA repository base URL or mirror (nvidia_driver_cuda_repo_url)")
    parser.add_argument("--branch", help="driver branch (nvidia_driver_branch; default the role's)")
    parser.add_argument("--keyring-version", help="cuda-keyring version (default the role's)")
    parser.add_argument("--only", choices=["cuda_repo", "distribution"], help="check one source only")
    parser.add_argument("--timeout", type=float, default=8.0, help="seconds per request (default 8)")
    args = parser.parse_args()
    defaults, variables = load_role()
    problems, unreachable = [], []
    if args.only in (None, "cuda_repo"):
        found = check_cuda_repo(args, defaults, variables)
        problems += found[0]
        unreachable += found[1]
    if args.only in (None, "distribution"):
        found = check_distribution(args, defaults, variables)
        problems += found[0]
        unreachable += found[1]
    for problem in problems:
        print(f"PROBLEM {problem}", file=sys.stderr)
    if problems:
        return 1
    if unreachable:
        print(f"{len(unreachable)} index(es) could not be reached, so those repositories were NOT checked:",
              file=sys.stderr)
        for line in unreachable:
            print(f"  {line}", file=sys.stderr)
        return UNREACHABLE
    return 0


if __name__ == "__main__":
    sys.exit(main())
