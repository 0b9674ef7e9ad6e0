"""Tensors of a Hugging Face checkpoint directory, read lazily from memory-mapped safetensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from ..config import ModelConfig
from ..layers.quantize import QUANT_METHOD, load_quantized_state, replace_weight
from .gptq_awq import METHODS as GPTQ_AWQ
from .gptq_awq import check_config, quantized_weight, unpack
from ..models import model_class


def quant_method(config: ModelConfig) -> str | None:
    return (config.hf.get("quantization_config") or {}).get("quant_method")


def reject_foreign_quantization(config: ModelConfig) -> None:
    """A checkpoint quantized by a method Octavo does not read fails here, naming the method."""
    method = quant_method(config)
    if method is not None:
        raise ValueError(f"quantization method {method!r} of this checkpoint is not supported "
                         f"(Octavo reads {', '.join(GPTQ_AWQ)} and {QUANT_METHOD!r} from `octavo quantize`)")


def load_gptq_awq(model, tensors: dict[str, torch.Tensor], quant: dict) -> None:
    """Float tensors as they are; each GPTQ / AWQ Linear unpacked, dequantized for the shape
    checks of load_weights, then kept in int4 wherever its fused parts agree (gptq_awq.py)."""
    check_config(quant)
    method = quant["quant_method"]
    zero_offset = 1 if method == "gptq" and quant.get("checkpoint_format", "gptq") == "gptq" else 0
    unpacked, floats = {}, []
    for name, tensor in tensors.items():
        if name.endswith(".qweight"):
            prefix = name[: -len(".qweight")]
            parts = unpack(method, tensor, tensors[f"{prefix}.qzeros"], tensors[f"{prefix}.scales"],
                           tensors.get(f"{prefix}.g_idx"), zero_offset)
            unpacked[f"{prefix}.weight"] = parts
            floats.append((f"{prefix}.weight", quantized_weight([parts], _group_size(parts)).dequantize()))
        elif not name.endswith((".qzeros", ".scales", ".g_idx")):
            floats.append((name, tensor))
    model.load_weights(floats)
    fused: dict[int, list] = {}
    for name, (param, start, _) in model._targets().items():
        if name in unpacked:
            fused.setdefault(id(param), []).append((start, name, param))
    owners = {id(p): (m, attr) for m in model.modules() for attr, p in m._parameters.items() if p is not None}
    for key, parts in fused.items():
        ordered = [unpacked[name] for _, name, _ in sorted(parts, key=lambda p: p[0])]
        if len(parts) == len([1 for n, (p, _, _) in model._targets().items() if id(p) == key]):
            weight = quantized_weight(ordered, _group_size(ordered[0]))
            if weight is not None:
                replace_weight(*owners[key], weight)


def _group_size(parts: tuple) -> int:
    q, _, scales, _ = parts
    return q.shape[1] // scales.shape[1]


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


def load_model(path: str | Path, dtype: torch.dtype | str = "auto", load_format: str = "safetensors"):
    """Builds the model for ``path``'s config.json and fills its weights (or, for a ``.gguf``
    file, the model it holds, see gguf_file.py).

    dtype "auto" takes the checkpoint's ``torch_dtype``. load_format "dummy" skips the files and
    fills every weight with small random values (benchmarks of large shapes).
    """
    from .gguf_file import is_gguf, load_gguf_model

    if is_gguf(path):
        return load_gguf_model(path, dtype)
    config = ModelConfig.from_pretrained(path)
    if dtype == "auto":
        dtype = config.torch_dtype
    elif isinstance(dtype, str):
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    model = model_class(config.architecture)(config, dtype)
    if load_format == "dummy":
        generator = torch.Generator().manual_seed(0)
        for param in model.parameters():
            param.data.uniform_(-1e-2, 1e-2, generator=generator)
    elif load_format == "safetensors" and config.hf.get("quantization_config", {}).get("quant_method") == QUANT_METHOD:
        tensors = dict(iter_safetensors(path))  # written by `octavo quantize`
        load_quantized_state(model, tensors, config.hf["quantization_config"]["layouts"])
    elif load_format == "safetensors" and quant_method(config) in GPTQ_AWQ:
        load_gptq_awq(model, dict(iter_safetensors(path)), config.hf["quantization_config"])
    elif load_format == "safetensors":
        reject_foreign_quantization(config)
        model.load_weights(iter_safetensors(path))
    else:
        raise ValueError(f"load_format must be 'safetensors' or 'dummy', got {load_format!r}")
    return model.eval()
