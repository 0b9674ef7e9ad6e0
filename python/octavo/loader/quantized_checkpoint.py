"""``octavo quantize``: a float checkpoint quantized at load time, written back as a checkpoint
that loads without quantizing again (layout in octavo/layers/quantize.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import save_file

from ..layers.quantize import QUANT_METHOD, quantized_state
from .safetensors_files import load_model

# What is copied from the source besides the weights and config.json.
COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
          "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja")


def write_quantized_checkpoint(src: str | Path, dst: str | Path, method: str) -> Path:
    src, dst = Path(src), Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"{dst} already exists and is not an empty directory")
    if not (src / "config.json").is_file():
        raise ValueError(f"{src} is not a Hugging Face checkpoint directory (no config.json); "
                         f"octavo quantize takes float safetensors checkpoints")
    model = load_model(src, "auto", quantization=method)
    tensors, layouts = quantized_state(model)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": QUANT_METHOD, "format": method, "layouts": layouts}
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in COPIED:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    return dst
