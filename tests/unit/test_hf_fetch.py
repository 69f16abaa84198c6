"""roles/vllm_instance/files/inferops_hf_fetch.py, the download of a Hugging Face model on the host, offline.

The script runs as the role runs it (its own process, arguments, a token file), against a hub that cannot be
reached (a closed port on 127.0.0.1, as HF_ENDPOINT or --endpoint) and against a fake hub API on loopback
(tests/unit/fake_hub.py) with a stub huggingface_hub in place of the real library. Each failure is one line
naming the model, the revision and the hub, with its own exit status; the token is never printed and reaches
snapshot_download as an argument, not through the environment; a finished revision is not asked for again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_hub import COMMIT, FakeHub, stub_huggingface_hub

SCRIPT = Path(__file__).resolve().parents[2] / "roles" / "vllm_instance" / "files" / "inferops_hf_fetch.py"
TOKEN = "hf_TestTokenAbcdefghijklmnop0123456789"  # noqa: S105 - a test credential
MODEL = "example-org/tiny-model"
UNREACHABLE = "http://127.0.0.1:9"


@pytest.fixture
def env(tmp_path):
    stub = stub_huggingface_hub(tmp_path / "stub")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    environ.update(PYTHONPATH=str(stub), INFEROPS_STUB_LOG=str(tmp_path / "calls.jsonl"))
    return environ


def fetch(tmp_path: Path, env: dict, *args: str, token: str = TOKEN) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, str(SCRIPT), "--model", MODEL, "--revision", COMMIT, "--dest", str(tmp_path / "model"),
            "--timeout", "5", *args]
    if token:
        token_file = tmp_path / "token"
        token_file.write_text(token + "\n")
        argv += ["--token-file", str(token_file)]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)


def calls(tmp_path: Path) -> list[dict]:
    path = tmp_path / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_an_unreachable_hub_is_one_clear_line(tmp_path, env):
    run = fetch(tmp_path, {**env, "HF_ENDPOINT": UNREACHABLE})
    assert run.returncode == 3, run.stderr
    assert run.stderr.startswith(f"inferops_hf_fetch: cannot download model {MODEL} at revision {COMMIT} from "
                                 f"{UNREACHABLE}: the hub cannot be reached (URLError: "), run.stderr
    assert "Check the host's network, DNS and proxy variables, or vllm_instance_hf_endpoint" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
    assert TOKEN not in run.stdout + run.stderr
    assert calls(tmp_path) == [] and not (tmp_path / "model").exists()


@pytest.mark.parametrize(("hub_token", "given", "gated_403", "status", "says"), [
    (TOKEN, "hf_WrongTokenAbcdefghijklmnop01234", False, 4, "the hub refused the token (HTTP 401): check "
                                                            "vllm_instance_hf_token"),
    (TOKEN, "", False, 4, "the hub answered HTTP 401: the model is private or gated, or does not exist; a gated or "
                          "private model needs vllm_instance_hf_token"),
    ("", TOKEN, True, 4, "the hub answered HTTP 403: the token's account has no access to this model"),
])
def test_refused_tokens_and_gated_models(tmp_path, env, hub_token, given, gated_403, status, says):
    with FakeHub({MODEL: COMMIT}, token=hub_token, gated_403=gated_403) as hub:
        run = fetch(tmp_path, env, "--endpoint", hub.url, token=given)
    assert run.returncode == status, run.stderr
    assert run.stderr.startswith(f"inferops_hf_fetch: cannot download model {MODEL} at revision {COMMIT} from "
                                 f"{hub.url}: {says}"), run.stderr
    assert TOKEN not in run.stdout + run.stderr and (not given or given not in run.stdout + run.stderr)
    assert calls(tmp_path) == []


def test_a_revision_the_hub_does_not_have(tmp_path, env):
    with FakeHub({MODEL: "f" * 40}) as hub:
        run = fetch(tmp_path, env, "--endpoint", hub.url)
    assert run.returncode == 4
    assert "the hub answered HTTP 404: no such model, or no such revision (vllm_instance_model, " \
           "vllm_instance_model_revision)." in run.stderr


def test_download_once_with_the_token_as_an_argument(tmp_path, env):
    with FakeHub({MODEL: COMMIT}, token=TOKEN) as hub:
        first = fetch(tmp_path, env, "--endpoint", hub.url)
        asked = len(hub.requests)
        second = fetch(tmp_path, {**env, "HF_ENDPOINT": UNREACHABLE})
    assert first.returncode == 0, first.stderr
    result = json.loads(first.stdout.splitlines()[-1])
    assert result["changed"] is True and result["commit"] == COMMIT and result["files"] == 1
    assert hub.requests == [(f"/api/models/{MODEL}/revision/{COMMIT}", f"Bearer {TOKEN}")]
    [call] = calls(tmp_path)
    # Downloaded beside the model directory, which it then replaced (test_a_new_revision_replaces_the_old_whole).
    assert call == {"repo_id": MODEL, "revision": COMMIT, "token": TOKEN, "endpoint": hub.url, "environ_token": None,
                    "local_dir": str(tmp_path / f"model.inferops-download-{COMMIT}")}
    assert (tmp_path / "model" / f".inferops-complete-{COMMIT}").is_file()
    assert TOKEN not in first.stdout + first.stderr
    # Present: nothing asked, nothing downloaded, even with the hub out of reach.
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout)["changed"] is False
    assert asked == 1 and len(calls(tmp_path)) == 1


def test_a_failed_download_says_so_without_the_token(tmp_path, env):
    with FakeHub({MODEL: COMMIT}) as hub:
        run = fetch(tmp_path, {**env, "INFEROPS_STUB_FAIL": "1"}, "--endpoint", hub.url)
    assert run.returncode == 5
    assert run.stderr == (f"inferops_hf_fetch: cannot download model {MODEL} at revision {COMMIT} from {hub.url}: "
                          "RuntimeError: simulated download failure with token <token>\n")
    assert not list((tmp_path / "model").glob(".inferops-complete-*"))


def test_a_new_revision_replaces_the_old_one_whole_and_a_failed_one_leaves_it_alone(tmp_path, env):
    """Issue #24: the instances load --dest, so a download never goes into it. A failed download of a new revision
    leaves the old revision's files as they were (its directory stays for the next run); a finished one takes
    the place of --dest whole: no file of the old revision is left beside the new ones."""
    newer = "fedcba9876543210fedcba9876543210fedcba98"
    dest = tmp_path / "model"
    with FakeHub({MODEL: COMMIT}) as hub:
        assert fetch(tmp_path, env, "--endpoint", hub.url).returncode == 0
    (dest / "only-in-the-old-revision.safetensors").write_text("old weights")
    before = sorted(p.name for p in dest.iterdir())
    with FakeHub({MODEL: newer}) as hub:
        failed = fetch(tmp_path, {**env, "INFEROPS_STUB_FAIL": "1"}, "--endpoint", hub.url, "--revision", newer)
        assert failed.returncode == 5, failed.stderr
        assert sorted(p.name for p in dest.iterdir()) == before
        assert (dest / f".inferops-complete-{COMMIT}").is_file()
        assert (tmp_path / f"model.inferops-download-{newer}").is_dir()  # resumed by the next run
        # A stopped download of yet another revision is removed by the run that finishes this one.
        (tmp_path / f"model.inferops-download-{'9' * 40}").mkdir()
        done = fetch(tmp_path, env, "--endpoint", hub.url, "--revision", newer)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["changed"] is True
    assert sorted(p.name for p in dest.iterdir()) == [f".inferops-complete-{newer}", "config.json"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("model")) == ["model"]
