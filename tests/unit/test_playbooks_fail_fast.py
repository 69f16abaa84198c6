"""The plays that check or collect every host before a playbook changes any (deploy_pd.yml's host checks,
rolling_restart.yml's collection and plan, monitoring.yml's collection) stop the whole run when one host fails
them. Without `any_errors_fatal`, Ansible drops only the failed host and the later plays change the others: a
decode host refused by its own preflight (its address, its /dev/shm, ...) and the prefill and router hosts
changed all the same, or the prefill pool rolled while the decode plan refused to."""

from __future__ import annotations

import subprocess

import pytest
import yaml
from ansible_collections.inferops.vllm.tests.unit.test_preflight_inventories import ANSIBLE_PLAYBOOK, playbook_env
from monitoring_support import REPO

# playbook -> the plays (by name) that must stop every host when one host fails them.
GUARDS = {
    "deploy_pd.yml": ["Check the inventory before changing any host"],
    "rolling_restart.yml": ["Collect the instances of the prefill and decode hosts", "Collect the router replicas",
                            "Plan the rollout and refuse what cannot roll without failed requests, before any change"],
    "monitoring.yml": ["Collect the instances of the prefill and decode hosts", "Collect the router replicas"],
}


@pytest.mark.parametrize("playbook", sorted(GUARDS))
def test_the_checking_plays_stop_every_host_when_one_fails(playbook):
    # A first play's name ends with a host count (": {{ ... }}", test_controller_preload.py): keyed by what precedes it.
    plays = {str(play.get("name")).partition(": {{")[0]: play
             for play in yaml.safe_load((REPO / "playbooks" / playbook).read_text())}
    for name in GUARDS[playbook]:
        assert name in plays, f"{playbook}: no play named {name!r}; update this test"
        assert plays[name].get("any_errors_fatal") is True, f"{playbook}: {name!r} lets the other hosts go on"


MECHANISM = """
- name: A check that fails on one host only
  hosts: all
  gather_facts: false
  any_errors_fatal: true
  tasks:
    - name: Fail on the decode host
      ansible.builtin.fail:
        msg: refused
      when: inventory_hostname == 'decode1'

- name: A later play that would change the hosts
  hosts: all
  gather_facts: false
  tasks:
    - name: Say the host was changed
      ansible.builtin.debug:
        msg: "CHANGED {{ inventory_hostname }}"
"""


def test_ansible_stops_the_later_plays_for_every_host(tmp_path):
    """The mechanism the guards rely on, with the installed ansible-core: a play-level any_errors_fatal failure on
    one host runs no later play on any host (without it, the other host would be changed)."""
    path = tmp_path / "play.yml"
    for fatal in (True, False):
        path.write_text(MECHANISM if fatal else MECHANISM.replace("  any_errors_fatal: true\n", ""))
        run = subprocess.run([ANSIBLE_PLAYBOOK, "-i", "decode1,prefill1,", "-c", "local", str(path)], cwd=REPO,
                             env=playbook_env(ANSIBLE_LOCALHOST_WARNING="0"), capture_output=True, text=True,
                             timeout=120, check=False)
        assert run.returncode != 0, run.stdout
        assert ("CHANGED prefill1" in run.stdout) is (not fatal), run.stdout
