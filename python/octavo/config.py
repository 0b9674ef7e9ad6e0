"""Model configuration read from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelConfig:
    """What the model code needs from a checkpoint's config, with HF names.

    ``hf`` keeps the whole parsed config.json (rope scaling and anything architecture-specific
    is read from it).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int  # 0: off
    torch_dtype: torch.dtype
    hf: dict[str, Any] = field(repr=False, default_factory=dict)

    @classmethod
    def from_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        if not hf.get("quantization_config") and hf.get("compression_config"):
            # Older llm-compressor checkpoints keep compressed-tensors' settings under this key
            # (vLLM reads it as the quantization config too).
            hf = {**hf, "quantization_config": {"quant_method": "compressed-tensors", **hf["compression_config"]}}
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError("config.json names no architecture ('architectures' is missing or empty)")
        heads = hf["num_attention_heads"]
        dtype_name = hf.get("torch_dtype") or hf.get("dtype") or "float32"
        window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
        return cls(
            architecture=archs[0],
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 and Qwen2-MoE have q/k/v biases without saying so in their configs (newer
            # transformers write Qwen2-MoE's as qkv_bias).
            attention_bias=bool(hf.get("attention_bias", hf.get(
                "qkv_bias", archs[0] in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")))),
            sliding_window=int(window or 0),
            torch_dtype=_DTYPES.get(str(dtype_name).removeprefix("torch."), torch.float32),
            hf=hf,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        file = Path(path) / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"{file} does not exist: a model directory needs a config.json")
        return cls.from_dict(json.loads(file.read_text()))
