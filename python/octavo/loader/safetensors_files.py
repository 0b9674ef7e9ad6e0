"""Tensors of a Hugging Face checkpoint directory, read lazily from memory-mapped safetensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from ..config import ModelConfig
from ..distributed.shards import PPStage, TPShard
from ..layers.quantize import QUANT_METHOD, load_quantized_state, load_quantizing, quantize_model
from ..models import model_class
from .compressed_tensors import METHOD as COMPRESSED_TENSORS
from .compressed_tensors import load_compressed_tensors
from .fp8 import METHOD as FP8
from .fp8 import load_fp8
from .gptq_awq import METHODS as GPTQ_AWQ
from .gptq_awq import load_gptq_awq


def quant_method(config: ModelConfig) -> str | None:
    return (config.hf.get("quantization_config") or {}).get("quant_method")


def reject_foreign_quantization(config: ModelConfig) -> None:
    """A checkpoint quantized by a method Octavo does not read fails here, naming the method."""
    method = quant_method(config)
    if method is not None:
        raise ValueError(f"quantization method {method!r} of this checkpoint is not supported "
                         f"(Octavo reads {', '.join(GPTQ_AWQ)}, {FP8}, {COMPRESSED_TENSORS} int8 (W8A8, W8A16) "
                         f"and {QUANT_METHOD!r} from `octavo quantize`)")


def _files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shards that are not in {path}: {', '.join(missing)}")
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"no safetensors weights in {path} (model.safetensors or an index)")
    return found


def iter_safetensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the checkpoint in ``path``; tensors are mmap-backed."""
    for file in _files(Path(path)):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(path: str | Path, dtype: torch.dtype | str = "auto", load_format: str = "safetensors",
               device: torch.device | str = "cpu", quantization: str | None = None, tp_rank: int = 0,
               tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1, expert_parallel: bool = False):
    """Builds the model for ``path``'s config.json and fills its weights (or, for a ``.gguf``
    file, the model it holds, see gguf_file.py).

    dtype "auto" takes the checkpoint's ``torch_dtype``. load_format "dummy" skips the files and
    fills every weight with small random values (benchmarks of large shapes). The parameters
    are created on ``device``; checkpoint tensors are copied into them as they are read.
    ``quantization`` "int8" / "int4" / "w4a8" / "w8a8" quantizes the projections of a float
    checkpoint as they are read (layers/quantize.py), so the float model is never whole in
    memory. Models whose projections end up quantized are built in CPU memory and moved: there,
    float parameters that quantized weights replace before they are filled take no pages (on a
    GPU they would take their full size). GPTQ / AWQ and compressed-tensors int8 checkpoints keep
    their integers, FP8 checkpoints their E4M3 weights (gptq_awq.py, compressed_tensors.py, fp8.py). ``tp_rank`` of ``tp_size``: build and
    fill only that tensor-parallel rank's part (distributed/shards.py), reading each checkpoint tensor's slice; ``pp_rank`` of
    ``pp_size``: only that pipeline stage's layers. ``expert_parallel``: mixture-of-experts
    layers hold whole experts of the tensor-parallel rank instead of a cut of every expert.
    """
    from .gguf_file import is_gguf, load_gguf_model

    device = torch.device(device)
    if device.type != "cpu":
        from ..device import cpu_only_reason

        reason = cpu_only_reason(path, quantization)
        if reason:
            raise ValueError(f"{path} cannot be loaded on {device}: {reason}; use device='cpu'")
    if is_gguf(path):  # read on the CPU (numpy), then moved: the quantized size, not the float one
        model = load_gguf_model(path, dtype, tp_rank, tp_size, pp_rank, pp_size, expert_parallel)
        return _quantized_after(model.to(device), quantization)
    config = ModelConfig.from_pretrained(path)
    if quantization is not None and quant_method(config) in (COMPRESSED_TENSORS, FP8):
        raise ValueError(f"quantization={quantization!r} needs float weights, but {path} is a {quant_method(config)} "
                         f"checkpoint whose weights are quantized already: load it without quantization")
    if dtype == "auto":
        dtype = config.torch_dtype
    elif isinstance(dtype, str):
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    quantized_files = load_format == "safetensors" and (quantization is not None or quant_method(config) is not None)
    with torch.device("cpu") if quantized_files else device:
        model = model_class(config.architecture)(config, dtype, TPShard.of(config, tp_rank, tp_size, expert_parallel),
                                                 PPStage.of(config, pp_rank, pp_size))
    if load_format == "dummy":
        generator = torch.Generator(device=device).manual_seed(0)
        for param in model.parameters():
            param.data.uniform_(-1e-2, 1e-2, generator=generator)
    elif load_format == "safetensors" and quant_method(config) == QUANT_METHOD:
        tensors = dict(iter_safetensors(path))  # written by `octavo quantize`
        load_quantized_state(model, tensors, config.hf["quantization_config"]["layouts"])
    elif load_format == "safetensors" and quant_method(config) in GPTQ_AWQ:
        tensors = {name: t for name, t in iter_safetensors(path) if not model.held_by_another_rank(name)}
        load_gptq_awq(model, tensors, config.hf["quantization_config"])
    elif load_format == "safetensors" and quant_method(config) == COMPRESSED_TENSORS:
        tensors = {name: t for name, t in iter_safetensors(path) if not model.held_by_another_rank(name)}
        load_compressed_tensors(model, tensors, config.hf["quantization_config"])
    elif load_format == "safetensors" and quant_method(config) == FP8:
        tensors = {name: t for name, t in iter_safetensors(path) if not model.held_by_another_rank(name)}
        load_fp8(model, tensors, config.hf["quantization_config"])
    elif load_format == "safetensors":
        reject_foreign_quantization(config)
        if quantization is not None:
            load_quantizing(model, iter_safetensors(path), quantization)
            return model.eval().to(device)
        model.load_weights(iter_safetensors(path))
    else:
        raise ValueError(f"load_format must be 'safetensors' or 'dummy', got {load_format!r}")
    # A model built on the CPU moves now; one built on the device stays (dummy weights are
    # quantized there).
    return _quantized_after(model.eval(), quantization).to(device)


def _quantized_after(model, quantization: str | None):
    """quantization of a model loaded whole: dummy weights, a GGUF file of float tensors only, or
    the clear error for weights that are quantized already."""
    return model if quantization is None else quantize_model(model, quantization)
