"""A model's ``generation_config.json``: the sampling defaults its authors recommend, and its
end-of-sequence ids. vLLM's ``--generation-config`` decides where the defaults come from:
"auto" (the default) reads the model's file, "vllm" ignores its sampling fields, and a folder
path reads that folder's file instead. The EOS ids always come from the model's own file."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# generation_config.json field -> SamplingParams field (vLLM's list).
SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass
class GenerationConfig:
    sampling_defaults: dict[str, Any] = field(default_factory=dict)  # SamplingParams names
    eos_token_ids: list[int] = field(default_factory=list)


def _read(folder: Path) -> dict[str, Any]:
    path = folder / "generation_config.json"
    if not folder.is_dir() or not path.is_file():
        return {}
    return json.loads(path.read_text())


def load_generation_config(model_path: str | Path, option: str = "auto") -> GenerationConfig:
    """``option``: "auto", "vllm" or a folder holding a generation_config.json."""
    model_file = _read(Path(model_path))
    eos = model_file.get("eos_token_id")
    eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if option == "vllm":
        return GenerationConfig({}, eos_ids)
    if option == "auto":
        source = model_file
    else:
        folder = Path(option)
        if not (folder / "generation_config.json").is_file():
            raise ValueError(f"generation_config={option!r}: expected 'auto', 'vllm' or a folder with a "
                             "generation_config.json")
        source = _read(folder)
    defaults = {ours: source[theirs] for theirs, ours in SAMPLING_FIELDS.items() if source.get(theirs) is not None}
    return GenerationConfig(defaults, eos_ids)
