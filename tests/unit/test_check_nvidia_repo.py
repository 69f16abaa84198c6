"""scripts/check_nvidia_repo.py against a CUDA repository mirror served on loopback.

NVIDIA's server is not reachable where these tests run, so the script's CUDA repository check runs against a
mirror URL (as nvidia_driver_cuda_repo_url allows) whose `Packages.gz` indexes are made here from the role's
own package lists: everything there and the keyring's pinned SHA-256 passes; a missing package, a branch the
repository does not carry and a keyring whose hash differs from the pin fail with the repository and the
package; a repository without a pinned hash gets its hash printed; an unreachable repository exits 3.
"""

from __future__ import annotations

import gzip
import subprocess
import sys
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "check_nvidia_repo.py"
VARS = yaml.safe_load((REPO / "roles" / "nvidia_driver" / "vars" / "main.yml").read_text())
PINNED = VARS["__nvidia_driver_cuda_keyring_sha256s"]["1.1-1"]
REPOS = [f"{d}/{a}" for releases in VARS["__nvidia_driver_cuda_distros"].values() for d in releases.values()
         for a in dict.fromkeys(VARS["__nvidia_driver_cuda_arches"].values())]
NAMES = ["nvidia-driver-pinning-580", "libnvidia-compute", "nvidia-utils", "nvidia-compute-utils", "nvidia-dkms-open",
         "nvidia-dkms", "nvidia-fabricmanager", "libnvidia-nscq"]


def stanza(name: str, version: str, sha256: str = "0" * 64) -> str:
    return (f"Package: {name}\nVersion: {version}\nArchitecture: amd64\nFilename: ./{name}_{version}_amd64.deb\n"
            f"SHA256: {sha256}\n")


def write_repo(root: Path, repo: str, names: list[str], compute: str = "580.95.05-0ubuntu1",
               keyring_sha: str | None = None) -> None:
    stanzas = [stanza(n, compute if n == "libnvidia-compute" else "580.95.05-1") for n in names]
    stanzas.append(stanza("libnvidia-compute", "575.57.08-0ubuntu1"))
    if keyring_sha != "":
        stanzas.append(stanza("cuda-keyring", "1.1-1", keyring_sha or PINNED.get(repo, "ab" * 32)))
    (root / repo).mkdir(parents=True)
    (root / repo / "Packages.gz").write_bytes(gzip.compress("\n".join(stanzas).encode()))


@pytest.fixture
def mirror(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(SimpleHTTPRequestHandler, directory=str(tmp_path)))
    server.RequestHandlerClass.log_message = lambda *a: None
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield tmp_path, f"http://127.0.0.1:{server.server_address[1]}/repos"
    server.shutdown()
    server.server_close()


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), "--only", "cuda_repo", "--timeout", "5", *args],
                          capture_output=True, text=True, timeout=120, check=False)


def test_the_role_names_found_and_hashes_matching_pass(mirror):
    root, url = mirror
    for repo in REPOS:
        write_repo(root / "repos", repo, NAMES)
    result = run("--repo-url", url)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("ok  ") == len(REPOS), result.stdout
    assert "libnvidia-compute on 580: 580.95.05-0ubuntu1" in result.stdout
    # debian13/sbsa has no pinned hash: its hash from the index is printed to be pinned.
    note = "note debian13/sbsa: no pinned hash for cuda-keyring 1.1-1; the index says SHA-256 " + "ab" * 32
    assert note in result.stdout


def test_missing_names_other_branches_and_wrong_hashes_fail(mirror):
    root, url = mirror
    for repo in REPOS:
        if repo == "ubuntu2204/x86_64":
            write_repo(root / "repos", repo, [n for n in NAMES if n != "nvidia-dkms-open"])
        elif repo == "ubuntu2404/x86_64":
            write_repo(root / "repos", repo, NAMES, compute="590.44.01-0ubuntu1")
        elif repo == "debian12/x86_64":
            write_repo(root / "repos", repo, NAMES, keyring_sha="cd" * 32)
        elif repo == "debian12/sbsa":
            write_repo(root / "repos", repo, NAMES, keyring_sha="")
        else:
            write_repo(root / "repos", repo, NAMES)
    result = run("--repo-url", url)
    assert result.returncode == 1, result.stdout + result.stderr
    problems = [line for line in result.stderr.splitlines() if line.startswith("PROBLEM ")]
    text = "\n".join(problems)
    assert (f"ubuntu2204/x86_64: the role installs nvidia-dkms-open, which {url}/ubuntu2204/x86_64/Packages.gz does "
            "not list.") in text
    assert (f"ubuntu2404/x86_64: no libnvidia-compute of branch 580 in {url}/ubuntu2404/x86_64/Packages.gz "
            "(versions: 575.57.08-0ubuntu1, 590.44.01-0ubuntu1).") in text
    assert (f"debian12/x86_64: cuda-keyring 1.1-1 has SHA-256 {'cd' * 32} in {url}/debian12/x86_64/Packages.gz, but "
            f"roles/nvidia_driver/vars/main.yml pins {PINNED['debian12/x86_64']}: fix the pinned hash.") in text
    assert f"debian12/sbsa: cuda-keyring 1.1-1 (cuda-keyring_1.1-1_all.deb) is not in {url}/debian12/sbsa" in text
    assert len(problems) == 4, text


def test_an_unreachable_repository_is_said_and_exits_3():
    result = run("--repo-url", "http://127.0.0.1:9/repos")
    assert result.returncode == 3, result.stdout + result.stderr
    assert result.stdout.count("UNREACHABLE ") == len(REPOS)
    assert f"{len(REPOS)} index(es) could not be reached, so those repositories were NOT checked" in result.stderr


def test_a_branch_can_be_checked_before_it_is_pinned(mirror):
    root, url = mirror
    for repo in REPOS:
        write_repo(root / "repos", repo, [n.replace("580", "590") for n in NAMES], compute="590.44.01-0ubuntu1")
    result = run("--repo-url", url, "--branch", "590")
    assert result.returncode == 0, result.stdout + result.stderr
