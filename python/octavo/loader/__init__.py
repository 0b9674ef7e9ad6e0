"""Reading checkpoints: safetensors files (single or sharded, memory-mapped) or a GGUF file."""

from pathlib import Path

from .gguf_file import is_gguf
from .safetensors_files import iter_safetensors, load_model

__all__ = ["iter_safetensors", "load_model", "load_tokenizer"]


def load_tokenizer(path: str | Path):
    """The Hugging Face tokenizer of a checkpoint directory, or of a GGUF file's metadata."""
    from transformers import AutoTokenizer

    if is_gguf(path):
        return AutoTokenizer.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name)
    return AutoTokenizer.from_pretrained(str(path))
