"""The nvidia_driver role's Ubuntu 22.04 path in check mode (NVIDIA's CUDA repository is not reachable
from CI): the repository file it would write, the keyring it would install, the packages a real run
installs, and that check mode changed nothing on the host."""

from __future__ import annotations

import pytest
from conftest import UBUNTU, run_playbook, task_results

KEYRING = "/usr/share/keyrings/cuda-archive-keyring.gpg"
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
