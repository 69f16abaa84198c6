"""Make ``ansible_collections.inferops.vllm`` importable for the unit tests of the collection's plugins.

The checkout is linked as ``.ansible/collections/ansible_collections/inferops/vllm`` by the sandbox
scripts; without that link (a fresh clone) a temporary one is made for the test session.
"""

from __future__ import annotations

import atexit
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _collections_root() -> Path:
    root = REPO / ".ansible" / "collections"
    link = root / "ansible_collections" / "inferops" / "vllm"
    if link.exists() and link.resolve() == REPO:
        return root
    tmp = Path(tempfile.mkdtemp(prefix="inferops-vllm-collections-"))
    atexit.register(shutil.rmtree, tmp, True)
    (tmp / "ansible_collections" / "inferops").mkdir(parents=True)
    (tmp / "ansible_collections" / "inferops" / "vllm").symlink_to(REPO, target_is_directory=True)
    return tmp


_ROOT = str(_collections_root())
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
