# Copyright (c) inferops.vllm contributors
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""One vLLM instance of the inventory as the controller-side preflight sees it: its settings, resolved.

PRIVATE to the inferops.vllm collection: no compatibility promise; anything here may change or go in
any release. Other collections must not import it.

An Instance is one entry of a host's vllm_instance_instances with the host's settings updated by its
overrides (what roles/vllm_instance/tasks/publish.yml publishes). Its properties resolve what vLLM
would run with (an ``auto`` dtype, an unset block size, max_model_len 0) by the rules of the
vocabulary module, so the checks and the KV sizing compare what vLLM runs, not what was written.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ansible_collections.inferops.vllm.plugins.module_utils import _vllm_vocabulary as vocab
from ansible_collections.inferops.vllm.plugins.plugin_utils._model_facts import ModelFacts
from ansible_collections.inferops.vllm.plugins.plugin_utils._pd_values import text, to_int

# The role's defaults of per-instance settings that plain data (and an older publish) may lack.
SETTING_DEFAULTS = {"shutdown_timeout": 60, "kv_load_failure_policy": "recompute"}


@dataclass
class Instance:
    host: str
    group: str  # prefill | decode (inventory group)
    name: str
    index: int  # position in vllm_instance_instances
    port: Any
    kv_transfer_port: Any
    gpus: Any
    settings: dict[str, Any]
    overrides: dict[str, Any]
    published: Mapping[str, Any]
    facts: ModelFacts
    label: str = ""

    def variable(self, key: str) -> str:
        """Where a setting of this instance comes from: its overrides, or the role variable."""
        if key in self.overrides:
            return f"vllm_instance_instances[{self.name}].overrides.{key}"
        return f"vllm_instance_{key}"

    def setting(self, key: str) -> Any:
        """A per-instance setting as the template sees it: the published one, else the role's default."""
        return self.settings.get(key, SETTING_DEFAULTS[key])

    @property
    def variant(self) -> str:
        return text(self.published.get("vllm_variant") or "cuda")

    @property
    def tp(self) -> int | None:
        return to_int(self.settings.get("tensor_parallel_size", 1))

    @property
    def pp(self) -> int | None:
        return to_int(self.settings.get("pipeline_parallel_size", 1))

    @property
    def raw_kv_cache_dtype(self) -> str:
        """The KV cache dtype as written ('auto' when unset)."""
        return text(self.settings.get("kv_cache_dtype")) or "auto"

    @property
    def dtype(self) -> str | None:
        """Resolved weight dtype (what vLLM makes of 'auto' for the checkpoint's dtype); None when 'auto'
        and the checkpoint's dtype is unknown."""
        return vocab.resolve_dtype(text(self.settings.get("dtype")).lower() or "auto", self.facts.dtype)

    @property
    def kv_cache_dtype(self) -> str:
        """Resolved KV cache dtype ('auto' = the resolved weight dtype, 'fp8' = 'fp8_e4m3'); 'auto' when
        the model's dtype is unknown."""
        return vocab.resolve_kv_cache_dtype(self.raw_kv_cache_dtype, self.dtype) or "auto"

    @property
    def max_model_len(self) -> int | None:
        """Resolved max_model_len: the setting, or the model's own when 0; None when unknown."""
        value = to_int(self.settings.get("max_model_len") or 0)
        if value:
            return value
        return self.facts.max_position_embeddings

    @property
    def block_size(self) -> tuple[int, bool]:
        """(tokens per block, whether it is vLLM's default for the variant)."""
        value = to_int(self.settings.get("block_size") or 0)
        return vocab.resolve_block_size(value, self.variant), not value
