"""python_venv's versioned layout: the switch and prune entry points, run by the real ansible-playbook.

Each install lives in "<venv>.d/<first 12 hex digits of the SHA-256 of the fingerprint as JSON with
sorted keys>" and the venv path is a symlink to the live one. The tests build version directories
(with the role's marker file) in a temporary directory and run the role's `switch` and `prune`
entry points on localhost, from a role that includes them (python_venv refuses a play that calls it
itself: test_python_venv_internal.py): the migration of a venv directory of an earlier release to
"<venv>.d/legacy" by a rename (an open file stays readable), the link's switches and their
idempotence, the refusal of an unfinished install, check mode, and what prune removes and keeps.
The main entry point is not run here: it installs system packages with apt.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_preflight_inventories import ANSIBLE_PLAYBOOK, RECAP_RE
from test_python_venv_internal import run, stand_in_caller

MARKER = ".inferops-vllm-install.json"

pytestmark = [
    pytest.mark.skipif(ANSIBLE_PLAYBOOK is None, reason="ansible-playbook is not installed"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the role makes root own the link (run as root, as CI does)"),
]


def version(fingerprint: dict) -> str:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:12]


def install(venv: Path, fingerprint: dict, mtime: float | None = None, marker: bool = True) -> Path:
    """A stand-in for what the main entry point leaves: a version directory with its marker."""
    directory = venv.with_name(venv.name + ".d") / version(fingerprint)
    (directory / "bin").mkdir(parents=True)
    (directory / "bin" / "python").write_text("")
    if marker:
        (directory / MARKER).write_text(json.dumps(fingerprint, indent=2) + "\n")
    if mtime is not None:
        os.utime(directory, (mtime, mtime))
    return directory


def play(tmp_path: Path, entry_point: str, *args: str, **extra) -> tuple[subprocess.CompletedProcess[str], str, int]:
    # python_venv refuses a play that calls it itself: a stand-in for vllm_install and vllm_router includes it.
    result, output = run(stand_in_caller(tmp_path), entry_point, *args, **extra)
    recap = RECAP_RE.search(result.stdout)
    return result, output, int(recap.group(3)) if recap else -1


def test_switch_moves_an_earlier_venv_aside_then_switches_only_on_a_new_target(tmp_path):
    venv = tmp_path / "opt" / "venv"
    (venv / "lib").mkdir(parents=True)
    (venv / "lib" / "module.py").write_text("old = True\n")
    inode = venv.stat().st_ino
    first, second = {"version": "1.0.0", "source": "index"}, {"version": "2.0.0", "source": "index"}
    v1, v2 = install(venv, first), install(venv, second)
    with (venv / "lib" / "module.py").open() as running:  # a process of the earlier release
        run, output, changed = play(tmp_path, "switch", python_venv_path=str(venv), python_venv_fingerprint=first)
        assert run.returncode == 0, output
        assert running.read() == "old = True\n"
    legacy = venv.with_name("venv.d") / "legacy"
    assert legacy.stat().st_ino == inode, "renamed, not copied"
    assert (legacy / "lib" / "module.py").is_file()
    assert venv.is_symlink() and os.readlink(venv) == str(v1)
    assert changed > 0

    run, output, changed = play(tmp_path, "switch", python_venv_path=str(venv), python_venv_fingerprint=first)
    assert run.returncode == 0 and changed == 0, output

    run, output, changed = play(tmp_path, "switch", "--check", python_venv_path=str(venv),
                                python_venv_fingerprint=second)
    assert run.returncode == 0, output
    assert f"Check mode: {venv} would point to {v2} instead of {v1}" in output, output
    assert os.readlink(venv) == str(v1)

    run, output, changed = play(tmp_path, "switch", python_venv_path=str(venv), python_venv_fingerprint=second)
    assert run.returncode == 0 and changed > 0, output
    assert os.readlink(venv) == str(v2)
    assert v2.stat().st_mtime > v1.stat().st_mtime, "the version made live is marked as the most recent"


def test_switch_refuses_an_unfinished_install(tmp_path):
    venv = tmp_path / "venv"
    done, unfinished = {"version": "1.0.0"}, {"version": "2.0.0"}
    v1 = install(venv, done)
    v2 = install(venv, unfinished, marker=False)
    venv.symlink_to(v1)
    run, output = play(tmp_path, "switch", python_venv_path=str(venv), python_venv_fingerprint=unfinished)[:2]
    assert run.returncode != 0, output
    assert f"{v2} holds no finished test install" in output, output
    assert os.readlink(venv) == str(v1)


def test_prune_keeps_the_live_install_and_the_most_recent_others(tmp_path):
    venv = tmp_path / "venv"
    live = install(venv, {"version": "1.0.0"}, mtime=1_000)  # the oldest, but live
    newest = install(venv, {"version": "4.0.0"}, mtime=4_000)
    middle = install(venv, {"version": "3.0.0"}, mtime=3_000)
    oldest = install(venv, {"version": "2.0.0"}, mtime=2_000)
    legacy = venv.with_name("venv.d") / "legacy"
    legacy.mkdir()
    os.utime(legacy, (500, 500))
    venv.symlink_to(live)

    run, output, changed = play(tmp_path, "prune", "--check", python_venv_path=str(venv), python_venv_keep_previous=1)
    assert run.returncode == 0, output
    assert f"would remove {middle}, {oldest}, {legacy}; kept {newest}" in output, output
    assert all(d.is_dir() for d in (live, newest, middle, oldest, legacy)), "check mode removed something"

    run, output, changed = play(tmp_path, "prune", python_venv_path=str(venv), python_venv_keep_previous=1)
    assert run.returncode == 0 and changed > 0, output
    assert f"live {live}; removed {middle}, {oldest}, {legacy}; kept {newest}" in output, output
    assert sorted(p.name for p in venv.with_name("venv.d").iterdir()) == sorted([live.name, newest.name])

    run, output, changed = play(tmp_path, "prune", python_venv_path=str(venv), python_venv_keep_previous=0)
    assert run.returncode == 0, output
    assert [p.name for p in venv.with_name("venv.d").iterdir()] == [live.name]
    assert venv.resolve() == live


def test_prune_removes_nothing_without_a_link_into_the_versions_directory(tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()  # a venv of an earlier release, not migrated yet
    other = install(venv, {"version": "1.0.0"})
    run, output, changed = play(tmp_path, "prune", python_venv_path=str(venv), python_venv_keep_previous=0)
    assert run.returncode == 0 and changed == 0, output
    assert f"{venv} is not a symlink to an install in {venv}.d, so nothing was removed" in output, output
    assert other.is_dir()

    run, output = play(tmp_path, "prune", python_venv_path=str(venv), python_venv_keep_previous=-1)[:2]
    assert run.returncode != 0 and "python_venv_keep_previous must be a whole number" in output, output


def test_prune_keeps_an_install_a_process_still_uses_and_says_which(tmp_path):
    """A version directory that a running process still uses (as its working directory, in its command line as the
    launcher starts vLLM, or through a mapped file, as vLLM maps torch's libraries) is kept and named with the
    process; once the process is gone, the next prune removes it. Unused ones go at once."""
    venv = tmp_path / "venv"
    live = install(venv, {"version": "5.0.0"}, mtime=5_000)
    as_cwd = install(venv, {"version": "4.0.0"}, mtime=4_000)
    as_argv = install(venv, {"version": "3.0.0"}, mtime=3_000)
    as_map = install(venv, {"version": "2.0.0"}, mtime=2_000)
    unused = install(venv, {"version": "1.0.0"}, mtime=1_000)
    venv.symlink_to(live)
    (as_argv / "bin" / "python3").symlink_to(sys.executable)  # a venv's python, as vLLM's argv[0] names it
    (as_map / "lib.so").write_bytes(b"\0" * 4096)
    sleep = "import time; time.sleep(120)"
    # The mapped file's path in the environment, not the command line: the map alone must keep it.
    mapper = ("import mmap, os, time; f = open(os.environ['MAPPED'], 'rb'); m = mmap.mmap(f.fileno(), 0,"
              " prot=mmap.PROT_READ); f.close(); print('mapped', flush=True); time.sleep(120)")
    processes = [
        subprocess.Popen([sys.executable, "-c", sleep], cwd=as_cwd),
        subprocess.Popen([str(as_argv / "bin" / "python3"), "-c", sleep], cwd=tmp_path),
        subprocess.Popen([sys.executable, "-c", mapper], cwd=tmp_path, stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "MAPPED": str(as_map / "lib.so")}),
    ]
    try:
        assert processes[2].stdout.readline() == "mapped\n"
        run, output, changed = play(tmp_path, "prune", python_venv_path=str(venv), python_venv_keep_previous=0)
        assert run.returncode == 0, output
        assert f"live {live}; removed {unused};" in output, output
        for directory, process, how in ((as_cwd, processes[0], f"working directory {as_cwd}"),
                                        (as_argv, processes[1], f"command line {as_argv}/bin/python3"),
                                        (as_map, processes[2], f"maps {as_map}/lib.so")):
            assert f"kept {directory}, in use by pid {process.pid} (" in output, output
            assert how in output, output
            assert directory.is_dir()
        assert not unused.exists()
    finally:
        for process in processes:
            process.kill()
            process.wait()
    run, output, changed = play(tmp_path, "prune", python_venv_path=str(venv), python_venv_keep_previous=0)
    assert run.returncode == 0 and changed > 0, output
    assert "in use by" not in output, output
    assert [p.name for p in venv.with_name("venv.d").iterdir()] == [live.name]
