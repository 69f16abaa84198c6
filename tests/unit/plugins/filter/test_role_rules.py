"""One rule, one place: the roles' own preflights run the controller-side PD preflight's rules through filters
(inferops.vllm.instance_problems, inferops.vllm.router_problems), so a role on its own and playbooks/preflight.yml
refuse the same settings in the same words, and no role re-implements a rule in Jinja.

tests/unit/test_instance_hub_model.py and test_role_rules_playbook below run the real role preflight.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from ansible_collections.inferops.vllm.plugins.filter.preflight import FilterModule
from ansible_collections.inferops.vllm.plugins.plugin_utils import _preflight as pf
from ansible_collections.inferops.vllm.tests.unit.plugins.filter.test_preflight import instance, inventory, router
from ansible_collections.inferops.vllm.tests.unit.plugins.filter.utils import COMMIT

REPO = Path(__file__).resolve().parents[4]


def both(decode: dict[str, Any] | None = None, routers: dict[str, Any] | None = None) -> list[str]:
    published, groups = inventory(decode=decode, routers=routers)
    return pf.pd_preflight(published, groups)


BAD_DECODE = {
    "bad_name": (instance("decode", [{"name": "Decode_0", "port": 8200, "kv_transfer_port": 5700}]),
                 "[instances] d1: vllm_instance_instances: the instance name 'Decode_0' is not [a-z0-9-]"),
    "same_name": (instance("decode", [{"name": "decode-0", "port": 8200, "kv_transfer_port": 5700},
                                      {"name": "decode-0", "port": 8201, "kv_transfer_port": 5701}]),
                  "[instances] d1: vllm_instance_instances: the name 'decode-0' is used by 2 instances"),
    "same_port": (instance("decode", [{"name": "decode-0", "port": 8200, "kv_transfer_port": 5700},
                                      {"name": "decode-1", "port": 8200, "kv_transfer_port": 5701}]),
                  "[ports] d1: vllm_instance_instances[*].port: port 8200 is used by decode-0 port and decode-1 port"),
    "no_port": (instance("decode", [{"name": "decode-0", "port": 70000, "kv_transfer_port": 5700}]),
                "[ports] d1: vllm_instance_instances[decode-0].port: is 70000, not a port (1-65535)."),
    "unknown_override": (instance("decode", [{"name": "decode-0", "port": 8200, "kv_transfer_port": 5700,
                                              "overrides": {"max_num_seq": 4}}]),
                         "[instances] d1: vllm_instance_instances[decode-0].overrides: sets unknown settings "
                         "max_num_seq."),
    "branch": (instance("decode", revision="main"),
               "[model] d1: vllm_instance_model_revision: vllm_instance_model is the Hugging Face model "
               "HuggingFaceTB/SmolLM2-135M-Instruct, so vllm_instance_model_revision must be the commit to serve, "
               "40 hexadecimal digits, but it is 'main'."),
    "not_an_id": (instance("decode", model="some org/model x"),
                  "[model] d1: vllm_instance_model: 'some org/model x' is neither an absolute directory on the "
                  "controller nor a Hugging Face id (org/name)."),
    "removed": (instance("decode", unsupported={"vllm_instance_swap_space": "vLLM 0.32 has no --swap-space."}),
                "[unsupported] d1: vllm_instance_swap_space: is set, but vLLM 0.32 has no --swap-space."),
}


@pytest.mark.parametrize("case", sorted(BAD_DECODE))
def test_the_role_and_the_controller_give_the_same_message(case):
    record, start = BAD_DECODE[case]
    role = pf.instance_problems(record, "d1")
    assert len(role) == 1 and role[0].startswith(start), role
    assert "Fix: " in role[0]
    assert role[0] in both(decode={"d1": record})


def test_a_good_host_passes_both():
    record = instance("decode", revision=COMMIT)
    assert pf.instance_problems(record, "d1") == []
    assert both(decode={"d1": record}) == []


def test_a_local_model_needs_no_revision():
    record = instance("decode", model="/nonexistent/model", model_is_local=True, revision="")
    (line,) = pf.instance_problems(record, "d1")
    assert line.startswith("[model] d1: vllm_instance_model: is an absolute path, so it must be a model directory")
    assert "revision" not in line


def test_no_record_is_a_problem_not_a_crash():
    assert pf.instance_problems(None, "d1") == [
        "[instances] d1: vllm_instance_published: is null, not the published settings. Fix: run the vllm_instance "
        "role's publish tasks first."]
    assert pf.router_problems("x", "r1")[0].startswith("[ports] r1: vllm_router_published: is a string")


@pytest.mark.parametrize(("record", "start"), [
    (router(replicas=9), "[ports] r1: vllm_router_replicas: is 9, not a number of router processes from 1 to 8."),
    (router(front_port=8301), "[ports] r1: vllm_router_front_port, vllm_router_port: port 8301 is used by "
                              "vllm_router_port + 1 (router replica 1) and vllm_router_front_port."),
    (router(stub_status_port=29000), "[ports] r1: vllm_router_front_stub_status_port, vllm_router_metrics_port: "
                                     "port 29000 is used by vllm_router_metrics_port and "
                                     "vllm_router_front_stub_status_port."),
    (router(port="x"), "[ports] r1: vllm_router_port: is 'x', not a port (1-65535)."),
])
def test_the_router_role_and_the_controller_give_the_same_ports_message(record, start):
    (line,) = pf.router_problems(record, "r1")
    assert line.startswith(start), line
    assert line in both(routers={"r1": record})


@pytest.mark.parametrize(("record", "start"), [
    (router(api_keys_count=0), "[secrets] r1: vllm_router_api_keys: lists no client key"),
    (router(api_keys_count=2, api_keys_invalid=1), "[secrets] r1: vllm_router_api_keys: 1 of its keys is not usable"),
    (router(tls_certificate=True), "[secrets] r1: vllm_router_tls_certificate, vllm_router_tls_key: only one of them"),
])
def test_the_router_role_and_the_controller_give_the_same_secrets_message(record, start):
    (line,) = pf.router_problems(record, "r1")
    assert line.startswith(start), line
    assert line in both(routers={"r1": record})
    assert pf.router_problems(router(api_keys_count=0, allow_unauthenticated=True), "r1") == []


def test_a_stub_status_port_of_0_is_no_port():
    assert pf.router_problems(router(stub_status_port=0), "r1") == []
    assert pf.router_problems(router(stub_status_port="0"), "r1") == []
    assert pf.router_problems(router(stub_status_port=8090), "r1") == []


def test_the_filters_are_registered():
    filters = FilterModule().filters()
    assert filters["instance_problems"].__name__ == "instance_problems" and callable(pf.instance_problems)
    assert filters["router_problems"].__name__ == "router_problems" and callable(pf.router_problems)


# Fragments of the rules these filters hold: a copy of one in a role's tasks would be a second place.
COPIES = {
    "roles/vllm_instance/tasks/preflight.yml": ["[a-z0-9][a-z0-9-]", "[0-9a-f]{40}", "overrides unknown",
                                                "_vllm_instance_unsupported", "unique | length"],
    "roles/vllm_router/tasks/preflight.yml": ["vllm_router_replicas | int <= 8", "range(vllm_router_port",
                                              "unique | length", "vllm_router_api_keys | length > 0",
                                              "(vllm_router_tls_key | length > 0)"],
}


@pytest.mark.parametrize("path", sorted(COPIES))
def test_the_roles_hold_no_copy_of_the_rules(path):
    text = (REPO / path).read_text(encoding="utf-8")
    assert "inferops.vllm.instance_problems" in text or "inferops.vllm.router_problems" in text
    for fragment in COPIES[path]:
        assert fragment not in text, f"{path} repeats {fragment!r}"


ANSIBLE_PLAYBOOK = str(Path(sys.executable).parent / "ansible-playbook")
ROUTER_PLAY = """\
- name: The vllm_router role's preflight
  hosts: localhost
  gather_facts: false
  vars:
    vllm_router_api_keys: ["router-test-client-key-0001"]
    vllm_router_front_bind: 127.0.0.1
  tasks:
    - name: Run it
      ansible.builtin.include_role:
        name: inferops.vllm.vllm_router
        tasks_from: preflight
"""


@pytest.mark.skipif(not Path(ANSIBLE_PLAYBOOK).is_file(), reason="ansible-playbook is not installed")
@pytest.mark.parametrize(("extra", "record"), [
    ({"vllm_router_replicas": 9}, router(replicas=9)),
    ({"vllm_router_api_keys": []}, router(api_keys_count=0)),
])
def test_the_router_roles_preflight_shows_the_controllers_line(tmp_path, extra, record):
    """The real role preflight on its own: it stops at the PD preflight's rule, in its words."""
    from ansible_collections.inferops.vllm.tests.unit.test_preflight_inventories import playbook_env

    playbook = tmp_path / "router.yml"
    playbook.write_text(ROUTER_PLAY, encoding="utf-8")
    run = subprocess.run(
        [ANSIBLE_PLAYBOOK, "-i", "localhost,", "-c", "local", "-e", f"ansible_python_interpreter={sys.executable}",
         "-e", json.dumps(extra), str(playbook)],
        cwd=REPO, env=playbook_env(ANSIBLE_LOCALHOST_WARNING="0"), capture_output=True, text=True, timeout=180,
        check=False)
    flat = " ".join((run.stdout + run.stderr).split())
    assert run.returncode != 0, flat
    (expected,) = pf.router_problems(record, "localhost")
    assert "localhost: the PD preflight refuses these settings:" in flat, flat
    assert expected in flat, flat
