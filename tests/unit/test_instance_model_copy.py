"""vllm_instance's copy of a controller model directory (tasks/model.yml), run by the real ansible-playbook on
localhost (issue #24): a new copy is unpacked beside the model directory the instances load and then takes its
place, so the directory holds one copy's files, whole: never new files over an older copy's, never the files of a
copy stopped halfway (which the next run removes). An unchanged copy is left alone. Run as root, as CI does."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_instance_hub_model import play, recap
from test_preflight_inventories import ANSIBLE_PLAYBOOK

pytestmark = [
    pytest.mark.skipif(ANSIBLE_PLAYBOOK is None, reason="ansible-playbook is not installed"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the role makes root own the model (run as root, as CI does)"),
]


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_a_new_copy_takes_the_place_of_the_old_one_whole(tmp_path):
    src = tmp_path / "controller" / "tiny-model"
    src.mkdir(parents=True)
    (src / "config.json").write_text('{"model_type": "llama"}')
    (src / "model-a.safetensors").write_text("weights of copy a")
    hosts = {"web-1": {"vllm_instance_model": str(src)}}
    models = tmp_path / "models"
    live = models / "tiny-model"

    first = play(tmp_path, "model", hosts)
    assert recap(first)["web-1"][3] == 0 and recap(first)["web-1"][1] >= 1, first
    (marker_a,) = [n for n in names(live) if n.startswith(".inferops-model-")]
    assert names(live) == sorted([marker_a, "config.json", "model-a.safetensors"])

    # What a copy stopped halfway left beside the directory, and other weights on the controller.
    (models / "tiny-model.inferops-copy").mkdir()
    (models / "tiny-model.inferops-copy" / "half-copied.safetensors").write_text("partial")
    (src / "model-a.safetensors").unlink()
    (src / "model-b.safetensors").write_text("weights of copy b")
    second = play(tmp_path, "model", hosts)
    assert recap(second)["web-1"][3] == 0, second
    (marker_b,) = [n for n in names(live) if n.startswith(".inferops-model-")]
    assert marker_b != marker_a
    # The new copy alone: no file of copy a, none of the stopped copy, nothing left beside the directory.
    assert names(live) == sorted([marker_b, "config.json", "model-b.safetensors"])
    assert names(models) == ["tiny-model"]
    assert oct(live.stat().st_mode & 0o777) == "0o750"

    third = play(tmp_path, "model", hosts)
    assert recap(third)["web-1"][1] == 0 and recap(third)["web-1"][3] == 0, third
