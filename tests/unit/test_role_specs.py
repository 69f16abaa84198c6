"""Role argument specs (roles/*/meta/argument_specs.yml) agree with the roles' defaults/main.yml.

Every role that has defaults is covered, including roles added later: its `main` entry point must
document exactly the variables of defaults/main.yml, with the same default values, and a role with
tasks/preflight.yml must have a `preflight` entry point with the same options as `main`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROLES_DIR = Path(__file__).resolve().parents[2] / "roles"
YAML_SUFFIXES = (".yml", ".yaml")


def _find(directory: Path, stem: str) -> Path | None:
    for suffix in YAML_SUFFIXES:
        candidate = directory / f"{stem}{suffix}"
        if candidate.is_file():
            return candidate
    return None


def _roles_with_defaults() -> list[Path]:
    return sorted(d for d in ROLES_DIR.iterdir() if d.is_dir() and _find(d / "defaults", "main") is not None)


ROLES = _roles_with_defaults()


def _load(path: Path) -> Any:
    with path.open(encoding="utf-8") as handle:
        return yaml.safe_load(handle)


def _defaults(role: Path) -> dict[str, Any]:
    path = _find(role / "defaults", "main")
    assert path is not None
    data = _load(path)
    assert isinstance(data, dict), f"{path}: expected a mapping of variables"
    return data


def _entry_points(role: Path) -> dict[str, Any]:
    path = _find(role / "meta", "argument_specs")
    assert path is not None, f"role {role.name} has defaults but no meta/argument_specs.yml"
    data = _load(path)
    assert isinstance(data, dict) and isinstance(data.get("argument_specs"), dict), (
        f"{path}: expected a top-level `argument_specs` mapping"
    )
    return data["argument_specs"]


def _options(role: Path, entry_point: str) -> dict[str, Any]:
    specs = _entry_points(role)
    assert entry_point in specs, f"role {role.name}: no `{entry_point}` entry point in meta/argument_specs.yml"
    options = specs[entry_point].get("options")
    assert isinstance(options, dict), f"role {role.name}: entry point `{entry_point}` has no options"
    return options


def _same(a: Any, b: Any) -> bool:
    """Equal and of the same types all the way down (plain == has 0 == False and 1 == 1.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _walk(options: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every option, nested options included, as (dotted name, spec)."""
    for name, spec in options.items():
        yield prefix + name, spec
        if isinstance(spec, dict) and isinstance(spec.get("options"), dict):
            yield from _walk(spec["options"], f"{prefix}{name}.")


def _is_template(value: Any) -> bool:
    return isinstance(value, str) and ("{{" in value or "{%" in value)


# Python types a (non-templated) default may have for each argument spec type.
TYPE_CHECKS: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "path": (str,),
    "int": (int,),
    "float": (float, int),
    "bool": (bool,),
    "list": (list,),
    "dict": (dict,),
}

role_param = pytest.mark.parametrize("role", ROLES, ids=[r.name for r in ROLES])


def test_roles_are_discovered() -> None:
    assert ROLES, f"no role with defaults/main.yml under {ROLES_DIR}"


@role_param
def test_main_documents_exactly_the_defaults(role: Path) -> None:
    defaults = set(_defaults(role))
    options = set(_options(role, "main"))
    assert not defaults - options, f"role {role.name}: in defaults but not in the spec: {sorted(defaults - options)}"
    assert not options - defaults, f"role {role.name}: in the spec but not in defaults: {sorted(options - defaults)}"


@role_param
def test_spec_defaults_equal_role_defaults(role: Path) -> None:
    options = _options(role, "main")
    wrong = []
    for name, value in _defaults(role).items():
        if name not in options:
            continue  # reported by test_main_documents_exactly_the_defaults
        spec = options[name]
        if "default" not in spec:
            wrong.append(f"{name}: no `default` in the spec (defaults/main.yml has {value!r})")
        elif not _same(spec["default"], value):
            wrong.append(f"{name}: spec default {spec['default']!r} != defaults/main.yml {value!r}")
    assert not wrong, f"role {role.name}:\n  " + "\n  ".join(wrong)


@role_param
def test_every_option_has_a_type_and_a_description(role: Path) -> None:
    problems = []
    for entry_point, spec in _entry_points(role).items():
        for name, option in _walk(spec.get("options") or {}):
            where = f"{entry_point}: {name}"
            if not isinstance(option, dict):
                problems.append(f"{where}: not a mapping")
                continue
            if not option.get("type"):
                problems.append(f"{where}: no type")
            description = option.get("description")
            lines = [description] if isinstance(description, str) else description
            if not isinstance(lines, list) or not lines or not all(isinstance(s, str) and s.strip() for s in lines):
                problems.append(f"{where}: no (or an empty) description")
            if option.get("type") == "list" and not option.get("elements"):
                problems.append(f"{where}: a list without `elements`")
    assert not problems, f"role {role.name}:\n  " + "\n  ".join(problems)


@role_param
def test_literal_defaults_fit_type_and_choices(role: Path) -> None:
    problems = []
    for name, option in _walk(_options(role, "main")):
        if "default" not in option or option["default"] is None or _is_template(option["default"]):
            continue
        default, wanted = option["default"], option.get("type")
        allowed = TYPE_CHECKS.get(wanted)
        if allowed and (not isinstance(default, allowed) or (wanted != "bool" and isinstance(default, bool))):
            problems.append(f"{name}: default {default!r} is not a {wanted}")
        if "choices" in option and default not in option["choices"]:
            problems.append(f"{name}: default {default!r} is not one of {option['choices']}")
    assert not problems, f"role {role.name}:\n  " + "\n  ".join(problems)


@role_param
def test_preflight_has_the_same_options_as_main(role: Path) -> None:
    if _find(role / "tasks", "preflight") is None:
        pytest.skip(f"role {role.name} has no tasks/preflight.yml")
    main, preflight = _options(role, "main"), _options(role, "preflight")
    assert _same(preflight, main), (
        f"role {role.name}: `preflight` and `main` options differ: "
        f"only in main {sorted(set(main) - set(preflight))}, only in preflight {sorted(set(preflight) - set(main))}, "
        f"different {sorted(k for k in set(main) & set(preflight) if not _same(main[k], preflight[k]))}"
    )
