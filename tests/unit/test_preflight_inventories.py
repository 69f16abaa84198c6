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
    # conftest.py's client of tests/unit/playbook_server.py: the same ansible-playbook, forked from a process that
    # imported Ansible once (INFEROPS_PLAYBOOK_SERVER=0 runs the command itself).
    if os.environ.get("INFEROPS_ANSIBLE_PLAYBOOK"):
        return os.environ["INFEROPS_ANSIBLE_PLAYBOOK"]
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
    assert "Gathering Facts" not in output
    # Only the preflight's publish tasks of vllm_install ran (set_fact on the controller), none that installs.
    assert not re.search(r"vllm_install : (?!Publish this host's install settings|Validating arguments against arg "
                         r"spec 'publish')", output), output
    _assert_untouched(DEPLOY_CASE, output)


# --- the launcher's refusals and the key rule, in real runs -------------------------------------------

SECRETS = ("sk-live-EXTRA-SECRET-0001", "hf_OVERRIDE_SECRET_0001", "bad instance key SECRET", "short-KEY")


def _secret_case(tmp_path: Path) -> Path:
    """tests/preflight/good with secret-bearing extra args (host-wide and in one instance's overrides), an
    instance key with spaces and a client key that is too short."""
    case = tmp_path / "inventory"
    shutil.copytree(CASES_DIR / GOOD, case)
    (tmp_path / "models").symlink_to(CASES_DIR / "models", target_is_directory=True)
    hosts = (case / "hosts.yml").read_text(encoding="utf-8").replace(
        "      ansible_host: 192.0.2.11\n",
        "      ansible_host: 192.0.2.11\n"
        "      vllm_instance_instances:\n"
        "        - {name: prefill-0, port: 8100, kv_transfer_port: 5600,\n"
        f"           overrides: {{extra_args: ['--hf-token={SECRETS[1]}']}}}}\n")
    (case / "hosts.yml").write_text(hosts, encoding="utf-8")
    all_yml = case / "group_vars" / "all.yml"
    text = all_yml.read_text(encoding="utf-8")
    text, count = re.subn(r"^vllm_instance_api_key: .*$", f"vllm_instance_api_key: '{SECRETS[2]}'", text, flags=re.M)
    assert count == 1
    text, count = re.subn(r"^vllm_router_api_keys:\n", f"vllm_router_api_keys:\n  - {SECRETS[3]}\n", text, flags=re.M)
    assert count == 1
    text += f"vllm_instance_extra_args: ['--max-log-len', '100', '--api-key', '{SECRETS[0]}']\n"
    all_yml.write_text(text, encoding="utf-8")
    return case


def test_launcher_refusals_and_bad_keys_stop_the_preflight_without_showing_them(tmp_path):
    case = _secret_case(tmp_path)
    run = subprocess.run(
        [ANSIBLE_PLAYBOOK, "-i", str(case), str(REPO / "playbooks" / "preflight.yml")],
        cwd=REPO, env=playbook_env(), capture_output=True, text=True, timeout=180, check=False,
    )
    output = _output(run)
    assert run.returncode != 0, output
    for pattern in (
        r"PD preflight: 4 problem\(s\); no host was contacted or changed\.",
        r"\[launcher\] prefill-1/prefill-0: vllm_instance_instances\[prefill-0\]\.overrides\.extra_args: the launcher "
        r"on the host would refuse the instance's extra\.args\[0\]: \"--hf-token\" is not allowed",
        r"\[launcher\] decode-1/decode-0: vllm_instance_extra_args: the launcher on the host would refuse the "
        r"instance's extra\.args\[2\]: \"--api-key\" is not allowed: .* Fix: name a keys file with "
        r"server\.api_keys_file",
        r"\[secrets\] prefill-1, decode-1: vllm_instance_api_key: is not a usable key \(not shown\)",
        r"\[secrets\] router-1: vllm_router_api_keys: 1 of its keys is not usable \(not shown\)",
    ):
        assert re.search(pattern, output), f"{pattern!r} not in:\n{output}"
    for secret in SECRETS:
        assert secret not in output, secret
    recap = {m[1]: tuple(int(x) for x in m.groups()[1:]) for m in RECAP_RE.finditer(output)}
    assert set(recap) == {"prefill-1", "decode-1", "router-1"}, output
    assert all(counts[1] == 0 and counts[2] == 0 for counts in recap.values()), output


def test_a_short_drain_is_an_ansible_warning_and_the_preflight_passes(tmp_path):
    """tests/preflight/good with 8192-token requests: decode-1's 60 s drain is shorter than one of them at
    20 tokens/s (410 s). The preflight passes and says so as an Ansible warning, naming host, instance,
    variable and the number; a per-instance override long enough silences it."""
    case = tmp_path / "inventory"
    shutil.copytree(CASES_DIR / GOOD, case)
    (tmp_path / "models").symlink_to(CASES_DIR / "models", target_is_directory=True)
    all_yml = case / "group_vars" / "all.yml"
    text, count = re.subn(r"^vllm_instance_max_model_len: .*$", "vllm_instance_max_model_len: 8192",
                          all_yml.read_text(encoding="utf-8"), flags=re.M)
    assert count == 1
    all_yml.write_text(text, encoding="utf-8")

    def run() -> str:
        done = subprocess.run(
            [ANSIBLE_PLAYBOOK, "-i", str(case), str(REPO / "playbooks" / "preflight.yml")],
            cwd=REPO, env=playbook_env(), capture_output=True, text=True, timeout=180, check=False,
        )
        output = _output(done)
        assert done.returncode == 0, output
        assert "PD preflight passed" in output, output
        return " ".join(output.split())  # warnings are wrapped to the terminal's width

    output = run()
    assert re.search(r"\[WARNING\]: PD preflight: \[drain\] decode-1/decode-0: vllm_instance_shutdown_timeout: "
                     r"is 60 s, but one request of max_model_len 8192 tokens at inferops_min_tokens_per_second "
                     r"20 tokens/s takes 410 s", output), output
    assert "raise it to at least 410" in output and "prefill-1/prefill-0" not in output
    hosts = (case / "hosts.yml").read_text(encoding="utf-8").replace(
        "      ansible_host: 192.0.2.21\n",
        "      ansible_host: 192.0.2.21\n"
        "      vllm_instance_instances:\n"
        "        - {name: decode-0, port: 8200, kv_transfer_port: 5700, overrides: {shutdown_timeout: 410}}\n")
    (case / "hosts.yml").write_text(hosts, encoding="utf-8")
    assert "[drain]" not in run()


# The vllm_instance role's own preflight (what deploy_pd.yml and the role run before changing a host),
# on localhost: after gathering network facts it runs only controller-side actions (assert, set_fact).
ROLE_PREFLIGHT = """\
- name: The vllm_instance role's preflight
  hosts: localhost
  # The role's argument spec resolves vllm_instance_host_address's default, which needs network facts.
  gather_facts: true
  gather_subset: [network]
  vars:
    vllm_instance_model: HuggingFaceTB/SmolLM2-135M-Instruct
    # A hub model needs a commit (the role refuses a branch); this one is only a well-formed stand-in.
    vllm_instance_model_revision: 0123456789abcdef0123456789abcdef01234567
    vllm_instance_host_address: "{{ lookup('ansible.builtin.env', 'TEST_HOST_ADDRESS') | default('127.0.0.1', true) }}"
    vllm_instance_api_key: "{{ lookup('ansible.builtin.env', 'TEST_INSTANCE_KEY') }}"
    vllm_instance_extra_args: "{{ lookup('ansible.builtin.env', 'TEST_EXTRA_ARGS') | from_json }}"
    vllm_instance_kv_cache_dtype: "{{ lookup('ansible.builtin.env', 'TEST_KV_CACHE_DTYPE') }}"
  tasks:
    - name: Run it
      ansible.builtin.include_role:
        name: inferops.vllm.vllm_instance
        tasks_from: preflight
    - name: And its check of the host's address (deploy_pd.yml runs both before any change)
      ansible.builtin.include_role:
        name: inferops.vllm.vllm_instance
        tasks_from: host_address
"""
ROLE_RUNS = {
    # A key that breaks the EnvironmentFile: refused by the no_log key check, before the launcher check.
    "bad_key": {"TEST_INSTANCE_KEY": "bad key SECRET\nX=1", "TEST_EXTRA_ARGS": "[]", "TEST_KV_CACHE_DTYPE": "auto"},
    "secret_args": {"TEST_INSTANCE_KEY": "good-instance-key-000001",
                    "TEST_EXTRA_ARGS": '["--max-log-len", "100", "--hf-token=hf_ROLE_SECRET"]',
                    "TEST_KV_CACHE_DTYPE": "auto"},
    # Values of the vocabulary the old role lists lacked pass.
    "good": {"TEST_INSTANCE_KEY": "", "TEST_EXTRA_ARGS": '["--max-log-len", "100"]', "TEST_KV_CACHE_DTYPE": "fp8_e5m2"},
    # A value the argument spec's choices used to refuse with "must be one of": the preflight says why.
    "int4_kv": {"TEST_INSTANCE_KEY": "", "TEST_EXTRA_ARGS": "[]", "TEST_KV_CACHE_DTYPE": "int4"},
    # An address this machine does not have (TEST-NET-3): the controller's preflight cannot know, the role's can.
    "foreign_address": {"TEST_INSTANCE_KEY": "", "TEST_EXTRA_ARGS": "[]", "TEST_KV_CACHE_DTYPE": "auto",
                        "TEST_HOST_ADDRESS": "203.0.113.77"},
}


@pytest.fixture(scope="module")
def role_runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess[str]]:
    playbook = tmp_path_factory.mktemp("role-preflight") / "preflight.yml"
    playbook.write_text(ROLE_PREFLIGHT, encoding="utf-8")

    def run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [ANSIBLE_PLAYBOOK, "-i", "localhost,", "-c", "local", "-e", f"ansible_python_interpreter={sys.executable}",
             str(playbook)],
            cwd=REPO, env=playbook_env(ANSIBLE_LOCALHOST_WARNING="0", **env), capture_output=True, text=True,
            timeout=180, check=False,
        )

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(run, env) for name, env in ROLE_RUNS.items()}
        return {name: future.result() for name, future in futures.items()}


def test_the_roles_preflight_refuses_a_bad_instance_key_without_showing_it(role_runs):
    run = role_runs["bad_key"]
    output = _output(run)
    assert run.returncode != 0, output
    assert re.search(r"TASK \[inferops\.vllm\.vllm_instance : Check vllm_instance_api_key .*\]", output), output
    assert re.search(r"fatal: \[localhost\]: FAILED!.*censored", output, re.DOTALL), output
    assert "SECRET" not in output
    assert "Check each instance's settings as its launcher will" not in output  # it stopped at the key


def test_the_roles_preflight_refuses_what_the_launcher_would_without_showing_secrets(role_runs):
    run = role_runs["secret_args"]
    output = _output(run)
    assert run.returncode != 0, output
    assert "localhost: the launcher would refuse these settings:" in output, output
    assert re.search(r"\[launcher\] localhost/vllm-0: vllm_instance_extra_args: the launcher on the host would refuse "
                     r"the instance's extra\.args\[2\]: \\?\"--hf-token\\?\" is not allowed", output), output
    assert "hf_ROLE_SECRET" not in output


def test_the_roles_preflight_accepts_what_the_launcher_accepts(role_runs):
    run = role_runs["good"]
    assert run.returncode == 0, _output(run)


def test_the_roles_preflight_says_why_a_kv_cache_dtype_is_refused(role_runs):
    """No `choices` in the argument spec hides the preflight's message behind "must be one of"."""
    run = role_runs["int4_kv"]
    output = _output(run)
    assert run.returncode != 0, output
    assert "value of vllm_instance_kv_cache_dtype must be one of" not in output, output
    assert re.search(r"\[launcher\] localhost/vllm-0: vllm_instance_kv_cache_dtype: the launcher on the host would "
                     r"refuse the instance's kv_cache\.quant_dtype: vLLM 0\.32 has no 4-bit KV cache", output), output


def test_the_roles_preflight_refuses_an_address_the_host_does_not_have(role_runs):
    """The address the instances bind their NIXL side channel to and the routers reach them at: checked against
    the host's address facts before any change (issue #24), where it used to fail only when vLLM started."""
    run = role_runs["foreign_address"]
    output = " ".join(_output(run).split())  # the YAML callback folds long messages
    assert run.returncode != 0, output
    task = "TASK [inferops.vllm.vllm_instance : Check that vllm_instance_host_address is one of this host's addresses]"
    assert task in _output(run), output
    assert "[network] localhost: vllm_instance_host_address: is '203.0.113.77', which is not an address of this host" \
        in output, output
    assert re.search(r"changed=0 .*failed=1", output), output


def test_the_docs_count_the_inventories_this_file_runs():
    """docs/testing.md says how many inventories run through preflight.yml: the count follows the cases (it once
    said 38 when there were 56)."""
    text = " ".join((REPO / "docs" / "testing.md").read_text(encoding="utf-8").split())
    found = re.search(r"(\d+) inventories run through `preflight\.yml` \((\d+) bad ones", text)
    assert found, "docs/testing.md no longer says how many inventories run through preflight.yml"
    assert (int(found.group(1)), int(found.group(2))) == (len(CASES), len(BAD)), (
        f"docs/testing.md says {found.group(0)!r}; tests/preflight has {len(CASES)} cases, {len(BAD)} bad: "
        "update the sentence")
