# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""benchmarks/controller_profile.py's summary: it reads the worker profiles the sitecustomize writes and splits
their time into Jinja compiling, plugin imports and module runs on the hosts. A synthetic profile stands in for
ansible's workers: functions of the same names in files of the same paths, each busy for a known share."""

from __future__ import annotations

import cProfile
import importlib.util
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from controller_profile import summarize  # noqa: E402  (benchmarks/ is no package)

# The layout summarize() recognises, with each function busy for a given time (seconds).
FILES = {
    "jinja2/environment.py": "def compile(busy):\n    busy(0.06)\n",
    "ansible/plugins/connection/ssh.py": "def _low_level_execute_command(busy):\n    busy(0.10)\n",
    # busy() is put in its globals before it runs (worker.py below), as the others get it as an argument.
    "ansible_collections/inferops/vllm/plugins/filter/some_filter.py": "busy(0.04)\n",
    "ansible/executor/process/worker.py": (
        "import importlib.util\n"
        "def _run(busy, environment, ssh, plugin_file):\n"
        "    busy(0.02)\n"
        "    environment.compile(busy)\n"
        "    ssh._low_level_execute_command(busy)\n"
        "    spec = importlib.util.spec_from_file_location('some_filter', plugin_file)\n"
        "    module = importlib.util.module_from_spec(spec)\n"
        "    module.busy = busy\n"
        "    spec.loader.exec_module(module)\n"
    ),
}


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem + str(abs(hash(path))), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _busy(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_the_summary_splits_each_workers_time_and_names_its_task(tmp_path):
    src, out = tmp_path / "site-packages", tmp_path / "out"
    out.mkdir()
    for rel, text in FILES.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text, encoding="utf-8")
    worker, environment, ssh = (_load(src / rel) for rel in (
        "ansible/executor/process/worker.py", "jinja2/environment.py", "ansible/plugins/connection/ssh.py"))
    plugin = src / "ansible_collections/inferops/vllm/plugins/filter/some_filter.py"
    for pid, task in ((101, "Publish this host's resolved settings"), (102, "Publish this host's resolved settings"),
                      (103, "Write the config files")):
        profile = cProfile.Profile(time.process_time)  # CPU time: a test worker preempted mid-loop skews nothing
        profile.runcall(worker._run, _busy, environment, ssh, str(plugin))
        profile.dump_stats(str(out / f"{pid}.prof"))
        (out / f"{pid}.name").write_text(task, encoding="utf-8")
    (out / "104.prof").write_bytes(b"")  # a worker that ended before writing its profile is left out

    summary = summarize(out, top=5)

    assert summary["workers"] == 3
    assert summary["task_workers"] == {"Publish this host's resolved settings": 2, "Write the config files": 1}
    totals = summary["totals"]
    wall = totals["worker_wall"]
    # Each part is the share it was busy for (0.06, 0.10, 0.04 of about 0.22 s a worker), within the profiler's noise.
    assert 0.6 < wall < 0.8, totals
    assert 0.18 < totals["jinja_compile"] / wall < 0.36, totals
    assert 0.32 < totals["remote"] / wall < 0.58, totals
    assert 0.10 < totals["plugin_imports"] / wall < 0.26, totals
    assert totals["jinja_compile"] + totals["remote"] + totals["plugin_imports"] < wall
    assert summary["per_task"]["Publish this host's resolved settings"] > summary["per_task"]["Write the config files"]
    assert list(summary["imports"]) == ["inferops/vllm/plugins/filter/some_filter.py"], summary["imports"]
