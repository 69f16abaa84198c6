"""The nvidia_driver role's real run on Debian 12 (from Debian's contrib/non-free), in a container:
what is configured and installed, what is skipped and reported, and bad settings refused."""

from __future__ import annotations

import json

import pytest
from conftest import DEBIAN, failure_messages, run_playbook, task_results

BRANCH = "535"


def test_nonfree_components_signed_by_debian(debian):
    f = debian.file("/etc/apt/sources.list.d/inferops-nvidia-debian.sources")
    assert f.user == "root" and f.mode == 0o644
    stanzas = [s for s in f.content_string.split("\n\n") if "Types:" in s]
    assert len(stanzas) == 2
    for stanza in stanzas:
        assert "Components: contrib non-free non-free-firmware" in stanza
        assert "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg" in stanza
    assert "Suites: bookworm bookworm-updates" in stanzas[0]
    assert "Suites: bookworm-security" in stanzas[1]


def test_apt_holds_the_branch(debian):
    pref = debian.file("/etc/apt/preferences.d/inferops-nvidia-driver.pref").content_string
    assert f"Pin: version {BRANCH}.*" in pref
    # apt itself applies the pin: every NVIDIA version it offers is of the branch, at priority 1000.
    policy = debian.check_output("apt-cache policy nvidia-smi libcuda1")
    candidates = [line.split()[1] for line in policy.splitlines() if line.strip().startswith("Candidate:")]
    assert len(candidates) == 2 and all(c.startswith(f"{BRANCH}.") for c in candidates), policy
    pinned = [line.split() for line in policy.splitlines() if line.strip().startswith(("***", BRANCH))]
    assert pinned and all(fields[-1] == "1000" for fields in pinned), policy


@pytest.mark.parametrize("package", ["nvidia-smi", "libcuda1", "libnvidia-ml1", "nvidia-persistenced"])
def test_userspace_installed_on_the_branch(debian, package):
    pkg = debian.package(package)
    assert pkg.is_installed
    assert pkg.version.startswith(BRANCH + "."), pkg.version


@pytest.mark.parametrize(
    "package",
    # The kernel side is skipped in a container, and no recommends pull it (or a compiler) back in.
    ["nvidia-open-kernel-dkms", "nvidia-kernel-dkms", "firmware-nvidia-gsp", "dkms", "gcc-12", "linux-headers-amd64"],
)
def test_kernel_side_not_installed(debian, package):
    assert not debian.package(package).is_installed


def test_kernel_side_files_not_written(debian):
    assert not debian.file("/etc/modprobe.d/inferops-blacklist-nouveau.conf").exists
    assert not debian.file("/etc/modules-load.d/inferops-nvidia-peermem.conf").exists


def test_persistenced_enabled(debian):
    assert debian.service("nvidia-persistenced").is_enabled


def test_real_nvidia_smi_reports_driver_not_loaded(debian):
    # The real nvidia-smi from the package, without a kernel module: what nvidia_gpu_facts classifies.
    cmd = debian.run("nvidia-smi")
    assert cmd.rc == 9, (cmd.rc, cmd.stdout, cmd.stderr)
    assert "couldn't communicate with the NVIDIA driver" in cmd.stdout + cmd.stderr


def test_report_says_what_was_skipped_and_why(debian):
    f = debian.file("/etc/ansible/facts.d/nvidia_driver.fact")
    assert f.mode == 0o644
    report = json.loads(f.content_string)
    assert report["branch"] == BRANCH and report["source"] == "distribution"
    assert report["installed_version"] == debian.package("nvidia-smi").version
    assert report["userspace_packages"] == ["nvidia-smi", "libcuda1", "nvidia-persistenced"]
    for key in ("kernel_modules", "reboot", "peermem"):
        assert report[key].startswith("skipped: this host is a container (podman)"), report[key]
    assert report["fabric_manager"] == "not needed: no NVSwitch on the PCI bus"
    assert report["driver_loaded"] is False
    assert "installed but not loaded" in report["driver_state"]
    assert report["pci_gpus"] == [] and report["pci_nvswitches"] == []


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["-e", 'nvidia_driver_branch="550"'], "Debian 12 carries only driver branch 535"),
        (["-e", 'nvidia_driver_branch="58"'], "nvidia_driver_branch: is '58', not a quoted three-digit driver branch"),
        (["-e", "nvidia_driver_fabric_manager=true"], "Debian's non-free has no fabric manager package"),
    ],
)
def test_bad_settings_are_refused_before_any_change(extra, message):
    rc, report = run_playbook("converge.yml", *extra)
    assert rc == 2
    messages = failure_messages(report, DEBIAN)
    assert any(message in " ".join(m.split()) for m in messages), messages
    assert report["stats"][DEBIAN]["changed"] == 0
    # It stopped in the checks, before the repository tasks.
    assert "Add Debian's contrib and non-free components" not in task_results(report, DEBIAN)
