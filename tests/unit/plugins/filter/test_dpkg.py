"""Unit tests for the inferops.vllm.dpkg_missing filter (whether a role runs apt at all)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from ansible.errors import AnsibleFilterError
from ansible_collections.inferops.vllm.plugins.filter.dpkg import SHOWFORMAT, FilterModule, dpkg_missing


def test_installed_packages_are_not_missing_and_the_order_is_kept():
    out = "nginx\tii \npython3-venv\tii \n"
    assert dpkg_missing(out, ["python3-venv", "nginx"]) == []
    assert dpkg_missing(out, ["prometheus", "nginx", "nftables"]) == ["prometheus", "nftables"]


@pytest.mark.parametrize("status", ["rc ", "un ", "iU ", "iF ", "hi "])
def test_a_package_in_any_other_state_is_missing(status):
    # rc: removed, its configuration left; iU/iF: unpacked or half-configured by an interrupted install.
    assert dpkg_missing(f"nftables\t{status}\n", ["nftables"]) == ["nftables"]


def test_a_multiarch_name_and_a_pinned_or_unknown_name():
    out = "libc6:amd64\tii \nnginx\tii \n"
    assert dpkg_missing(out, ["libc6", "libc6:amd64"]) == []
    # apt decides about what dpkg-query cannot answer: a version pin, a release, a package it does not know.
    assert dpkg_missing(out, ["nginx=1.22.1-9", "nginx/bookworm-backports", "no-such-package"]) == [
        "nginx=1.22.1-9",
        "nginx/bookworm-backports",
        "no-such-package",
    ]


def test_bad_input_is_refused():
    with pytest.raises(AnsibleFilterError, match="not a list"):
        dpkg_missing("", "nginx")
    with pytest.raises(AnsibleFilterError, match="not a text"):
        dpkg_missing(None, ["nginx"])
    assert FilterModule().filters()["dpkg_missing"] is dpkg_missing


@pytest.mark.skipif(shutil.which("dpkg-query") is None, reason="no dpkg-query on this machine (not Debian-based)")
def test_against_the_real_dpkg_query_of_this_machine():
    # The format string the roles pass, and a package every Debian-based system has installed.
    run = subprocess.run(
        ["dpkg-query", "--show", f"--showformat={SHOWFORMAT}", "--", "dpkg", "inferops-no-such-package"],
        capture_output=True, text=True, check=False,
    )
    assert run.returncode == 1  # one name unknown: the roles' failed_when accepts 0 and 1
    assert dpkg_missing(run.stdout, ["dpkg", "inferops-no-such-package"]) == ["inferops-no-such-package"]
