"""tests/unit/playbook_server.py: a run through its client is the real ansible-playbook's run (arguments,
environment, working directory, output, exit status), the server serves the runs after the first, a run the
server cannot take runs the real command, and a killed client takes its run with it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from playbook_server import server_key, write_client

REAL = Path(sys.executable).parent / "ansible-playbook"
pytestmark = pytest.mark.skipif(not REAL.is_file(), reason="ansible-playbook is not installed beside this Python")

PLAY = """\
- name: What a run sees
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Say the environment, the working directory's file and the extra var
      ansible.builtin.debug:
        msg: >-
          {{ lookup('ansible.builtin.env', 'SERVER_TEST_WORD') }} {{ lookup('ansible.builtin.file', 'here.txt') }}
          {{ word }}
    - name: Sleep when asked (the kill test)
      ansible.builtin.command: "sleep {{ sleep }}"
      changed_when: false
      when: sleep | float > 0
    - name: Fail with a word
      ansible.builtin.fail:
        msg: "failed {{ word }}"
"""


def _env(tmp: Path) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k != "INFEROPS_ANSIBLE_PLAYBOOK"},
            "ANSIBLE_NOCOLOR": "1", "ANSIBLE_LOCALHOST_WARNING": "0", "ANSIBLE_INVENTORY_UNPARSED_WARNING": "0",
            "ANSIBLE_LOCAL_TEMP": str(tmp / "ansible-local"), "SERVER_TEST_WORD": "environment",
            "INFEROPS_PLAYBOOK_SERVER_LOG": str(tmp / "runs.log")}


def _how(tmp: Path) -> list[str]:
    """How each run of the client went, in order (playbook_server's log)."""
    path = tmp / "runs.log"
    return [line.split()[0] for line in path.read_text(encoding="utf-8").splitlines()] if path.exists() else []


def _run(command: str, tmp: Path, word: str, sleep: float = 0, timeout: float = 120):
    return subprocess.run([command, "-e", f"word={word}", "-e", f"sleep={sleep}", str(tmp / "play.yml")],
                          cwd=tmp, env=_env(tmp), capture_output=True, text=True, timeout=timeout, check=False)


def _lines(output: str) -> list[str]:
    # The parts of the output a run decides (not the timing or the warnings Python prints at import).
    return [line for line in output.splitlines() if "msg" in line or line.startswith(("TASK", "PLAY", "localhost"))]


@pytest.fixture
def tmp():
    # A short path: a server's socket path must fit in 108 bytes (pytest's tmp_path can be longer).
    path = Path(tempfile.mkdtemp(prefix="inferops-ps-"))
    (path / "play.yml").write_text(PLAY, encoding="utf-8")
    (path / "here.txt").write_text("working-directory", encoding="utf-8")
    (path / "servers").mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _server_pids(directory: Path) -> list[int]:
    found = subprocess.run(["pgrep", "-f", f"playbook_server.py serve {directory}/"], capture_output=True, text=True,
                           check=False)
    return [int(pid) for pid in found.stdout.split()]


def _server_listens(tmp: Path) -> bool:
    """Whether the server of the test's environment made its socket (within 10 s)."""
    socket_path = tmp / "servers" / f"{server_key(_env(tmp), str(tmp))}.sock"
    for _attempt in range(100):
        if socket_path.exists():
            return True
        time.sleep(0.1)
    return False


def test_a_served_run_is_the_real_run_and_the_server_serves_the_next(tmp):
    client = write_client(str(tmp / "servers"), str(REAL))
    real = _run(str(REAL), tmp, "one")
    first = _run(client, tmp, "one")  # the real command
    second = _run(client, tmp, "one")  # starts the server, runs the real command
    assert _server_listens(tmp), "the second run did not start a server"
    served = _run(client, tmp, "one")
    for run in (real, first, second, served):
        assert run.returncode == 2, run.stdout + run.stderr
        assert "environment working-directory one" in run.stdout, run.stdout
        assert "failed one" in run.stdout, run.stdout
    assert _lines(served.stdout) == _lines(real.stdout)
    assert _how(tmp) == ["real:no-server", "real:no-server", "served"]
    # Another extra var: the same server, another run.
    assert "failed two" in _run(client, tmp, "two").stdout
    assert _how(tmp)[-1] == "served"


def test_a_run_the_server_cannot_take_runs_the_real_command_and_the_server_ends_with_its_directory(tmp):
    client = write_client(str(tmp / "servers"), str(REAL))
    _run(client, tmp, "one")
    _run(client, tmp, "one")  # starts the server
    assert _server_listens(tmp)
    pids = _server_pids(tmp / "servers")
    assert pids, "no server is running"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    run = _run(client, tmp, "three")  # the socket is there, nobody listens: the real command
    assert run.returncode == 2 and "failed three" in run.stdout, run.stdout + run.stderr
    assert _how(tmp)[-1] == "real:no-server"
    # The run started a new server; removing the directory ends it.
    for _attempt in range(100):
        if _server_pids(tmp / "servers"):
            break
        time.sleep(0.1)
    assert _server_pids(tmp / "servers")
    subprocess.run(["rm", "-rf", str(tmp / "servers")], check=True)
    for _attempt in range(50):
        if not _server_pids(tmp / "servers"):
            break
        time.sleep(0.1)
    assert not _server_pids(tmp / "servers"), "the server outlived its directory"


def test_a_killed_client_takes_its_run_with_it(tmp):
    client = write_client(str(tmp / "servers"), str(REAL))
    _run(client, tmp, "one")
    _run(client, tmp, "one")  # starts the server
    assert _server_listens(tmp)
    marker = f"47.{os.getpid()}{time.monotonic_ns() % 100000}"  # sleep's argument: this run's only
    with pytest.raises(subprocess.TimeoutExpired):
        _run(client, tmp, "four", sleep=float(marker), timeout=8)
    for _attempt in range(50):
        left = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True, text=True, check=False)
        if not left.stdout.strip():
            break
        time.sleep(0.1)
    assert not left.stdout.strip(), f"the run outlived its killed client: {left.stdout}"
    assert _how(tmp)[-1] == "served"
