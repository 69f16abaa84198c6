# Copyright (c) inferops.vllm contributors
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""How the controller-side preflight reads an inventory value: a host variable, a number, a text.

PRIVATE to the inferops.vllm collection: no compatibility promise; anything here may change or go in
any release. Other collections must not import it.

Inventory values arrive as YAML scalars or as strings from templates ("8100"); these conversions say
what such a value is, and None when it is not one (a boolean is never a number). A host's variables
(hostvars) may hold references that cannot be resolved (a vault that is not loaded): host_var says so.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any


def host_var(variables: Mapping[str, Any], name: str) -> tuple[Any, str]:
    """(value, "set" | "unset" | "broken") of one host variable; "broken" when it is set but cannot be
    resolved, for example a reference to a vault variable that is not loaded."""
    try:
        if name not in variables:
            return None, "unset"
        value = variables[name]
    except Exception:  # noqa: BLE001 - Ansible's undefined-variable errors, without importing Ansible
        return None, "broken"
    items = value if isinstance(value, (list, tuple)) else [value]
    if any(undefined(item) for item in items):
        return None, "broken"
    return value, "set"


def undefined(value: Any) -> bool:
    """Whether a value is Jinja's (or Ansible's) stand-in for an undefined variable."""
    return any(cls.__name__ in ("Undefined", "Marker") for cls in type(value).__mro__)


def to_int(value: Any) -> int | None:
    """An int from an int, an integral float or a decimal string; None for anything else (bools too)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
        return int(value)
    return None


def to_float(value: Any) -> float | None:
    """A float from a number or a numeric string; None for anything else (bools too)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def text(value: Any) -> str:
    """The value as text; "" for None."""
    return "" if value is None else str(value)
