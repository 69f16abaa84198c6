"""vllm_instance with a Hugging Face model, run by the real ansible-playbook on localhost, without the hub.

- `tasks_from: model` with the hub out of reach (vllm_instance_hf_endpoint on a closed port) and a token: the
  role stops with the host, the model, the revision and the hub; the token is in no output (`-vvv --diff`), in
  no process's command line or environment, and its private file is gone.
- The same against a fake hub API with a stub huggingface_hub (tests/unit/fake_hub.py): downloaded once
  (changed), and a second run changes nothing and does not ask the hub.
- `tasks_from: preflight` refuses a hub model whose revision is a branch (`main`) or empty, before any change,
  and accepts a commit.

The vLLM venv's Python is this test's Python (a link in a temporary venv path) with the stub on PYTHONPATH.
Run as root, as CI does.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_hub import COMMIT, FakeHub, stub_huggingface_hub
from test_preflight_inventories import ANSIBLE_PLAYBOOK, RECAP_RE, REPO, playbook_env

TOKEN = "hf_RoleTestTokenAbcdefghijklmnop0123"  # noqa: S105 - a test credential
MODEL = "example-org/tiny-model"
PLAYBOOK = """\
- name: Run an entry point of vllm_instance
  hosts: all
  gather_facts: {facts}
  tasks:
    - name: Include the entry point
      ansible.builtin.include_role:
        name: inferops.vllm.vllm_instance
        tasks_from: {entry}
"""

pytestmark = [
    pytest.mark.skipif(ANSIBLE_PLAYBOOK is None, reason="ansible-playbook is not installed"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the role makes root own the model (run as root, as CI does)"),
]


def processes_showing(secret: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            for part in ("cmdline", "environ"):
                try:
                    if secret.encode() in (entry / part).read_bytes():
                        found.append(f"{entry.name}/{part}")
                except OSError:
                    continue
    return found


def play(tmp_path: Path, entry: str, hosts: dict[str, dict], facts: bool = False) -> str:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    if not (venv / "bin" / "python").exists():
        (venv / "bin" / "python").symlink_to(sys.executable)
    playbook = tmp_path / f"{entry}.yml"
    playbook.write_text(PLAYBOOK.format(entry=entry, facts=str(facts).lower()))
    inventory = tmp_path / "hosts.json"
    common = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
              "vllm_install_venv": str(venv), "vllm_instance_models_dir": str(tmp_path / "models"),
              "vllm_instance_model": MODEL, "vllm_install_group": "root"}
    inventory.write_text(json.dumps({"all": {"hosts": {h: {**common, **v} for h, v in hosts.items()}}}))
    inventory.chmod(0o600)
    scratch = tmp_path / "remote-tmp"
    scratch.mkdir(exist_ok=True)
    env = {k: v for k, v in playbook_env(ANSIBLE_LOCALHOST_WARNING="0").items() if not k.startswith("HF_")}
    env.update(TMPDIR=str(scratch), PYTHONPATH=str(stub_huggingface_hub(tmp_path / "stub")),
               INFEROPS_STUB_LOG=str(tmp_path / "calls.jsonl"), ANSIBLE_FORKS="8")
    run = subprocess.run([ANSIBLE_PLAYBOOK, "-i", str(inventory), str(playbook), "-vvv", "--diff"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    return run.stdout + run.stderr


def recap(output: str) -> dict[str, tuple[int, ...]]:
    return {m[1]: tuple(int(x) for x in m.groups()[1:]) for m in RECAP_RE.finditer(output)}


def _leftovers(scratch: Path, prefix: str) -> tuple[Path, Path]:
    """A private directory a run that died left two hours ago (with a secret in it), and one of a run that is
    still going (a minute old): issue #25 - the next run removes the first, never the second."""
    scratch.mkdir(parents=True, exist_ok=True)
    stale, live = scratch / f"{prefix}.stale0", scratch / f"{prefix}.live00"
    for d, age in ((stale, 7200), (live, 60)):
        d.mkdir(mode=0o700)
        (d / "secret").write_text("left-behind-secret")
        os.utime(d, (time.time() - age, time.time() - age))
    return stale, live


def test_an_unreachable_hub_stops_the_host_naming_model_revision_and_hub(tmp_path):
    stale, live = _leftovers(tmp_path / "remote-tmp", "inferops-hf")
    output = play(tmp_path, "model", {"web-1": {"vllm_instance_model_revision": COMMIT, "vllm_instance_hf_token": TOKEN,
                                                "vllm_instance_hf_endpoint": "http://127.0.0.1:9"}})
    flat = " ".join(output.split())
    assert recap(output)["web-1"][3] == 1, output
    assert (f"web-1: inferops_hf_fetch: cannot download model {MODEL} at revision {COMMIT} from http://127.0.0.1:9: "
            "the hub cannot be reached") in flat, flat
    assert "Nothing of the instances was changed and none was (re)started" in flat
    assert TOKEN not in output
    # This run's token directory is gone, so is the one a dead run left; a live run's is kept.
    assert list((tmp_path / "remote-tmp").glob("inferops-hf.*")) == [live]
    assert not stale.exists()
    assert not list((tmp_path / "models").glob("*/.inferops-complete-*"))


def test_downloaded_once_then_left_alone(tmp_path):
    seen: list[str] = []
    with FakeHub({MODEL: COMMIT}, token=TOKEN) as hub:
        original = hub.server.RequestHandlerClass.do_GET

        def watching(handler):
            seen.extend(processes_showing(TOKEN))
            original(handler)

        hub.server.RequestHandlerClass.do_GET = watching
        host = {"vllm_instance_model_revision": COMMIT, "vllm_instance_hf_token": TOKEN,
                "vllm_instance_hf_endpoint": hub.url}
        first = play(tmp_path, "model", {"web-1": host})
        asked = len(hub.requests)
        second = play(tmp_path, "model", {"web-1": host})
    assert recap(first)["web-1"][3] == 0 and recap(first)["web-1"][1] >= 1, first
    assert asked == 1 and hub.requests[0] == (f"/api/models/{MODEL}/revision/{COMMIT}", f"Bearer {TOKEN}")
    model_dir = tmp_path / "models" / MODEL.replace("/", "--")
    assert (model_dir / "config.json").is_file() and (model_dir / f".inferops-complete-{COMMIT}").is_file()
    [call] = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert call["token"] == TOKEN and call["environ_token"] is None and call["revision"] == COMMIT
    assert TOKEN not in first and TOKEN not in second
    assert seen == [], seen
    assert list((tmp_path / "remote-tmp").glob("inferops-hf.*")) == []
    assert recap(second)["web-1"][1] == 0 and recap(second)["web-1"][3] == 0, second
    assert len(hub.requests) == 1


def test_the_preflight_wants_a_commit_for_a_hub_model(tmp_path):
    output = play(tmp_path, "preflight", {"branch": {"vllm_instance_model_revision": "main"},
                                          "empty": {}, "commit": {"vllm_instance_model_revision": COMMIT},
                                          "not-an-id": {"vllm_instance_model": "some org/model x"}}, facts=True)
    flat = " ".join(output.split())
    counts = recap(output)
    assert counts["commit"][3] == 0 and counts["commit"][1] == 0, flat
    for host, revision in (("branch", "main"), ("empty", "")):
        assert counts[host][3] == 1, flat
        # The PD preflight's rule and words (inferops.vllm.instance_problems), in its line format.
        assert (f"[model] {host}: vllm_instance_model_revision: vllm_instance_model is the Hugging Face model {MODEL}, "
                f"so vllm_instance_model_revision must be the commit to serve, 40 hexadecimal digits, but it is "
                f"'{revision}'.") in flat, flat
    assert counts["not-an-id"][3] == 1
    assert re.search(r"\[model\] not-an-id: vllm_instance_model: 'some org/model x' is neither an absolute directory",
                     flat), flat
