"""Make ``ansible_collections.inferops.vllm`` importable for the unit tests of the collection's plugins.

The checkout is linked as ``.ansible/collections/ansible_collections/inferops/vllm`` by the sandbox
scripts; without that link (a fresh clone) a temporary one is made for the test session.
"""

from __future__ import annotations

import atexit
import os
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


def _playbook_client() -> str | None:
    """The ansible-playbook the tests run: a client of tests/unit/playbook_server.py (the same command, forked from
    a process that imported Ansible once), or None for the real one (INFEROPS_PLAYBOOK_SERVER=0, or no
    ansible-playbook beside this Python)."""
    real = Path(sys.executable).parent / "ansible-playbook"
    if os.environ.get("INFEROPS_PLAYBOOK_SERVER", "1") == "0" or not real.is_file():
        return None
    directory = Path(tempfile.mkdtemp(prefix="inferops-playbooks-"))
    # Removing the directory ends its servers (within a second).
    atexit.register(shutil.rmtree, directory, True)
    if str(Path(__file__).resolve().parent) not in sys.path:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
    from playbook_server import write_client  # pylint: disable=import-outside-toplevel

    return write_client(str(directory), str(real))


# test_preflight_inventories.ANSIBLE_PLAYBOOK (what the tests run) reads it; set before any test module is imported.
PLAYBOOK_CLIENT = _playbook_client()
if PLAYBOOK_CLIENT:
    os.environ["INFEROPS_ANSIBLE_PLAYBOOK"] = PLAYBOOK_CLIENT
