"""rollout_batch_problems: vllm_rollout_serial must not take a whole pool out of the routers at once (issue #24).

The rollout took each instance out by URL without looking at the rest of its pool: with vllm_rollout_serial
covering every host of a pool, all of its instances left the routers side by side and every request failed.
"""

from __future__ import annotations

import pytest
from ansible.errors import AnsibleFilterError
from ansible_collections.inferops.vllm.plugins.filter.pd import FilterModule, rollout_batch_problems


def inst(name, host, role="decode"):
    return {"name": name, "host": host, "role": role}


PLAN = [inst("decode-0", "d1"), inst("decode-1", "d2"), inst("prefill-0", "p1", "prefill")]
POOLS = {"prefill": 1, "decode": 2}
HOSTS = {"prefill": ["p1"], "decode": ["d1", "d2"]}


@pytest.mark.parametrize("serial", [2, "2", "100%", [2, 1], 0, 5])
def test_a_batch_that_holds_the_whole_pool_is_refused(serial):
    problems = rollout_batch_problems(PLAN, POOLS, HOSTS, serial)
    assert len(problems) == 1, problems
    assert "rolls the hosts d1, d2 side by side, and they hold every instance of the decode pool (decode-0, " \
           "decode-1)" in problems[0]
    assert "at most 1 of the pool's 2 hosts at a time" in problems[0]
    assert "vllm_rollout_allow_downtime=true" in problems[0]


@pytest.mark.parametrize("serial", [1, "1", "50%", "10%", [1], [1, 1]])
def test_one_host_at_a_time_keeps_the_pool(serial):
    assert rollout_batch_problems(PLAN, POOLS, HOSTS, serial) == []


def test_two_instances_on_one_host_roll_one_after_the_other():
    plan = [inst("decode-0", "d1"), inst("decode-2", "d1")]
    assert rollout_batch_problems(plan, {"prefill": 1, "decode": 2}, {"decode": ["d1"]}, 5) == []


def test_an_instance_that_does_not_roll_keeps_the_pool_serving():
    plan = [inst("decode-0", "d1")]
    assert rollout_batch_problems(plan, POOLS, HOSTS, 2) == []


def test_a_pool_of_one_is_the_other_rules():
    plan = [inst("prefill-0", "p1", "prefill")]
    assert rollout_batch_problems(plan, POOLS, HOSTS, 5) == []


def test_later_batches_count_too():
    hosts = {"decode": ["d1", "d2", "d3", "d4"]}
    plan = [inst("decode-2", "d3"), inst("decode-3", "d4")]
    # Batches d1 | d2,d3,d4 (the list's last size repeats): the second holds both rolling decodes of a pool of 2.
    problems = rollout_batch_problems(plan, {"decode": 2}, hosts, [1, 3])
    assert len(problems) == 1 and "rolls the hosts d3, d4 side by side" in problems[0], problems
    assert rollout_batch_problems(plan, {"decode": 3}, hosts, [1, 3]) == []


def test_a_serial_that_is_not_a_number_says_what_to_give():
    with pytest.raises(AnsibleFilterError, match="vllm_rollout_serial is 'two'"):
        rollout_batch_problems(PLAN, POOLS, HOSTS, "two")


def test_the_filter_is_registered():
    assert FilterModule().filters()["rollout_batch_problems"] is rollout_batch_problems
