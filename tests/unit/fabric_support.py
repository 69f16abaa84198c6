"""Recorded sysfs trees (tests/unit/fixtures/sysfs/*.tree) made into directories the rdma_fabric_facts module reads.

The trees are text (see tests/unit/fixtures/sysfs/make_trees.py for the format), so the repository holds no symbolic
links; a test builds the directory, links included, under its own temporary directory.
"""

from __future__ import annotations

import os
from pathlib import Path

TREES = Path(__file__).resolve().parent / "fixtures" / "sysfs"


def layouts() -> list[str]:
    return sorted(p.stem for p in TREES.glob("*.tree"))


def materialise(name: str, root: Path) -> Path:
    """Build the tree ``name`` under ``root`` and return ``root``."""
    for number, line in enumerate((TREES / f"{name}.tree").read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        if " -> " in line:
            path, target = line.split(" -> ", 1)
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(target, root / path)
        elif " = " in line:
            path, content = line.split(" = ", 1)
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(content + "\n", encoding="utf-8")
        else:
            raise AssertionError(f"{name}.tree:{number}: neither 'path = content' nor 'path -> target': {line!r}")
    return root
