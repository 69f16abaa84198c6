"""Run playbooks/preflight.yml on every inventory under tests/preflight/ with the real ansible-playbook.

Each case is a directory with hosts.yml, group_vars/ and expected.txt (one regular expression a line,
each of which the output must match). `good` must pass; every other case must fail with its own
message, naming the check that failed. Every host sits on an unroutable TEST-NET-1 address over SSH,
so any attempt to contact one would show up as unreachable: the recap must say changed=0 and
unreachable=0 for every host. One bad case also runs through deploy_pd.yml itself, which must stop
at the preflight before its first host-level play.

The runs go two at a time (a thread pool of 2); the whole file takes well under a minute.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CASES_DIR = REPO / "tests" / "preflight"
CASES = sorted(d.name for d in CASES_DIR.iterdir() if (d / "hosts.yml").is_file())
GOOD = "good"
BAD = [c for c in CASES if c != GOOD]
# The bad case deploy_pd.yml is run on.
DEPLOY_CASE = "many_problems"
RECAP_RE = re.compile(r"^(\S+)\s+: ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.MULTILINE)


def _ansible_playbook() -> str | None:
    beside = Path(sys.executable).parent / "ansible-playbook"
    return str(beside) if beside.is_file() else shutil.which("ansible-playbook")


def _collections_path() -> str:
    # conftest.py put a root holding ansible_collections/inferops/vllm -> this checkout on sys.path;
    # the other collections (community.general for deploy_pd.yml's roles) come from the usual places.
    ours = next(p for p in sys.path if (Path(p) / "ansible_collections" / "inferops" / "vllm").is_dir())
    extra = os.environ.get("ANSIBLE_COLLECTIONS_PATH") or str(REPO / ".ansible" / "collections")
    return os.pathsep.join([ours, extra, str(Path.home() / ".ansible" / "collections")])


ANSIBLE_PLAYBOOK = _ansible_playbook()
pytestmark = pytest.mark.skipif(ANSIBLE_PLAYBOOK is None, reason="ansible-playbook is not installed")


def playbook_env(**extra: str) -> dict[str, str]:
    """The environment of a test's ansible-playbook run: this checkout's config and collections, plain
    output, and a fast failure were anything to try SSH."""
    return {
        **os.environ,
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "ANSIBLE_COLLECTIONS_PATH": _collections_path(),
        "ANSIBLE_FORCE_COLOR": "0",
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.default",
        "ANSIBLE_CALLBACK_RESULT_FORMAT": "yaml",
        "ANSIBLE_TIMEOUT": "3",
        "ANSIBLE_SSH_RETRIES": "0",
        **extra,
    }


def _run(playbook: str, case: str) -> subprocess.CompletedProcess[str]:
    env = playbook_env()
    return subprocess.run(
        [ANSIBLE_PLAYBOOK, "-i", str(CASES_DIR / case), str(REPO / "playbooks" / playbook)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180, check=False,
    )


@pytest.fixture(scope="module")
def runs() -> dict[str, subprocess.CompletedProcess[str]]:
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {("deploy_pd.yml", DEPLOY_CASE): pool.submit(_run, "deploy_pd.yml", DEPLOY_CASE)}
        futures.update({("preflight.yml", case): pool.submit(_run, "preflight.yml", case) for case in CASES})
        return {key: future.result() for key, future in futures.items()}


def _output(run: subprocess.CompletedProcess[str]) -> str:
    return run.stdout + run.stderr


def _expected(case: str) -> list[str]:
    lines = (CASES_DIR / case / "expected.txt").read_text(encoding="utf-8").splitlines()
    return [line for line in lines if line.strip()]


def _hosts(case: str) -> set[str]:
    hosts_yml = (CASES_DIR / case / "hosts.yml").read_text(encoding="utf-8")
    return set(re.findall(r"^    ([\w.-]+):$", hosts_yml, re.MULTILINE))


def _assert_untouched(case: str, output: str) -> dict[str, tuple[int, ...]]:
    recap = {m[1]: tuple(int(x) for x in m.groups()[1:]) for m in RECAP_RE.finditer(output)}
    assert set(recap) == _hosts(case), f"recap hosts {sorted(recap)} != inventory hosts:\n{output}"
    for host, (_ok, changed, unreachable, _failed) in recap.items():
        assert changed == 0 and unreachable == 0, f"{case}: {host} changed={changed} unreachable={unreachable}"
    return recap


def test_there_are_enough_cases():
    assert GOOD in CASES
    assert len(BAD) >= 20, BAD
    for case in CASES:
        assert (CASES_DIR / case / "group_vars").is_dir() and _expected(case), case


def test_the_good_inventory_passes(runs):
    run = runs[("preflight.yml", GOOD)]
    output = _output(run)
    assert run.returncode == 0, output
    for pattern in _expected(GOOD):
        assert re.search(pattern, output), f"{pattern!r} not in:\n{output}"
    recap = _assert_untouched(GOOD, output)
    assert all(counts[-1] == 0 for counts in recap.values()), output


@pytest.mark.parametrize("case", BAD)
def test_each_bad_inventory_fails_with_its_own_message(runs, case):
    run = runs[("preflight.yml", case)]
    output = _output(run)
    assert run.returncode != 0, output
    assert re.search(r"PD preflight: \d+ problem\(s\); no host was contacted or changed\.", output), output
    for pattern in _expected(case):
        assert re.search(pattern, output), f"{case}: {pattern!r} not in:\n{output}"
    # The output says which check failed: the expected lines name it ([groups], [ports], ...).
    assert any(re.match(r"(\\\[|PD preflight)", p) for p in _expected(case)), case
    assert "Gathering Facts" not in output
    _assert_untouched(case, output)


def test_deploy_pd_stops_at_the_preflight_and_changes_nothing(runs):
    run = runs[("deploy_pd.yml", DEPLOY_CASE)]
    output = _output(run)
    assert run.returncode != 0, output
    for pattern in _expected(DEPLOY_CASE):
        assert re.search(pattern, output), f"{pattern!r} not in:\n{output}"
    # Not one host-level play started: no facts gathered, no role task, nothing installed.
    assert "PLAY [Check the inventory before changing any host]" not in output
    assert "Gathering Facts" not in output and "vllm_install :" not in output
    _assert_untouched(DEPLOY_CASE, output)
