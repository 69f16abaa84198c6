"""inferops.vllm.parity_change_problems: a setting prefill and decode must agree on, changed on a running
instance, is refused (a rolling restart would mix the two values for minutes); other changes, new instances and
instances that do not run are not. The running config.toml is written from the same render the filter compares
with, so a line here is the comparison's, not a renderer's difference (molecule compares with the real files)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from ansible_collections.inferops.vllm.plugins.plugin_utils import _preflight as pf
from ansible_collections.inferops.vllm.tests.unit.plugins.filter.test_instance_toml import defaults


def published(model_identity: str = "", **settings: Any) -> dict[str, Any]:
    host_settings = {**defaults(), "kv_buffer_device": "cpu", **settings}
    del host_settings["environment"], host_settings["extra_args"]  # publish.yml leaves them out
    instances = [{"name": name, "port": port, "kv_transfer_port": kv, "overrides": {}, "settings": host_settings}
                 for name, port, kv in (("decode-0", 8200, 5700), ("decode-1", 8201, 5701))]
    return {"pd_role": "decode", "address": "10.0.0.21", "served_model_name": "m", "instances": instances,
            "settings": host_settings, "model": "org/m", "model_is_local": False, "kv_transfer_backend": "nixl",
            "vllm_variant": "cpu", "api_key_set": False, "model_identity": model_identity}


def running_toml(record: dict[str, Any], name: str) -> str:
    """The parity and port keys of the instance as the run would write them, as its config.toml holds them."""
    inv = pf._one_host(pf._Report(), "parity", record, "d1", None)
    inst = next(i for i in inv.instances if i.name == name)
    config, _sources, _unrenderable = pf._launcher_config(inv, inst)
    lines = []
    for section in sorted({section for (section, _key), _name in pf.PARITY_TOML_KEYS + pf.PORT_TOML_KEYS}):
        lines.append(f"[{section}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in (config.get(section) or {}).items()
                  if isinstance(value, (str, int, bool)) and not isinstance(value, float)]
    return "\n".join(lines) + "\n"


def test_nothing_changed_or_a_setting_outside_parity_changed_passes():
    before = published()
    running = {name: running_toml(before, name) for name in ("decode-0", "decode-1")}
    assert pf.parity_change_problems(before, "d1", running) == []
    assert pf.parity_change_problems(published(max_num_seqs=8), "d1", running) == []


@pytest.mark.parametrize(("setting", "value", "variable"), [
    ("kv_cache_dtype", "fp8_e5m2", "vllm_instance_kv_cache_dtype"),
    ("max_model_len", 1024, "vllm_instance_max_model_len"),
    ("dtype", "float32", "vllm_instance_dtype"),
])
def test_a_shared_setting_changed_on_running_instances_is_refused_with_the_ways(setting, value, variable):
    before = published()
    running = {name: running_toml(before, name) for name in ("decode-0", "decode-1")}
    (line,) = pf.parity_change_problems(published(**{setting: value}), "d1", running)
    assert line.startswith(f"[parity] d1: {variable}: changes on running instances (decode-0 "), line
    assert "decode-1 " in line and f"-> {pf._show(value)}" in line
    assert "vllm_instance_restart_strategy=immediate" in line and "second deployment" in line


def test_instances_that_do_not_run_may_change():
    """decode-1 does not run (no config read): only decode-0 is named."""
    before = published()
    (line,) = pf.parity_change_problems(published(kv_cache_dtype="fp8_e5m2"), "d1",
                                        {"decode-0": running_toml(before, "decode-0")})
    assert "decode-0 " in line and "decode-1" not in line
    assert pf.parity_change_problems(published(kv_cache_dtype="fp8_e5m2"), "d1", {}) == []


@pytest.mark.parametrize(("setting", "value", "old"), [("port", 8210, 8200), ("kv_transfer_port", 5710, 5700)])
def test_a_port_change_of_a_running_instance_is_refused_with_the_way(setting, value, old):
    """The routers and the firewall would move to the new port while the instance serves the old one until its
    roll (the old one then open to any address)."""
    before = published()
    running = {"decode-0": running_toml(before, "decode-0")}
    after = published()
    after["instances"][0][setting] = value
    (line,) = pf.parity_change_problems(after, "d1", running)
    assert line.startswith(f"[ports] d1: vllm_instance_instances[decode-0].{setting}: changes on the running instance "
                           f"({old} -> {value})"), line
    assert "under a new name" in line and "vllm_instance_restart_strategy=immediate" in line
    assert pf.parity_change_problems(before, "d1", running) == []


@pytest.mark.parametrize(("before", "after"), [
    ("revision " + "a" * 40, "revision " + "b" * 40),  # a hub model's new revision
    ("copy " + "1" * 64, "copy " + "2" * 64),  # a controller directory with other files
])
def test_other_weights_on_running_instances_are_refused(before, after):
    """Issue #24: a new model revision or copy keeps the model's directory (its path), so [model] name does not
    change; [model] identity does, and a roll would have decode continue KV that prefill computed with other
    weights."""
    running = {name: running_toml(published(model_identity=before), name) for name in ("decode-0", "decode-1")}
    assert f'identity = "{before}"' in running["decode-0"]
    assert pf.parity_change_problems(published(model_identity=before), "d1", running) == []
    (line,) = pf.parity_change_problems(published(model_identity=after), "d1", running)
    assert line.startswith("[parity] d1: vllm_instance_model, vllm_instance_model_revision: changes on running "
                           f"instances (decode-0 '{before}' -> '{after}'; decode-1 "), line
    assert "vllm_instance_restart_strategy=immediate" in line and "second deployment" in line


def test_a_running_config_without_an_identity_is_not_a_change():
    """A config.toml of an earlier release has no [model] identity: the first run of this one writes it (a roll),
    without refusing; nor is an identity this run cannot know (a record published before the preflight)."""
    running = {"decode-0": running_toml(published(), "decode-0")}
    assert "identity" not in running["decode-0"]
    assert pf.parity_change_problems(published(model_identity="copy " + "1" * 64), "d1", running) == []
    running = {"decode-0": running_toml(published(model_identity="copy " + "1" * 64), "decode-0")}
    assert pf.parity_change_problems(published(), "d1", running) == []
