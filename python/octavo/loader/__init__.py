"""Reading checkpoints: safetensors files (single or sharded, memory-mapped) or a GGUF file."""

import hashlib
import shutil
import tempfile
from pathlib import Path

from .gguf_file import is_gguf
from .safetensors_files import iter_safetensors, load_model

__all__ = ["iter_safetensors", "load_model", "load_tokenizer"]


def load_tokenizer(path: str | Path):
    """The Hugging Face tokenizer of a checkpoint directory, or of a GGUF file's metadata."""
    from transformers import AutoTokenizer

    if is_gguf(path):
        return _gguf_tokenizer(Path(path))
    return AutoTokenizer.from_pretrained(str(path))


def _gguf_tokenizer(path: Path):
    """transformers converts a GGUF file's tokenizer in seconds (it parses the file's whole
    metadata again), so the converted tokenizer is saved once per file (its path, size and
    modification time) in Octavo's cache and loaded from there afterwards."""
    from transformers import AutoTokenizer

    from ..default_model import cache_dir

    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:24]
    cached = cache_dir() / "gguf-tokenizers" / key
    if (cached / "tokenizer_config.json").is_file():  # it appears only through a rename: complete
        return AutoTokenizer.from_pretrained(str(cached))
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", suffix=".partial", dir=cached.parent))
        try:
            # save_jinja_files=False keeps the chat template inside tokenizer_config.json.
            tokenizer.save_pretrained(tmp, save_jinja_files=False)
            tmp.rename(cached)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass  # a read-only cache, or another process saved it first: this load needs no cache
    return tokenizer
