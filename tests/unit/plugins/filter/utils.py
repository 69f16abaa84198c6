# Copyright (c) inferops.vllm contributors
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What the preflight tests share: the sandbox's model config, an instance's published settings with the
role's defaults (roles/vllm_instance/vars/main.yml `_vllm_instance_settings`), and the launcher as a module."""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any

LAUNCHER = Path(__file__).resolve().parents[4] / "roles" / "vllm_instance" / "files" / "inferops_vllm_launch.py"

# SmolLM2-135M-Instruct, the sandbox's model (its config.json).
SMOL = {
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "num_hidden_layers": 30,
    "head_dim": 64,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 8192,
}
GIB = 1 << 30
# A hub model is served at a pinned commit (the preflight's model check refuses a branch such as main).
COMMIT = "cf98f3b3bbb457ad9e2bb7baf9a0125b6b88caa8"


def settings(**kw: Any) -> dict[str, Any]:
    """One host's published instance settings: the role's defaults, with ``kw`` over them."""
    base = {
        "dtype": "auto", "max_model_len": 0, "quantization": "", "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1, "enforce_eager": False, "trust_remote_code": False, "kv_cache_dtype": "auto",
        "kv_cache_memory_bytes": 0, "gpu_memory_utilization": 0.9, "num_gpu_blocks_override": 0, "block_size": 0,
        "enable_prefix_caching": True, "max_num_seqs": 0, "max_num_batched_tokens": 0,
        "enable_chunked_prefill": None, "kv_buffer_device": "cpu", "kv_load_failure_policy": "recompute",
        "shutdown_timeout": 60,
    }
    base.update(kw)
    return base


@lru_cache(maxsize=1)
def launcher() -> ModuleType:
    """The instance launcher (a script) as a module, for build() and tomllib: it imports the collection's schema
    module, the one the preflight imports."""
    spec = importlib.util.spec_from_file_location("inferops_vllm_launch_for_tests", LAUNCHER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
