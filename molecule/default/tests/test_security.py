"""Verify what the deployment exposes: the units' sandboxing as systemd scores it, and no key in the
output of a `--check --diff` run that changes every key."""

from __future__ import annotations

import os
import re
import secrets
import subprocess

import pytest
from conftest import DECODE, PREFILL, ROUTER, secret

# `systemd-analyze security` exposure bounds (0 = locked down, 10 = everything allowed).
BOUNDS = [
    (PREFILL, "vllm@prefill-0.service", 2.0),
    (DECODE, "vllm@decode-0.service", 2.0),
    (PREFILL, "inferops-vllm-firewall.service", 2.0),
    (DECODE, "inferops-vllm-firewall.service", 2.0),
    (ROUTER, "vllm-router@0.service", 2.0),
    # The distribution's nginx (9.6 without our drop-in): its master keeps root to bind and drop privileges.
    (ROUTER, "nginx.service", 5.0),
]


@pytest.mark.parametrize(("container", "unit", "bound"), BOUNDS)
def test_unit_exposure_is_under_its_bound(request, container, unit, bound):
    host = request.getfixturevalue({PREFILL: "prefill_host", DECODE: "decode_host", ROUTER: "router_host"}[container])
    assert host.service(unit).is_running or host.service(unit).is_enabled, unit
    out = host.check_output(f"systemd-analyze security --no-pager {unit}")
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out)
    assert match, out[-500:]
    assert float(match.group(1)) <= bound, f"{unit} on {container}: {match.group(1)} > {bound}\n" + "\n".join(
        line for line in out.splitlines() if line.startswith("✗")
    )


def task_result(output: str, task: str, host: str) -> str | None:
    """What a task reported for a host in an ansible-playbook output: changed, ok, skipping, ... or None.
    A looped task counts as changed when any item changed."""
    results = set()
    for block in output.split("\nTASK [inferops.vllm.")[1:]:
        header, _, body = block.partition("\n")
        if header.startswith(task + "]"):
            results |= set(re.findall(rf"^(\w+): \[{re.escape(host)}\]", body, re.M))
    return "changed" if "changed" in results else (min(results) if results else None)


def test_a_check_diff_run_that_changes_every_key_shows_none(router_host):
    """deploy_pd.yml in check mode with --diff and new keys: the files that carry keys would change, and
    neither the old nor the new keys may appear in the output."""
    project = os.environ.get("MOLECULE_PROJECT_DIRECTORY")
    inventory = os.environ.get("MOLECULE_INVENTORY_FILE")
    if not (project and inventory):
        pytest.skip("runs inside molecule only (needs its inventory)")
    new_instance_key = "inst" + secrets.token_hex(16)
    new_client_key = "client" + secrets.token_hex(16)
    env = dict(os.environ)
    ephemeral_cfg = os.path.join(os.environ.get("MOLECULE_EPHEMERAL_DIRECTORY", ""), "ansible.cfg")
    if os.path.isfile(ephemeral_cfg):
        env["ANSIBLE_CONFIG"] = ephemeral_cfg
    run = subprocess.run(
        [
            "ansible-playbook", "-i", inventory, os.path.join(project, "playbooks", "deploy_pd.yml"),
            "--check", "--diff",
            "-e", f"vllm_instance_api_key={new_instance_key}",
            "-e", f'{{"vllm_router_api_keys": ["{new_client_key}"]}}',
        ],
        cwd=project, env=env, capture_output=True, text=True, timeout=900, check=False,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    # The run did see each key-bearing file change (or there would be nothing to hide)...
    for task, host in (("vllm_router : Write the client keys for the front", ROUTER),
                       ("vllm_router : Write how the front passes requests upstream (with the instances' key)", ROUTER),
                       ("vllm_router : Write the router's environment file (the key it presents to the instances)",
                        ROUTER),
                       ("vllm_instance : Write each instance's environment file (secrets)", PREFILL),
                       ("vllm_instance : Write each instance's environment file (secrets)", DECODE)):
        assert task_result(output, task, host) == "changed", (task, host, output[-3000:])
    # ...and showed no key, old or new.
    for name, key in (("new instance key", new_instance_key), ("new client key", new_client_key),
                      ("instance key", secret("instance_api_key")), ("client key", secret("client_api_key"))):
        assert key not in output, f"{name} in the --check --diff output"
    # Nothing was changed for real: the front still takes the old key only.
    keys = router_host.file("/etc/nginx/inferops-vllm-keys.map").content_string
    assert "k-" in keys and new_client_key[:8] not in keys
