"""Model shapes for benchmarks with dummy (random) weights: a config.json written on demand, for
``LLM(dir, load_format="dummy", skip_tokenizer_init=True)``. No weights or tokenizer are needed."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

# Meta-Llama-3-8B's published config.json, less what Octavo does not read.
LLAMA_3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
    "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "attention_bias": False,
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
}
# allenai/OLMoE-1B-7B-0924's published config.json (64 experts, 8 per token; 1.3B of its 6.9B
# parameters active per token), less what Octavo does not read.
OLMOE_1B_7B = {
    "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "torch_dtype": "bfloat16",
    "vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 1024, "num_hidden_layers": 16,
    "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
    "norm_topk_prob": False, "clip_qkv": None, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "attention_bias": False, "tie_word_embeddings": False, "hidden_act": "silu",
    "pad_token_id": 1, "eos_token_id": 50279,
}
SHAPES = {"llama-3-8b": LLAMA_3_8B, "olmoe-1b-7b": OLMOE_1B_7B}


def dummy_model_dir(name: str) -> Path:
    """A fresh directory holding the config.json of shape ``name``."""
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    path = Path(tempfile.mkdtemp(prefix=f"octavo-{name}-"))
    (path / "config.json").write_text(json.dumps(SHAPES[name], indent=2))
    return path


def model_arguments(model: str | None, dummy_shape: str | None) -> dict:
    """``LLM`` arguments for a benchmark's --model / --dummy-shape: the model as given, or the
    shape's config with random weights and no tokenizer."""
    if not dummy_shape:
        return {"model": model}
    return {"model": str(dummy_model_dir(dummy_shape)), "load_format": "dummy", "skip_tokenizer_init": True}
