"""One vocabulary (plugins/module_utils/_vllm_vocabulary.py), read by the preflight and by the launcher.

Every value the vocabulary accepts is accepted by the launcher (as it runs on a host, loaded from the
file beside it) and by the controller-side preflight; every value next to it that one refuses, the
other refuses too. The places that used to keep their own lists (the role's argument spec, its vars)
follow the vocabulary, and the role ships the file beside the launcher.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible_collections.inferops.vllm.plugins.module_utils import _vllm_vocabulary as vocab
from ansible_collections.inferops.vllm.plugins.plugin_utils import _preflight as pf
from ansible_collections.inferops.vllm.tests.unit.plugins.filter.utils import COMMIT, GIB, SMOL, settings
from ansible_collections.inferops.vllm.tests.unit.test_instance_templates import flat

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "roles" / "vllm_instance" / "files" / "inferops_vllm_launch.py"
ROLE = REPO / "roles" / "vllm_instance"


def _host_launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The launcher as a host has it: a copy beside copies of its schema and the vocabulary, its directory on
    sys.path (as a script's is), loaded on its own."""
    for path in (LAUNCHER, Path(pf.schema.__file__), Path(vocab.__file__)):
        (tmp_path / path.name).write_bytes(path.read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("_vllm_instance_schema", "_vllm_vocabulary"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    spec = importlib.util.spec_from_file_location("host_launcher", tmp_path / LAUNCHER.name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert Path(module.schema.__file__) == tmp_path / "_vllm_instance_schema.py"
    assert Path(module.schema.VOCAB.__file__) == tmp_path / "_vllm_vocabulary.py"
    assert module.schema is not pf.schema
    return module


# (vocabulary list, instance setting, TOML section and key, values next to the list that are refused)
SETTINGS = [
    ("DTYPES", "dtype", "model", "dtype", ["bf16", "fp16", "BFLOAT16", "float64", "fp8"]),
    ("QUANTIZATION_METHODS", "quantization", "model", "quantization", ["int4", "AWQ", "nf4"]),
    ("KV_CACHE_DTYPES", "kv_cache_dtype", "kv_cache", "quant_dtype",
     [*vocab.KV_CACHE_DTYPE_REFUSED, "int4", "float16", "fp16", "FP8"]),
    ("BLOCK_SIZES", "block_size", "kv_cache", "block_size", [2, 24, 256]),
    ("KV_BUFFER_DEVICES", "kv_buffer_device", "pd_disaggregation", "kv_buffer_device", ["gpu", "CUDA"]),
    ("KV_LOAD_FAILURE_POLICIES", "kv_load_failure_policy", "pd_disaggregation", "kv_load_failure_policy",
     ["retry", "FAIL"]),
]
PD = {"enabled": True, "role": "decode", "side_channel_host": "10.0.0.21", "kv_transfer_port": 5700}
CASES = [(name, setting, section, key, value, value in getattr(vocab, name))
         for name, setting, section, key, refused in SETTINGS
         for value in (*getattr(vocab, name), *refused)]


def _launcher_accepts(launch, section: str, key: str, value: Any) -> bool:
    config: dict[str, Any] = {"server": {}, "model": {"name": "/var/lib/vllm/models/m"}}
    if section == "pd_disaggregation":
        config[section] = dict(PD)
    config.setdefault(section, {})[key] = value
    return launch.validate(config) == []


def _preflight_accepts(setting: str, value: Any) -> bool:
    """pd_preflight of one decode host (decode renders every setting, the KV load failure policy too)."""
    published = {
        "pd_role": "decode", "address": "10.0.0.21", "served_model_name": "m",
        "instances": [{"name": "decode-0", "port": 8200, "kv_transfer_port": 5700, "overrides": {},
                       "settings": settings(max_model_len=512, kv_cache_memory_bytes=GIB, **{setting: value})}],
        "settings": settings(max_model_len=512, kv_cache_memory_bytes=GIB, **{setting: value}),
        "address_source": "vllm_instance_host_address",
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct", "model_revision": COMMIT, "model_is_local": False,
        "model_facts": dict(SMOL), "kv_transfer_backend": "nixl", "vllm_version": "0.32.0", "vllm_variant": "cpu",
        "api_key_set": True, "api_key_broken": False, "unsupported": {}, "booleans": {},
    }
    lines = pf.pd_preflight({"d1": {"vllm_instance_published": published}},
                            {"prefill": [], "decode": ["d1"], "router": []}, {"pd_enabled": False})
    return not [line for line in lines if f"vllm_instance_{setting}" in line]


@pytest.fixture(scope="module")
def host_launcher(tmp_path_factory):
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield _host_launcher(tmp_path_factory.mktemp("host"), monkeypatch)


@pytest.mark.parametrize(("name", "setting", "section", "key", "value", "listed"), CASES,
                         ids=[f"{c[1]}={c[4]!r}" for c in CASES])
def test_preflight_and_launcher_accept_the_same_values(host_launcher, name, setting, section, key, value, listed):
    launcher = _launcher_accepts(host_launcher, section, key, value)
    preflight = _preflight_accepts(setting, value)
    assert launcher is preflight is listed, (name, value, launcher, preflight)


def test_the_launcher_on_a_host_reads_the_vocabulary_beside_it(host_launcher):
    for name in ("DTYPES", "KV_CACHE_DTYPES", "BLOCK_SIZES", "QUANTIZATION_METHODS", "KV_BUFFER_DEVICES",
                 "KV_LOAD_FAILURE_POLICIES", "KV_TRANSFER_BACKENDS", "PD_ROLES", "KV_TRANSPORTS"):
        assert getattr(host_launcher.schema.VOCAB, name) == getattr(vocab, name), name
    choices = {(section, key): spec.choices for section, keys in host_launcher.schema.SCHEMA.items()
               for key, spec in keys.items() if spec.choices}
    assert choices == {
        ("model", "dtype"): vocab.DTYPES, ("model", "quantization"): vocab.QUANTIZATION_METHODS,
        ("kv_cache", "quant_dtype"): vocab.KV_CACHE_DTYPES, ("kv_cache", "block_size"): vocab.BLOCK_SIZES,
        ("pd_disaggregation", "role"): tuple(vocab.PD_ROLES),
        ("pd_disaggregation", "kv_transfer_backend"): tuple(vocab.KV_TRANSFER_BACKENDS),
        ("pd_disaggregation", "kv_buffer_device"): vocab.KV_BUFFER_DEVICES,
        ("pd_disaggregation", "kv_load_failure_policy"): vocab.KV_LOAD_FAILURE_POLICIES,
        ("kv_fabric", "transport"): vocab.KV_TRANSPORTS,
    }


def test_refused_kv_cache_dtypes_are_not_accepted_and_say_why():
    assert not set(vocab.KV_CACHE_DTYPE_REFUSED) & set(vocab.KV_CACHE_DTYPES)
    for value in vocab.KV_CACHE_DTYPE_REFUSED:
        assert vocab.kv_cache_dtype_refusal(value) == vocab.KV_CACHE_DTYPE_REFUSED[value]
    assert vocab.kv_cache_dtype_refusal("int4") == "vLLM 0.32 has no 4-bit KV cache"
    assert vocab.kv_cache_dtype_refusal("float16") is None


def test_vllm_dtype_spellings():
    # vLLM's ModelDType: auto, half, float16, bfloat16, float, float32; "bf16" is not one of them.
    assert set(vocab.DTYPES) == {"auto", "half", "float16", "bfloat16", "float", "float32"}
    assert not set(vocab.DTYPE_MISSPELLINGS) & set(vocab.DTYPES)
    assert set(vocab.DTYPE_MISSPELLINGS.values()) <= set(vocab.DTYPES)
    # A checkpoint's torch_dtype is one of torch's names; "bf16" is none.
    assert "bf16" not in vocab.CHECKPOINT_DTYPES
    assert set(vocab.CHECKPOINT_DTYPES.values()) <= set(vocab.AUTO_DTYPES)


def test_the_role_refuses_the_removed_settings_of_the_vocabulary():
    unsupported = yaml.safe_load((ROLE / "vars" / "main.yml").read_text(encoding="utf-8"))["_vllm_instance_unsupported"]
    assert set(unsupported) == {f"vllm_instance_{name}" for name in vocab.REMOVED_SETTINGS}


def test_the_argument_spec_keeps_choices_only_where_no_better_message_exists():
    specs = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text(encoding="utf-8"))
    options = specs["argument_specs"]["main"]["options"]
    # The preflight says why these are refused (a 4-bit KV cache, the removed nccl backend, bf16 -> bfloat16, a
    # host with both PD roles): no choices hide that.
    for name in ("vllm_instance_dtype", "vllm_instance_kv_cache_dtype", "vllm_instance_kv_transfer_backend",
                 "vllm_instance_pd_role", "vllm_instance_quantization"):
        assert "choices" not in options[name], name
    # Prefill hosts do not render these, so the launcher check does not see them there: the spec keeps them.
    assert tuple(options["vllm_instance_kv_buffer_device"]["choices"]) == vocab.KV_BUFFER_DEVICES
    assert tuple(options["vllm_instance_kv_load_failure_policy"]["choices"]) == vocab.KV_LOAD_FAILURE_POLICIES


def test_the_role_installs_the_schema_and_the_vocabulary_beside_the_launcher():
    tasks = flat(yaml.safe_load((ROLE / "tasks" / "configure.yml").read_text(encoding="utf-8")))
    (task,) = [t for t in tasks
               if t["name"] == "Install the launcher, its schema and vocabulary, and the instance key middleware"]
    assert "_vllm_instance_launcher_files" in task["inferops.vllm.config_files"]["files"]
    entries = yaml.safe_load((ROLE / "vars" / "main.yml").read_text(encoding="utf-8"))["_vllm_instance_launcher_files"]
    sources = [entry["src"] for entry in entries]
    assert sources[0] == LAUNCHER.name and entries[0]["path"] == "{{ _vllm_instance_launcher }}"
    # The launcher's --middleware module, on vLLM's PYTHONPATH as the launcher's own directory (issue #25).
    assert sources[3] == "inferops_vllm_auth.py" and (LAUNCHER.parent / sources[3]).is_file()
    modules = [Path(source.replace("{{ role_path }}", str(ROLE))).resolve() for source in sources[1:3]]
    assert modules == [Path(pf.schema.__file__).resolve(), Path(vocab.__file__).resolve()]
    # Each goes beside the launcher, under its own name (the launcher imports them by name).
    for entry in entries[1:]:
        assert entry["path"] == "{{ _vllm_instance_launcher | dirname }}/" + Path(entry["src"]).name


@pytest.mark.skipif(shutil.which("ansible-galaxy") is None, reason="ansible-galaxy is not installed")
def test_the_collection_artifact_holds_the_launcher_its_schema_and_vocabulary(tmp_path):
    subprocess.run(["ansible-galaxy", "collection", "build", "--output-path", str(tmp_path), str(REPO)],
                   check=True, capture_output=True, text=True, timeout=300)
    (artifact,) = tmp_path.glob("inferops-vllm-*.tar.gz")
    with tarfile.open(artifact) as tar:
        names = set(tar.getnames())
    for relative in ("roles/vllm_instance/files/inferops_vllm_launch.py", "plugins/module_utils/_vllm_vocabulary.py",
                     "plugins/module_utils/_vllm_instance_schema.py",
                     "plugins/plugin_utils/_model_facts.py", "plugins/plugin_utils/_kv_sizing.py",
                     "plugins/plugin_utils/_pd_instance.py", "plugins/plugin_utils/_pd_values.py",
                     "plugins/plugin_utils/_preflight.py"):
        assert relative in names, relative
