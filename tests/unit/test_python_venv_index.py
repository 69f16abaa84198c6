"""python_venv's index install, run by the real ansible-playbook against a real index on loopback.

The role's two index task files run on localhost as the main entry point runs them: `index_check`
(the host asks the index for every pin, inferops.vllm.pip_index_info) and `install_index` (pip with a
pip.conf in a private temporary directory). The index (tests/unit/fake_index.py) speaks HTTPS with a CA
made here and wants basic authentication; it serves two wheels built here. The password has characters
that URLs and configuration files treat specially (`/`, `%`, `@`, `:`). The tests prove:

- the install works with the credentials and the CA, every request to the index authenticated;
- the password never appears in the output (`-vvv --diff`), in any process's command line or environment
  on the machine while pip runs, and the pip.conf holding it is 0600 in a 0700 directory that is gone
  afterwards;
- a wrong password, a pin the index does not have (404) and a version it does not list stop the role
  at the check, before pip runs, with the host, the package, the index URL and the HTTP status.

Run as root, as CI does (the role makes root own what it writes).
"""

from __future__ import annotations

import base64
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_index import FakeIndex, make_tls, make_wheel, normalise
from test_preflight_inventories import ANSIBLE_PLAYBOOK, REPO, playbook_env

PASSWORD = "s3cr/et%40:p@ss#~1f9c0d"  # noqa: S105 - a test credential
USERNAME = "deployer"
PLAYBOOK = """\
- name: Install from a package index as python_venv does
  hosts: localhost
  connection: local
  gather_facts: false
  tasks:
    - name: Ask the index for the pins
      ansible.builtin.include_role:
        name: inferops.vllm.python_venv
        tasks_from: index_check

    - name: Install from the index
      ansible.builtin.include_role:
        name: inferops.vllm.python_venv
        tasks_from: install_index
"""

pytestmark = [
    pytest.mark.skipif(ANSIBLE_PLAYBOOK is None, reason="ansible-playbook is not installed"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the role makes root own its files (run as root, as CI does)"),
]


def version_dir(venv: Path, fingerprint: dict) -> Path:
    import hashlib

    return venv.with_name(venv.name + ".d") / hashlib.sha256(
        json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:12]


def processes_showing(secret: str) -> list[str]:
    """Processes whose command line or environment holds the secret (root reads them all)."""
    found = []
    needle = secret.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        for part in ("cmdline", "environ"):
            try:
                if needle in (entry / part).read_bytes():
                    found.append(f"{entry.name}/{part}")
            except OSError:
                continue
    return found


class Probe:
    """Looks at the machine while the index is asked: who shows the password, and the pip.conf's modes."""

    def __init__(self, tmpdir: Path):
        self.tmpdir = tmpdir
        self.showing: list[str] = []
        self.confs: dict[str, tuple[int, int, int]] = {}

    def __call__(self, _path: str) -> None:
        self.showing += processes_showing(PASSWORD)
        for conf in self.tmpdir.glob("inferops-pip.*/pip.conf"):
            st, dst = conf.stat(), conf.parent.stat()
            self.confs[str(conf)] = (stat.S_IMODE(st.st_mode), stat.S_IMODE(dst.st_mode), st.st_uid)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    directory = tmp_path_factory.mktemp("wheels")
    return [make_wheel(directory, "inferops-probe", "1.0.0"), make_wheel(directory, "inferops_probe.extra", "2.0")]


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    return make_tls(tmp_path_factory.mktemp("tls"))


def play(tmp_path: Path, index: FakeIndex, ca: Path | None, packages: list[str], nodeps: list[str],
         password: str = PASSWORD) -> tuple[subprocess.CompletedProcess[str], Path, Path]:
    venv = tmp_path / "opt" / "venv"
    fingerprint = {"version": "1.0.0", "source": "index"}
    target = version_dir(venv, fingerprint)
    target.parent.mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "venv", str(target)], check=True, capture_output=True)
    # The variables go in a file: not even this test's own command line carries the password.
    variables = tmp_path / "vars.json"
    variables.write_text(json.dumps({
        "ansible_python_interpreter": sys.executable, "python_venv_path": str(venv),
        "python_venv_fingerprint": fingerprint, "python_venv_label": "probe 1.0.0",
        "python_venv_python": sys.executable, "python_venv_packages": packages,
        "python_venv_nodeps_packages": nodeps, "python_venv_index_url": index.url,
        "python_venv_index_username": USERNAME, "python_venv_index_password": password,
        "python_venv_index_ca_file": str(ca) if ca else "",
    }))
    variables.chmod(0o600)
    playbook = tmp_path / "play.yml"
    playbook.write_text(PLAYBOOK)
    scratch = tmp_path / "remote-tmp"
    scratch.mkdir(exist_ok=True)
    # The machine's own pip and CA settings (a CI runner may have them) must not decide the test.
    env = {k: v for k, v in playbook_env(ANSIBLE_LOCALHOST_WARNING="0", ANSIBLE_INVENTORY_UNPARSED_WARNING="0").items()
           if not k.startswith("PIP_") and k not in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")}
    env["TMPDIR"] = str(scratch)
    run = subprocess.run(
        [ANSIBLE_PLAYBOOK, "-i", "localhost,", str(playbook), "-vvv", "--diff", "-e", f"@{variables}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    return run, target, scratch


def installed(target: Path) -> list[str]:
    out = subprocess.run([str(target / "bin" / "python"), "-m", "pip", "list", "--format=json"],
                         capture_output=True, text=True, check=True).stdout
    return sorted(normalise(p["name"]) for p in json.loads(out))


def test_install_over_tls_with_credentials_never_shows_the_password(tmp_path, wheels, tls):
    ca, cert, key = tls
    scratch = tmp_path / "remote-tmp"
    # Issue #25: a private pip.conf a run that died left two hours ago is removed; a live run's is kept.
    scratch.mkdir(parents=True, exist_ok=True)
    stale, live = scratch / "inferops-pip.stale0", scratch / "inferops-pip.live00"
    for d, age in ((stale, 7200), (live, 60)):
        d.mkdir(mode=0o700)
        (d / "pip.conf").write_text("[global]\nindex-url = https://user:left-behind@index.example/simple\n")
        os.utime(d, (time.time() - age, time.time() - age))
    probe = Probe(scratch)
    with FakeIndex(wheels, USERNAME, PASSWORD, tls=(cert, key), on_request=probe) as index:
        run, target, _scratch = play(tmp_path, index, ca, ["inferops-probe==1.0.0"], ["inferops-probe-extra==2.0"])
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert {"inferops-probe", "inferops-probe-extra"} <= set(installed(target)), installed(target)
    # Every request, from the check and from pip, carried the right credentials.
    assert index.requests and all(auth == "ok" for _path, auth in index.requests), index.requests
    assert any(path.startswith("/files/inferops_probe-1.0.0") for path, _auth in index.requests)
    assert any(path.startswith("/files/inferops_probe_extra-2.0") for path, _auth in index.requests)
    assert not index.errors, index.errors
    # Never in the output, nor in any process's command line or environment while pip ran.
    assert PASSWORD not in output
    assert PASSWORD.replace("/", "%2F") not in output
    assert base64.b64encode(f"{USERNAME}:{PASSWORD}".encode()).decode() not in output
    assert probe.showing == [], probe.showing
    # The pip.conf existed while pip ran, root's and 0600 in a 0700 directory, and is gone.
    probe.confs.pop(str(live / "pip.conf"), None)
    probe.confs.pop(str(stale / "pip.conf"), None)
    assert probe.confs and set(probe.confs.values()) == {(0o600, 0o700, 0)}, probe.confs
    assert list(scratch.glob("inferops-pip.*")) == [live] and not stale.exists()


def test_a_wrong_password_stops_at_the_check_before_pip_runs(tmp_path, wheels, tls):
    ca, cert, key = tls
    with FakeIndex(wheels, USERNAME, PASSWORD, tls=(cert, key)) as index:
        run, target, scratch = play(tmp_path, index, ca, ["inferops-probe==1.0.0"], [], password="not-the-password")
    output = " ".join((run.stdout + run.stderr).split())
    assert run.returncode != 0, output
    assert "localhost: the package index cannot serve probe 1.0.0, so nothing was installed" in output, output
    assert (f"inferops-probe==1.0.0: {index.url}/inferops-probe/ answered HTTP 403 (the index refused the "
            "credentials given)") in output, output
    assert "not-the-password" not in output
    assert not any(path.startswith("/files/") for path, _auth in index.requests), index.requests
    assert "inferops-probe" not in installed(target)
    assert list(scratch.glob("inferops-pip.*")) == []


def test_a_pin_the_index_lacks_stops_with_the_index_answer(tmp_path, wheels):
    with FakeIndex(wheels, USERNAME, PASSWORD) as index:
        run, target, _scratch = play(tmp_path, index, None, ["inferops-probe==1.0.1"], ["no-such-project==1.0"])
    output = " ".join((run.stdout + run.stderr).split())
    assert run.returncode != 0, output
    assert (f"inferops-probe==1.0.1: not found on any index: {index.url}/inferops-probe/ lists inferops-probe but "
            "not version 1.0.1 (highest listed: 1.0.0).") in output, output
    assert (f"no-such-project==1.0: not found on any index: {index.url}/no-such-project/ answered HTTP 404 (the "
            "index has no project no-such-project).") in output, output
    assert PASSWORD not in output
    assert "inferops-probe" not in installed(target)
