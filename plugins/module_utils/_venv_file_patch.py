# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What the modules that change one line of a pinned upstream file in a venv share (nixl_progress_delay,
vllm_nixl_cpu_affinity): the checksum they compare with the pinned release's file, and the atomic write."""

from __future__ import annotations

import hashlib
import os
import tempfile


def sha256(text):
    """SHA-256 of a file's text, as the role's pinned checksums are written (UTF-8, hex)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def write_atomically(module, path, text):
    """Replace ``path`` with ``text`` through a temporary file beside it (module.atomic_move keeps the mode)."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".inferops-", suffix=".py")
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    module.atomic_move(tmp, path)
