"""Unit tests for the inferops.vllm.systemd_pending filter (which units a role enables and starts) and
inferops.vllm.systemd_active (which instances run)."""

from __future__ import annotations

import pytest
from ansible.errors import AnsibleFilterError
from ansible_collections.inferops.vllm.plugins.filter.systemd import FilterModule, systemd_active, systemd_pending


def _show(*states):
    """systemctl show's output for units in these (UnitFileState, ActiveState) states, as it prints it."""
    return "\n".join(f"Id=u{i}.service\nActiveState={active}\nUnitFileState={enabled}\n" for i, (enabled, active) in
                     enumerate(states))


def test_only_units_that_are_not_enabled_and_active_are_returned_in_their_order():
    out = _show(("enabled", "active"), ("disabled", "active"), ("enabled", "failed"), ("enabled", "active"))
    assert systemd_pending(out, ["a", "b", "c", "d"]) == ["b", "c"]
    assert systemd_pending(_show(("enabled", "active"), ("enabled", "active")), ["a", "b"]) == []


@pytest.mark.parametrize(
    "state",
    [("enabled", "activating"), ("enabled", "inactive"), ("static", "active"), ("masked", "inactive"),
     ("", "inactive"), ("enabled-runtime", "active"), ("enabled", "reloading")],
)
def test_every_other_state_leaves_the_decision_to_systemd_service(state):
    # An unknown unit shows UnitFileState= (empty) and ActiveState=inactive: the module then fails as before.
    assert systemd_pending(_show(state), ["x.service"]) == ["x.service"]


def test_output_that_does_not_match_the_units_returns_them_all():
    assert systemd_pending(_show(("enabled", "active")), ["a", "b"]) == ["a", "b"]
    assert systemd_pending("", ["a"]) == ["a"]


def test_bad_input_is_refused():
    with pytest.raises(AnsibleFilterError, match="not a list"):
        systemd_pending("", "nginx.service")
    with pytest.raises(AnsibleFilterError, match="not a text"):
        systemd_pending(None, ["nginx.service"])
    assert FilterModule().filters()["systemd_pending"] is systemd_pending


def test_active_states_follow_the_units_order_like_systemctl_is_active():
    out = _show(("enabled", "active"), ("", "inactive"), ("enabled", "failed"), ("enabled", "activating"))
    assert systemd_active(out, ["a", "b", "c", "d"]) == ["active", "inactive", "failed", "activating"]
    # A block without ActiveState says nothing: unknown, so not running.
    assert systemd_active("Id=a.service\nUnitFileState=enabled\n", ["a"]) == ["unknown"]


def test_active_states_of_output_that_does_not_match_the_units_are_unknown():
    # systemctl failed (no systemd): the module returns an empty output; no unit counts as running.
    assert systemd_active("", ["a", "b"]) == ["unknown", "unknown"]
    assert systemd_active(_show(("enabled", "active")), ["a", "b"]) == ["unknown", "unknown"]
    assert systemd_active("", []) == []


def test_active_refuses_bad_input():
    with pytest.raises(AnsibleFilterError, match="systemd_active: .*not a list"):
        systemd_active("", "vllm@decode-0.service")
    with pytest.raises(AnsibleFilterError, match="systemd_active: .*not a text"):
        systemd_active(None, ["vllm@decode-0.service"])
    assert FilterModule().filters()["systemd_active"] is systemd_active
