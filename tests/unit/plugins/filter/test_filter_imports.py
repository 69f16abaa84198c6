"""The collection's filter files import their rules on first use, not when Ansible loads them.

To find any filter of a collection, ansible-core loads every file in its plugins/filter/ (and what they import)
in each worker process it forks for a task. Rules imported with those files cost every task that uses any of
the collection's filters (plugins/filter/preflight.py says how much); these tests load the filters as Ansible
does, in a fresh interpreter, and fail when a filter file imports the collection's module_utils or plugin_utils
at load time again.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

COLLECTIONS_ROOT = next(p for p in sys.path if (Path(p) / "ansible_collections" / "inferops" / "vllm").is_dir())

PROBE = textwrap.dedent("""
    import json, sys
    from ansible.plugins.loader import filter_loader, init_plugin_loader
    init_plugin_loader([sys.argv[1]])
    def ours():
        return sorted(m for m in sys.modules
                      if m.startswith(("ansible_collections.inferops.vllm.plugins.module_utils.",
                                       "ansible_collections.inferops.vllm.plugins.plugin_utils.")))
    first = filter_loader.get(sys.argv[2])
    loaded = ours()
    result = first.j2_function(*json.loads(sys.argv[3])) if len(sys.argv) > 3 else None
    print(json.dumps({"found": first is not None, "at_load": loaded, "after_call": ours(), "result": result}))
""")


def _probe(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, COLLECTIONS_ROOT, *args], capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["inferops.vllm.dpkg_missing", "inferops.vllm.url_host",
                                  "inferops.vllm.instance_problems"])
def test_loading_a_filter_imports_no_rules(name):
    # Every filter file is loaded whichever filter is asked for; none may pull in the rules by itself.
    found = _probe(name)
    assert found["found"]
    assert found["at_load"] == []


def test_a_rule_is_imported_when_its_filter_runs():
    found = _probe("inferops.vllm.valid_api_key", json.dumps(["0123456789abcdefXYZ"]))
    assert found["result"] is True
    assert "ansible_collections.inferops.vllm.plugins.plugin_utils._preflight" in found["after_call"]
