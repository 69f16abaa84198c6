"""Module test harness shared by the module tests (community.general's tests/unit/plugins/modules/utils.py
does the same): exit_json and fail_json raise, so a test can catch what the module returned."""

from __future__ import annotations


class AnsibleExitJson(Exception):
    pass


class AnsibleFailJson(Exception):
    pass


def exit_json(self, **kwargs):  # pylint: disable=unused-argument
    kwargs.setdefault("changed", False)
    raise AnsibleExitJson(kwargs)


def fail_json(self, msg, **kwargs):  # pylint: disable=unused-argument
    kwargs["failed"] = True
    kwargs["msg"] = msg
    raise AnsibleFailJson(kwargs)
