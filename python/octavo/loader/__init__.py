"""Reading checkpoints: safetensors files (single or sharded), memory-mapped."""

from .safetensors_files import iter_safetensors, load_model

__all__ = ["iter_safetensors", "load_model"]
