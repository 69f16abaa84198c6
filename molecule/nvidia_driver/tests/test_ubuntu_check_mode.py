"""The nvidia_driver role's Ubuntu 22.04 path in check mode (NVIDIA's CUDA repository is not reachable
from CI): the repository file it would write, the keyring it would install and the SHA-256 it must have,
the packages a real run installs, and that check mode changed nothing on the host."""

from __future__ import annotations

import pytest
from conftest import UBUNTU, failure_messages, run_playbook, task_results

KEYRING = "/usr/share/keyrings/cuda-archive-keyring.gpg"
# The role's pinned SHA-256 of ubuntu2204/x86_64's cuda-keyring_1.1-1_all.deb (a mirror serves the same file).
KEYRING_DEB_SHA256 = "d93190d50b98ad4699ff40f4f7af50f16a76dac3bb8da1eaaf366d47898ff8df"
LIST = "/etc/apt/sources.list.d/cuda-ubuntu2204-x86_64.list"


@pytest.mark.parametrize(
    ("extra", "base"),
    [
        ([], "https://developer.download.nvidia.com/compute/cuda/repos"),
        # A site mirror, given with a trailing slash.
        (["-e", "nvidia_driver_cuda_repo_url=http://mirror.example.internal/nvidia/cuda/repos/"],
         "http://mirror.example.internal/nvidia/cuda/repos"),
    ],
)
def test_check_mode_renders_the_cuda_repository(ubuntu, extra, base):
    rc, report = run_playbook("check_ubuntu.yml", "--check", "--diff", *extra)
    assert rc == 0, report["stats"]
    results = task_results(report, UBUNTU)

    repo = results["Point the CUDA repository source at the configured URL"]
    assert repo["changed"] is True
    (diff,) = repo["diff"]
    # A new file's diff names the template, not the destination; LIST is checked in the message below,
    # which names the file the same variable makes the template's destination.
    assert diff["before"] == ""
    lines = [line for line in diff["after"].splitlines() if line and not line.startswith("#")]
    assert lines == [f"deb [signed-by={KEYRING}] {base}/ubuntu2204/x86_64/ /"]

    keyring = results["Say that check mode does not download the keyring"]
    assert f"{base}/ubuntu2204/x86_64/cuda-keyring_1.1-1_all.deb" in keyring["msg"]
    assert f"SHA-256 {KEYRING_DEB_SHA256}" in " ".join(keyring["msg"].split())

    predicted = " ".join(results["Say what check mode cannot predict"]["msg"].split())
    assert LIST in predicted
    for package in ("nvidia-driver-pinning-580", "libnvidia-compute", "nvidia-utils", "nvidia-compute-utils"):
        assert package in predicted
    skipped = " ".join(results["Say why the kernel modules are not installed"]["msg"].split())
    assert "nvidia-dkms-open" in skipped and "this host is a container (podman)" in skipped

    # Check mode changed nothing on the host.
    assert not ubuntu.file(LIST).exists
    assert not ubuntu.file(KEYRING).exists
    assert not ubuntu.package("cuda-keyring").is_installed
    assert not ubuntu.file("/etc/ansible/facts.d/nvidia_driver.fact").exists


def test_preflight_refuses_a_keyring_without_a_hash(ubuntu):
    # A keyring version the role pins no SHA-256 for, and none given: preflight stops before any change.
    rc, report = run_playbook("check_ubuntu.yml", "--check", "-e", "nvidia_driver_cuda_keyring_version=9.9-9")
    assert rc != 0
    (message,) = failure_messages(report, UBUNTU)
    message = " ".join(message.split())
    assert "no pinned SHA-256 for NVIDIA's cuda-keyring 9.9-9 of repository ubuntu2204/x86_64" in message
    assert "set nvidia_driver_cuda_keyring_sha256" in message
    assert "/ubuntu2204/x86_64/cuda-keyring_9.9-9_all.deb" in message
    assert not ubuntu.package("cuda-keyring").is_installed
