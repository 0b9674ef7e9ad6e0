"""The device an engine runs on. "auto" takes the GPU when both torch and this build of Octavo
can use one, and the CPU otherwise."""

from __future__ import annotations

import torch

from . import _C


def cuda_unusable_reason() -> str | None:
    """Why CUDA cannot be used here, or None when it can."""
    if not _C.cuda_compiled():
        return "this build of Octavo has no CUDA kernels (it was built without nvcc)"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    return None


CUDA_HEAD_SIZES = (64, 128, 256)  # the attention kernels compiled in csrc/kernels/cuda/attention_d*.cu
CUDA_MAX_GROUP = 16  # query heads per KV head the CUDA attention kernels take (kMaxGroup)


def cpu_only_reason(model, quantization: str | None = None) -> str | None:
    """Why this model, quantized at load with ``quantization``, cannot run on a GPU yet, or None
    when it can. (Quantized weights can: GGUF blocks, GPTQ / AWQ, Octavo's int8 / int4, but not
    w4a8 / w8a8 / gguf_a8 nor compressed-tensors W8A8, whose int8 activations are a CPU kernel's; see
    layers/linear.py.)"""
    from .config import ModelConfig
    from .loader.compressed_tensors import METHOD as COMPRESSED_TENSORS
    from .loader.compressed_tensors import quantizes_activations
    from .loader.gguf_file import gguf_config, is_gguf

    reasons = {method: f"quantization '{method}' multiplies int8 activations on the CPU only (use '{weights}' on "
                       "a GPU)" for method, weights in (("w4a8", "int4"), ("w8a8", "int8"))}
    reasons["gguf_a8"] = "quantization 'gguf_a8' multiplies int8 activations on the CPU only (load without it on a GPU)"
    if quantization in reasons:
        return reasons[quantization]
    config = gguf_config(model) if is_gguf(model) else ModelConfig.from_pretrained(model)
    quant = config.hf.get("quantization_config") or {}
    if quant.get("format") in reasons:  # from `octavo quantize`
        return reasons[quant["format"]]
    if quant.get("quant_method") == COMPRESSED_TENSORS and quantizes_activations(quant):
        return ("compressed-tensors W8A8 checkpoints multiply int8 activations on the CPU only (format "
                "'int8_a8'; the CUDA kernels take int8 weights with float activations only)")
    if config.head_dim not in CUDA_HEAD_SIZES:
        return f"head size {config.head_dim} has no CUDA attention kernel (compiled: {CUDA_HEAD_SIZES})"
    group = config.num_attention_heads // config.num_key_value_heads
    if group > CUDA_MAX_GROUP:
        return f"{group} query heads per KV head; the CUDA attention kernels take at most {CUDA_MAX_GROUP}"
    return _experts_cpu_only_reason(config.hf)


def _experts_cpu_only_reason(hf: dict) -> str | None:
    """The CUDA fused_moe reads rows of 32 inputs: the hidden size and each expert's width must be
    multiples of 32 (every released MoE model's are)."""
    if not (hf.get("num_experts") or hf.get("num_local_experts")):
        return None
    width = hf.get("moe_intermediate_size") or hf.get("intermediate_size")
    for name, size in (("hidden size", hf.get("hidden_size")), ("expert intermediate size", width)):
        if size and size % 32:
            return f"its {name} {size} is not a multiple of 32, which the CUDA fused_moe kernel reads in"
    return None


def resolve_device(requested: str | torch.device | None = "auto") -> torch.device:
    """"auto" (or None), "cpu", "cuda" or "cuda:N" -> a torch.device; ValueError, with the
    reason, for anything else or a CUDA device that cannot be used."""
    if requested is None or requested == "auto":
        return torch.device("cpu") if cuda_unusable_reason() else torch.device("cuda", torch.cuda.current_device())
    try:
        device = torch.device(requested)
    except RuntimeError:  # torch's message lists every device type it knows
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {str(device or requested)!r}")
    if device.type == "cuda":
        reason = cuda_unusable_reason()
        if reason:
            raise ValueError(f"device {str(device)!r} cannot be used: {reason}")
        count = torch.cuda.device_count()
        if device.index is not None and not 0 <= device.index < count:
            raise ValueError(f"device {str(device)!r} does not exist: this machine has {count} CUDA device(s)")
        return torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    return device
