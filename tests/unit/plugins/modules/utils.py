"""Module test harness shared by the module tests (community.general's tests/unit/plugins/modules/utils.py
does the same): exit_json and fail_json raise, so a test can catch what the module returned."""

from __future__ import annotations

import ast
from pathlib import Path


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


def assert_no_globals_besides_documentation(module):
    """A module's top level holds only imports, definitions, DOCUMENTATION/EXAMPLES/RETURN and the
    `if __name__ == "__main__"` guard: no state that would outlive one run."""
    tree = ast.parse(Path(module.__file__).read_text())
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, ast.Assign):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            assert names and set(names) <= {"DOCUMENTATION", "EXAMPLES", "RETURN"}, ast.dump(node)
            continue
        if isinstance(node, ast.If):  # if __name__ == "__main__": main()
            assert "__main__" in ast.unparse(node.test)
            continue
        raise AssertionError(f"unexpected module-level statement: {ast.unparse(node)[:80]}")
