"""scripts/record_fabric_sysfs.py records what rdma_fabric_facts reads: a recorded tree, built again, gives the
module the same facts. Checked on the recorded layouts (built, recorded, built again) and on this machine's /sys."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from ansible_collections.inferops.vllm.plugins.modules.rdma_fabric_facts import gather
from ansible_collections.inferops.vllm.tests.unit import fabric_support
from ansible_collections.inferops.vllm.tests.unit.fabric_support import layouts, materialise

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "record_fabric_sysfs.py"


def _recorder():
    spec = importlib.util.spec_from_file_location("record_fabric_sysfs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


record = _recorder()


def rebuilt(root: Path, tmp_path: Path, monkeypatch) -> Path:
    """``root`` recorded into a .tree, and that tree built again."""
    recorder = record.Recorder(str(root))
    recorder.record()
    trees = tmp_path / "trees"
    trees.mkdir()
    (trees / "recorded.tree").write_text(recorder.text("a test"), encoding="utf-8")
    monkeypatch.setattr(fabric_support, "TREES", trees)
    return materialise("recorded", tmp_path / "again")


@pytest.mark.parametrize("name", layouts())
def test_a_recorded_layout_recorded_again_gives_the_same_facts(name, tmp_path, monkeypatch):
    original = materialise(name, tmp_path / "original")
    assert gather(str(rebuilt(original, tmp_path, monkeypatch))) == gather(str(original))


@pytest.mark.skipif(not Path("/sys/bus/pci").is_dir(), reason="no sysfs here")
def test_this_machines_sysfs_recorded_gives_the_same_facts(tmp_path, monkeypatch):
    assert gather(str(rebuilt(Path("/sys"), tmp_path, monkeypatch))) == gather("/sys")
