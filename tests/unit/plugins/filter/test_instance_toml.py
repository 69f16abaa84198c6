# Copyright (c) inferops.vllm contributors
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The instance TOML's one renderer (plugins/plugin_utils/_instance_toml.py, the instance_toml filter) against the
launcher's schema: every per-instance setting is a role variable with a default and an argument spec, and reaches
the TOML and vLLM's argv through the schema alone. The whole role renders the file in test_instance_templates.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible.errors import AnsibleFilterError
from ansible_collections.inferops.vllm.plugins.filter.instance_toml import instance_setting_names, instance_toml
from ansible_collections.inferops.vllm.plugins.module_utils import _vllm_instance_schema as schema
from ansible_collections.inferops.vllm.tests.unit.plugins.filter.utils import launcher
from ansible_collections.inferops.vllm.tests.unit.test_instance_templates import flat

ROLE = Path(__file__).resolve().parents[4] / "roles" / "vllm_instance"
DEFAULTS = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text(encoding="utf-8"))
SPECS = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text(encoding="utf-8"))["argument_specs"]
HOST = {"inventory_hostname": "d1", "pd_role": "decode", "bind_host": "0.0.0.0", "served_model_name": "m",
        "api_key_set": True, "config_dir": "/etc/vllm", "allowed_media_domains": [], "model_path": "/var/lib/vllm/m",
        "kv_transfer_backend": "nixl", "host_address": "10.0.0.21", "cpu_build": True}
INSTANCE = {"name": "decode-0", "port": 8200, "kv_transfer_port": 5700, "kv_fabric": {"transport": "tcp"}}


def defaults() -> dict[str, Any]:
    """The role's per-instance settings as its defaults give them."""
    return {name: DEFAULTS[f"vllm_instance_{name}"] for name in schema.SETTINGS}


def toml(settings: dict[str, Any] | None = None, host: dict[str, Any] | None = None, **instance: Any) -> dict:
    text = instance_toml({**INSTANCE, **instance}, {**defaults(), **(settings or {})}, {**HOST, **(host or {})})
    return launcher().tomllib.loads(text)


def argv(config: dict) -> list[str]:
    return launcher().build(config, None)[0]


def test_every_setting_is_a_role_variable_with_a_default_an_argument_spec_and_an_override_key():
    options = SPECS["main"]["options"]
    overrides = " ".join(options["vllm_instance_instances"]["options"]["overrides"]["description"])
    assert len(set(schema.SETTINGS)) == len(schema.SETTINGS)
    for name in schema.SETTINGS:
        assert f"vllm_instance_{name}" in DEFAULTS, name
        assert f"vllm_instance_{name}" in options, name
        assert f"C({name})" in overrides, name
    assert instance_setting_names("vllm_instance_") == [f"vllm_instance_{name}" for name in schema.SETTINGS]
    assert instance_setting_names("") == list(schema.SETTINGS)


def test_the_role_builds_its_settings_from_the_schema():
    variables = yaml.safe_load((ROLE / "vars" / "main.yml").read_text(encoding="utf-8"))
    assert "inferops.vllm.instance_setting_names" in variables["_vllm_instance_setting_names"]
    assert "_vllm_instance_setting_names" in variables["_vllm_instance_settings"]
    tasks = flat(yaml.safe_load((ROLE / "tasks" / "configure.yml").read_text(encoding="utf-8")))
    (render,) = [t for t in tasks if t["name"].startswith("Write each instance's config.toml")]
    assert "inferops.vllm.instance_toml(" in render["inferops.vllm.config_files"]["files"]
    assert not (ROLE / "templates" / "instance.toml.j2").exists()


@pytest.mark.parametrize("section", [s for s in schema.SCHEMA if s not in ("cpu", "devices", "environment")])
def test_sections_and_keys_follow_the_schemas_order(section):
    config = toml({"environment": {"NCCL_DEBUG": "INFO"}, "extra_args": ["--max-log-len", 10]})
    keys = [key for key in schema.SCHEMA[section] if key in config.get(section, {})]
    assert list(config.get(section, {})) == keys
    assert [s for s in config if s in schema.SCHEMA] == [s for s in schema.SCHEMA if s in config]


@pytest.mark.parametrize(("section", "key", "spec"), [
    (section, key, spec) for section, keys in schema.SCHEMA.items() for key, spec in keys.items() if spec.setting])
def test_each_setting_reaches_its_key(section, key, spec):
    """A value of its kind, other than the default, is written under the key the schema gives the setting."""
    value = {"int": 3, "bool": not DEFAULTS[f"vllm_instance_{spec.setting}"], "fraction": 0.5,
             "str_list": ["--max-log-len", "10"]}.get(spec.kind, (spec.choices or ("something",))[-1])
    config = toml({spec.setting: value})
    assert config[section][key] == value


def test_zero_empty_and_null_leave_vllms_defaults():
    config = toml({"max_model_len": 0, "quantization": "", "enable_chunked_prefill": None, "kv_cache_memory_bytes": 0,
                   "dtype": None})
    assert "max_model_len" not in config["model"] and "quantization" not in config["model"]
    assert "dtype" not in config["model"]
    assert "enable_chunked_prefill" not in config["scheduler"]
    assert config["kv_cache"]["gpu_memory_utilization"] == 0.9
    config = toml({"kv_cache_memory_bytes": 1 << 30})
    assert config["kv_cache"]["memory_bytes"] == 1 << 30 and "gpu_memory_utilization" not in config["kv_cache"]


def test_pd_keys_by_role():
    prefill = toml(host={"pd_role": "prefill"})["pd_disaggregation"]
    assert prefill["role"] == "prefill" and "kv_load_failure_policy" not in prefill
    assert toml()["pd_disaggregation"]["kv_load_failure_policy"] == "recompute"
    assert toml(host={"pd_role": "none"}, kv_fabric=None)["pd_disaggregation"] == {"enabled": False}


def test_what_cannot_be_rendered_names_the_host_the_instance_and_the_setting():
    with pytest.raises(AnsibleFilterError, match=r"d1: instance decode-0: the setting environment is a list, not a"):
        toml({"environment": ["A=1"]})
    with pytest.raises(AnsibleFilterError, match=r"extra_args is a string, not a list of vLLM flags and values"):
        toml({"extra_args": "--max-log-len 10"})


def test_environment_names_that_are_no_bare_toml_key_are_quoted_for_the_launcher_to_refuse():
    config = toml({"environment": {"bad name": "x", "GOOD": 1}})
    assert config["environment"] == {"bad name": "x", "GOOD": "1"}
    assert any(p.startswith('environment.bad name: "bad name" is not a valid environment variable name')
               for p in schema.validate(config))


def test_the_rendered_file_is_what_the_launcher_runs():
    config = toml({"max_num_seqs": 64, "enforce_eager": True})
    assert schema.validate(config) == []
    args = argv(config)
    assert args[:2] == ["serve", "/var/lib/vllm/m"] and args[args.index("--max-num-seqs") + 1] == "64"
    assert "--enforce-eager" in args


@pytest.mark.parametrize("setting", [spec.setting for keys in schema.SCHEMA.values() for spec in keys.values()
                                     if spec.setting and spec.kind == "str"])
@pytest.mark.parametrize("override", [False, True])
def test_the_preflight_names_the_variable_of_every_string_setting(setting, override):
    """The preflight renders the TOML with the same function from what the host published, and names where a value
    the launcher refuses comes from: a setting needs no code of its own there."""
    from ansible_collections.inferops.vllm.plugins.plugin_utils._preflight import launcher_problems

    bad = "not-a-value-vllm-takes"
    host_settings = {**defaults(), "kv_buffer_device": "cpu"}
    del host_settings["environment"], host_settings["extra_args"]  # publish.yml leaves them out
    overrides = {setting: bad} if override else {}
    instance = {"name": "decode-0", "port": 8200, "kv_transfer_port": 5700, "overrides": overrides,
                "settings": {**host_settings, setting: bad}}
    published = {"pd_role": "decode", "address": "10.0.0.21", "served_model_name": "m", "instances": [instance],
                 "settings": host_settings if override else {**host_settings, setting: bad}, "model": "org/m",
                 "model_is_local": False, "kv_transfer_backend": "nixl", "vllm_variant": "cpu", "api_key_set": False}
    variable = f"vllm_instance_instances[decode-0].overrides.{setting}" if override else f"vllm_instance_{setting}"
    (line,) = launcher_problems(published, "d1")
    assert line.startswith(f"[launcher] d1/decode-0: {variable}: the launcher on the host would refuse"), line
    assert f'"{bad}"' in line
