# Copyright (c) inferops.vllm contributors
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What the controller-side preflight knows about a host's model: heads, layers, context, dtype, weights.

PRIVATE to the inferops.vllm collection: no compatibility promise; anything here may change or go in
any release. Other collections must not import it.

The facts come from the model's config.json when vllm_instance_model is a directory on the controller
(its values win), completed by the inventory's vllm_instance_model_facts (a hub model's only source).
Runs on the controller only; reads files, changes nothing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ansible_collections.inferops.vllm.plugins.module_utils._vllm_vocabulary import CHECKPOINT_DTYPES
from ansible_collections.inferops.vllm.plugins.plugin_utils._pd_values import text, to_int

FACT_KEYS = ("num_attention_heads", "num_key_value_heads", "num_hidden_layers", "head_dim", "hidden_size",
             "max_position_embeddings", "weights_bytes")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


@dataclass
class ModelFacts:
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    num_hidden_layers: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int | None = None
    weights_bytes: int | None = None
    dtype: str | None = None  # canonical checkpoint dtype (config.json torch_dtype / dtype)
    quantization_config: dict[str, Any] | None = None
    rope_scaled: bool = False  # rope scaling stretches the context beyond max_position_embeddings
    source: str = "unknown"
    error: str | None = None

    @property
    def kv_known(self) -> bool:
        return bool(self.num_hidden_layers and self.num_key_value_heads and self.head_dim)

    @property
    def quant_method(self) -> str:
        qc = self.quantization_config or {}
        return text(qc.get("quant_method") or qc.get("quantization_method") or "unknown")


def _weights_bytes(path: str) -> int | None:
    """The total size of the weight files in a model directory; None when there is none (or no listing)."""
    weights = 0
    found = False
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                if entry.name.endswith(WEIGHT_SUFFIXES) and entry.is_file():
                    weights += entry.stat().st_size
                    found = True
    except OSError:
        return None
    return weights if found else None


@lru_cache(maxsize=256)
def read_model_dir(path: str) -> tuple[str | None, int | None, str | None]:
    """(config.json text, total weight bytes, error) of a model directory on the controller; cached per run."""
    config = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        return None, None, f"'{path}' is not a directory on the controller"
    try:
        with open(config, encoding="utf-8") as handle:
            content = handle.read()
    except OSError as exc:
        return None, None, f"'{config}' cannot be read ({exc.strerror or exc})"
    return content, _weights_bytes(path), None


def config_values(config: Mapping[str, Any]) -> dict[str, Any]:
    """The facts the checks use from a Hugging Face config.json (text_config for multimodal models)."""
    nested = config.get("text_config")
    if "num_attention_heads" not in config and isinstance(nested, Mapping):
        merged = dict(nested)
        merged.setdefault("quantization_config", config.get("quantization_config"))
        merged.setdefault("torch_dtype", config.get("torch_dtype") or config.get("dtype"))
        config = merged
    return {
        "num_attention_heads": config.get("num_attention_heads"),
        "num_key_value_heads": config.get("num_key_value_heads"),
        "num_hidden_layers": config.get("num_hidden_layers"),
        "head_dim": config.get("head_dim"),
        "hidden_size": config.get("hidden_size"),
        "max_position_embeddings": config.get("max_position_embeddings"),
        "torch_dtype": config.get("torch_dtype") or config.get("dtype"),
        "quantization_config": config.get("quantization_config"),
        "rope_scaling": config.get("rope_scaling") or config.get("rope_parameters"),
    }


def _from_model_dir(model: str) -> tuple[dict[str, Any], str | None, str | None]:
    """(values, source, error) from a controller model directory's config.json."""
    content, weights, error = read_model_dir(model.rstrip("/") or "/")
    if error:
        return {}, None, error
    try:
        config = json.loads(content or "")
        if not isinstance(config, Mapping):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        return {}, None, f"'{model}/config.json' is not valid JSON ({exc})"
    values = {k: v for k, v in config_values(config).items() if v is not None}
    values.setdefault("weights_bytes", weights)
    return values, f"{model.rstrip('/')}/config.json", None


def _fill(facts: ModelFacts, values: Mapping[str, Any]) -> ModelFacts:
    """Set the facts from the merged values (config.json keys)."""
    facts.num_attention_heads = to_int(values.get("num_attention_heads"))
    facts.num_key_value_heads = to_int(values.get("num_key_value_heads")) or facts.num_attention_heads
    facts.num_hidden_layers = to_int(values.get("num_hidden_layers"))
    facts.head_dim = to_int(values.get("head_dim"))
    hidden = to_int(values.get("hidden_size"))
    if not facts.head_dim and hidden and facts.num_attention_heads:
        facts.head_dim = hidden // facts.num_attention_heads
    facts.max_position_embeddings = to_int(values.get("max_position_embeddings"))
    facts.weights_bytes = to_int(values.get("weights_bytes"))
    facts.dtype = CHECKPOINT_DTYPES.get(text(values.get("torch_dtype")).lower())
    rope = values.get("rope_scaling")
    if isinstance(rope, Mapping):
        facts.rope_scaled = text(rope.get("rope_type") or rope.get("type") or "default") != "default"
    qc = values.get("quantization_config")
    facts.quantization_config = dict(qc) if isinstance(qc, Mapping) and qc else None
    return facts


def model_facts(published: Mapping[str, Any]) -> ModelFacts:
    """Facts about the model of one host: its config.json when the model is a controller directory
    (values there win), completed by the declared vllm_instance_model_facts."""
    declared = published.get("model_facts") or {}
    if not isinstance(declared, Mapping):
        declared = {}
    facts = ModelFacts()
    values: dict[str, Any] = {}
    source = []
    model = text(published.get("model"))
    if published.get("model_is_local") and model:
        values, found, facts.error = _from_model_dir(model)
        source.extend([found] if found else [])
    missing = [key for key in (*FACT_KEYS, "torch_dtype", "quantization_config")
               if values.get(key) is None and declared.get(key) is not None]
    values.update({key: declared[key] for key in missing})
    if missing:
        source.append("vllm_instance_model_facts")
    facts.source = " + ".join(source) or "unknown"
    return _fill(facts, values)
