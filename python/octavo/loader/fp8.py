"""FP8 checkpoints (``quantization_config.quant_method`` "fp8", as vLLM reads them: Meta / Neural
Magic / Red Hat FP8 releases, DeepSeek-V3 and Qwen3's FP8 releases), kept in E4M3 at load time.

Each quantized Linear's ``weight`` is float8_e4m3fn [N, K] with
- ``weight_scale`` float32, one per tensor ([] or [1]) or per output row ([N] or [N, 1]):
  w = q * s; or
- ``weight_scale_inv`` float32 [ceil(N / bn), ceil(K / bk)] for the config's
  ``weight_block_size`` [bn, bk] (block-wise): w[n, k] = q[n, k] * s[n // bn, k // bk].

They become the "fp8" weight format (layers/quantize.py): scales per row and group of inputs, so
a per-tensor or per-row scale is a group of K inputs, and a block's scale is repeated over its
rows. The parts of a fused projection (QKV, gate_up) share one weight where their groups agree.
``input_scale`` (activation_scheme "static") scales vLLM's FP8 activations: Octavo multiplies the
weights with the model's float activations (weight-only), so it is not used. Layers the
checkpoint kept in floats (``ignored_layers``) load as floats.
"""

from __future__ import annotations

import torch

from ..layers.linear import QuantizedWeight
from ..layers.quantize import fp8_input_columns, place_quantized

METHOD = "fp8"
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".input_scale")


def check_config(quant: dict) -> None:
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"fp8 checkpoints in format {fmt!r} are not supported (E4M3 weights only)")
    block = quant.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(block) <= 0 or block[1] % 32):
        raise ValueError(f"weight_block_size must be [rows, inputs] with inputs a multiple of 32, got {block}")


def read_weight(prefix: str, tensors: dict[str, torch.Tensor], quant: dict) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(q [N, K] float8_e4m3fn, scales float32 [N, K / g], g) of the Linear at ``prefix``."""
    q = tensors[f"{prefix}.weight"]
    check_codes(f"{prefix}.weight", q)
    n, k = q.shape
    if f"{prefix}.weight_scale_inv" in tensors:
        rows, inputs = quant.get("weight_block_size") or (None, None)
        scale = tensors[f"{prefix}.weight_scale_inv"].float()
        if rows is None or scale.shape != (-(-n // rows), -(-k // inputs)):
            raise ValueError(f"{prefix}.weight_scale_inv has shape {tuple(scale.shape)}, which does not tile "
                             f"[{n}, {k}] in the config's weight_block_size {quant.get('weight_block_size')}")
        return q, scale.repeat_interleave(rows, 0)[:n], inputs
    if f"{prefix}.weight_scale" not in tensors:
        raise ValueError(f"the checkpoint has {prefix}.weight in float8_e4m3fn but no weight_scale(_inv) for it")
    scale = tensors[f"{prefix}.weight_scale"].float().reshape(-1)
    if scale.numel() not in (1, n):
        raise ValueError(f"{prefix}.weight_scale has {scale.numel()} values; expected 1 or {n} (one per output)")
    return q, scale.expand(n)[:, None].contiguous(), k


def check_codes(name: str, q: torch.Tensor) -> None:
    """FP8 weights hold no NaN (quantizers saturate): the CPU kernel reads a NaN code as +-480 (it
    skips the test per weight), so a checkpoint that holds one is refused here."""
    if bool(((q.view(torch.uint8) & 0x7F) == 0x7F).any()):
        raise ValueError(f"checkpoint tensor {name!r} holds NaN")


def dequantized(q: torch.Tensor, scales: torch.Tensor, g: int) -> torch.Tensor:
    full = scales.repeat_interleave(g, 1)[:, :q.shape[1]]  # a last partial block of inputs
    return q.float() * full


def cut(part: tuple[torch.Tensor, torch.Tensor, int], dim: int, begin: int, end: int):
    """A tensor-parallel rank's outputs (dim 0) or inputs (dim 1) [begin, end) of a part, or None
    where an input cut falls inside a group of scales or off the 32-input blocks."""
    q, scales, g = part
    if dim == 0:
        return q[begin:end], scales[begin:end], g
    return fp8_input_columns(q, scales, g, begin, end)


def quantized_weight(parts: list[tuple[torch.Tensor, torch.Tensor, int]]) -> QuantizedWeight | None:
    """One fp8 weight from the parts of a fused projection (rows concatenated), or None when their
    groups differ or do not tile their inputs (the weight is then loaded as floats)."""
    k, g = parts[0][0].shape[1], parts[0][2]
    if any(p[2] != g for p in parts) or k % g:
        if not all(p[1].shape[1] == 1 for p in parts):
            return None
        g = k  # per-row scales of parts cut to different widths: one group per row
    return QuantizedWeight(torch.cat([p[0] for p in parts]), "fp8", k, scales=torch.cat([p[1] for p in parts]),
                           group_size=g)


def load_fp8(model, tensors: dict[str, torch.Tensor], quant: dict) -> None:
    """Float tensors as they are; each FP8 Linear kept in E4M3 wherever all parts of a fused weight
    agree (see place_quantized), else dequantized into the float weight. Tensor parallel: each
    part is cut to this rank's share (``model.shard_slices``); a part that cannot be cut on its
    groups loads as floats, which ``load_weights`` cuts."""
    check_config(quant)
    slices = model.shard_slices()
    whole, parts, floats = {}, {}, []
    for name, tensor in tensors.items():
        if name.endswith(".weight") and tensor.dtype == torch.float8_e4m3fn:
            whole[name] = read_weight(name[: -len(".weight")], tensors, quant)
            where = slices.get(name)
            part = whole[name] if where is None else cut(whole[name], *where[:3])
            if part is not None:
                parts[name] = part
        elif not name.endswith(SCALE_SUFFIXES):
            floats.append((name, tensor))
    shapes = {name: tuple(p[0].shape) for name, p in parts.items()}
    placed = place_quantized(model, shapes, lambda names: quantized_weight([parts[name] for name in names]))
    floats += [(name, dequantized(*part)) for name, part in whole.items() if name not in placed]
    model.load_weights(floats)
