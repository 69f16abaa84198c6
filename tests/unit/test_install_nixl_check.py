"""vllm_install's check after an install (roles/vllm_install/vars/main.yml, _vllm_install_check_script): the
installed NIXL must be the pin and have what vLLM 0.32 imports from it, on stand-in NIXL packages (the real NIXL
1.5.1 wheel passed the same script by hand: "nixl 1.5.1 has the API vLLM uses; vllm 0.32.0+cpu")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
VARS = yaml.safe_load((REPO / "roles" / "vllm_install" / "vars" / "main.yml").read_text(encoding="utf-8"))
DEFAULTS = yaml.safe_load((REPO / "roles" / "vllm_install" / "defaults" / "main.yml").read_text(encoding="utf-8"))


def render(name: str) -> str:
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    env.filters["to_json"] = json.dumps
    return env.from_string(VARS[name]).render(**DEFAULTS, **VARS)


AGENT_CONFIG = ("class nixl_agent_config:\n"
                "    def __init__(self, enable_prog_thread=True, capture_telemetry=False, num_threads=0,\n"
                "                 backends=['UCX']):\n        pass\n")


def stand_in(root: Path, nixl_version="1.5.1", api=AGENT_CONFIG + "class nixl_agent:\n    pass\n",
             bindings="class nixlXferTelemetry:\n    pass\n") -> Path:
    (root / "nixl").mkdir(parents=True)
    (root / "nixl" / "__init__.py").write_text("")
    (root / "nixl" / "_api.py").write_text(api)
    (root / "nixl" / "_bindings.py").write_text(bindings)
    for dist, version in (("nixl", nixl_version), ("vllm", "0.32.0+cpu")):
        info = root / f"{dist}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    return root


def check(root: Path) -> str:
    run = subprocess.run([sys.executable, "-c", render("_vllm_install_check_script")], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(root)}, timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_the_pinned_nixl_with_the_api_passes(tmp_path):
    expect = render("_vllm_install_check_expect")
    assert expect == f"nixl {DEFAULTS['vllm_install_nixl_version']} has the API vLLM uses; vllm 0.32.0"
    assert check(stand_in(tmp_path)).startswith(expect)


@pytest.mark.parametrize(("kwargs", "said"), [
    ({"bindings": "pass\n"}, "nixl 1.5.1 lacks nixl._bindings.nixlXferTelemetry; vllm 0.32.0+cpu"),
    ({"api": "class nixl_agent_config:\n    def __init__(self, backends=None):\n        pass\nclass nixl_agent:\n"
             "    pass\n"},
     "nixl 1.5.1 lacks nixl_agent_config(capture_telemetry=...), nixl_agent_config(num_threads=...); vllm 0.32.0+cpu"),
    ({"nixl_version": "1.4.0"}, "nixl 1.4.0 has the API vLLM uses; vllm 0.32.0+cpu"),
])
def test_another_nixl_fails_the_check_and_says_why(tmp_path, kwargs, said):
    out = check(stand_in(tmp_path, **kwargs))
    assert out == said
    assert not out.startswith(render("_vllm_install_check_expect"))
