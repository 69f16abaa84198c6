# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Where the controller's time goes in an ansible-playbook run: every task's worker process profiled (cProfile).

    python3 benchmarks/controller_profile.py                                   # deploy_pd.yml on the sandbox
    python3 benchmarks/controller_profile.py -- -i tests/preflight/good playbooks/preflight.yml
    python3 benchmarks/controller_profile.py --top 30 -- -i inventories/sandbox playbooks/deploy_pd.yml

Ansible forks one worker process per task and host; that is where a task's templating, plugin loading and the wait
for its module on the host happen. This runs ansible-playbook with a sitecustomize (in a temporary directory on
PYTHONPATH, nothing installed) that wraps each worker's run in cProfile, then prints, over all workers:

  worker wall      the workers' time under the profiler (cProfile's overhead included: compare shares, not seconds)
  jinja compile    Jinja compiling template source to Python (ansible-core 2.19 keeps no compiled template from
                   one worker to the next: each task's worker compiles every expression it templates)
  plugin imports   module-level code of plugin files imported in the worker (a filter, test or lookup the
                   parent process had not loaded; for a collection's filter, every filter file of it)
  remote           waiting for module runs on the hosts (the connection's commands)

and the tasks and imported files that cost most. It asserts nothing; the sandbox of scripts/sandbox/up.sh must
be up for the default run (a no-op deploy_pd.yml; measured figures in benchmarks/RESULTS.md, note 1).
"""

from __future__ import annotations

import argparse
import collections
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT = ["-i", "inventories/sandbox", "playbooks/deploy_pd.yml"]

# Wraps WorkerProcess._run once ansible's task queue manager is imported (the parent forks the workers after it).
SITECUSTOMIZE = '''
import builtins, os
_out = os.environ["INFEROPS_PROFILE_DIR"]
_import = builtins.__import__
_patched = []
def _patch():
    from ansible.executor.process import worker
    run = worker.WorkerProcess._run
    def _run(self, *args, **kwargs):
        import cProfile
        profile = cProfile.Profile()
        profile.enable()
        try:
            return run(self, *args, **kwargs)
        finally:
            profile.disable()
            task = getattr(self, "_task", None)
            name = task.get_name() if task is not None else "?"
            profile.dump_stats(os.path.join(_out, f"{os.getpid()}.prof"))
            with open(os.path.join(_out, f"{os.getpid()}.name"), "w") as handle:
                handle.write(name)
    worker.WorkerProcess._run = _run
def _hook(name, *args, **kwargs):
    module = _import(name, *args, **kwargs)
    if not _patched and name.startswith("ansible.executor.task_queue_manager"):
        _patched.append(True)
        _patch()
    return module
builtins.__import__ = _hook
'''


def summarize(directory: Path, top: int) -> dict:
    totals = collections.Counter()
    per_task = collections.Counter()
    per_task_compile = collections.Counter()
    workers = collections.Counter()
    imports = collections.Counter()
    for prof in directory.glob("*.prof"):
        try:
            stats = pstats.Stats(str(prof)).stats
        except (EOFError, ValueError, TypeError):
            continue  # a worker that ended without writing its profile
        name_file = prof.with_suffix(".name")
        task = name_file.read_text(encoding="utf-8") if name_file.exists() else "?"
        wall = max([v[3] for k, v in stats.items() if k[2] == "_run" and k[0].endswith("worker.py")] or [0.0])
        compile_ = sum(v[3] for k, v in stats.items() if k[2] == "compile" and k[0].endswith("jinja2/environment.py"))
        remote = sum(v[3] for k, v in stats.items() if k[2] == "_low_level_execute_command")
        plugin_imports = 0.0
        for k, v in stats.items():
            if k[2] == "<module>" and "/plugins/" in k[0] and k[0].endswith(".py"):
                imports[k[0].split("site-packages/")[-1].split("collections/")[-1]] += v[3]
                if "/plugins/filter/" in k[0] or "/plugins/test/" in k[0] or "/plugins/lookup/" in k[0]:
                    plugin_imports += v[3]
        totals.update(worker_wall=wall, jinja_compile=compile_, remote=remote, plugin_imports=plugin_imports)
        per_task[task] += wall
        per_task_compile[task] += compile_
        workers[task] += 1
    return {"totals": totals, "workers": sum(workers.values()), "per_task": per_task,
            "per_task_compile": per_task_compile, "task_workers": workers, "imports": imports, "top": top}


def report(summary: dict) -> None:
    totals = summary["totals"]
    wall = totals["worker_wall"] or 1.0
    print(f"\n{summary['workers']} workers, {totals['worker_wall']:.1f} s of worker wall time under the profiler")
    for key, label in (("jinja_compile", "jinja compile"), ("plugin_imports", "plugin imports (filter/test/lookup)"),
                       ("remote", "remote (module runs on the hosts)")):
        print(f"  {label:40s} {totals[key]:7.1f} s  {100 * totals[key] / wall:5.1f} %")
    print(f"\ntasks by worker time (workers, seconds, of it jinja compile), top {summary['top']}:")
    for task, seconds in summary["per_task"].most_common(summary["top"]):
        print(f"  {summary['task_workers'][task]:3d} {seconds:6.2f} s {summary['per_task_compile'][task]:5.2f} s  "
              f"{task[:110]}")
    print(f"\nplugin files imported in workers (module-level code, summed), top {summary['top'] // 2}:")
    for path, seconds in summary["imports"].most_common(summary["top"] // 2):
        print(f"  {seconds:6.2f} s  {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=20, help="rows in the task and import tables")
    parser.add_argument("args", nargs="*", help="ansible-playbook's arguments (after --); default: "
                        + " ".join(DEFAULT))
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="inferops-controller-profile-") as tmp:
        site, out = Path(tmp) / "site", Path(tmp) / "out"
        site.mkdir()
        out.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE, encoding="utf-8")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
               "INFEROPS_PROFILE_DIR": str(out)}
        command = ["ansible-playbook", *(options.args or DEFAULT)]
        print("$ " + " ".join(command), flush=True)
        start = time.monotonic()
        run = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=False)
        print(f"exit status {run.returncode}, {time.monotonic() - start:.1f} s wall (profiled, so slower than usual)")
        if run.returncode != 0:
            print(run.stdout[-3000:] + run.stderr[-2000:], file=sys.stderr)
        summary = summarize(out, options.top)
    if not summary["workers"]:
        print("no worker profile was written: is this ansible-core's WorkerProcess layout?", file=sys.stderr)
        return 1
    report(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
