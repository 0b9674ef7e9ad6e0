"""Model registry: Hugging Face architecture name -> Octavo model class."""

from __future__ import annotations

from .gemma3 import Gemma3ForCausalLM
from .llama import LlamaForCausalLM, Qwen3ForCausalLM
from .mixtral import MixtralForCausalLM
from .olmoe import OlmoeForCausalLM
from .qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

# Mistral and Qwen2 are Llama with a sliding window / q,k,v biases, both read from the config.
MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    # Mixture of experts (layers/moe.py)
    "MixtralForCausalLM": MixtralForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def model_class(architecture: str):
    """The class for a config's architecture; ValueError listing the supported ones otherwise."""
    if architecture not in MODELS:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: {', '.join(sorted(MODELS))}")
    return MODELS[architecture]
