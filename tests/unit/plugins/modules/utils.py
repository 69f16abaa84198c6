"""Module test harness shared by the module tests (community.general's tests/unit/plugins/modules/utils.py
does the same): exit_json and fail_json raise, so a test can catch what the module returned."""

from __future__ import annotations

import ast
from pathlib import Path

from ansible.module_utils.testing import patch_module_args  # ansible-core 2.19+, as meta/runtime.yml requires


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


def run_module(main, args=None, expect="exit", check_mode=False, diff=False):
    """Run a module's ``main`` with ``args`` (exit_json/fail_json patched to raise, see the tests'
    fixtures) and return what it exited or failed with; the wrong one of the two fails the test."""
    exc_type = AnsibleExitJson if expect == "exit" else AnsibleFailJson
    args = dict(args or {})
    if check_mode:
        args["_ansible_check_mode"] = True
    if diff:
        args["_ansible_diff"] = True
    with patch_module_args(args):
        try:
            main()
        except (AnsibleExitJson, AnsibleFailJson) as exc:
            if not isinstance(exc, exc_type):
                raise AssertionError(f"expected {exc_type.__name__}, got {type(exc).__name__}: {exc.args[0]}") from exc
            return exc.args[0]
    raise AssertionError("the module neither exited nor failed")  # pragma: no cover


def assert_documented_as_specified(doc_options, spec, path=""):
    """A module's DOCUMENTATION options say exactly what its argument spec does, suboptions included."""
    assert set(doc_options) == set(spec), f"{path}: documented {sorted(doc_options)} vs spec {sorted(spec)}"
    for name, doc in doc_options.items():
        where = f"{path}{name}"
        arg = spec[name]
        assert doc.get("type", "str") == arg.get("type", "str"), where
        assert doc.get("required", False) == arg.get("required", False), where
        assert doc.get("default") == arg.get("default"), where
        assert doc.get("choices") == arg.get("choices"), where
        assert doc.get("elements") == arg.get("elements"), where
        assert doc.get("description"), where
        if "options" in arg:
            assert_documented_as_specified(doc["suboptions"], arg["options"], f"{where}.")
        else:
            assert "suboptions" not in doc, where


def captured_module_arguments(monkeypatch, module) -> dict:
    """The keyword arguments ``module.main()`` gives AnsibleModule (argument_spec, supports_check_mode, ...),
    captured without running the module."""
    captured = {}

    class Captured(Exception):
        pass

    def capture(**kwargs):
        captured.update(kwargs)
        raise Captured

    monkeypatch.setattr(module, "AnsibleModule", capture)
    try:
        module.main()
    except Captured:
        return captured
    raise AssertionError(f"{module.__name__}.main() did not build an AnsibleModule")
